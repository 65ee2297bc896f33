"""Every MCP tool through the in-memory client with inputs generated from its published schema
(see _rel_fuzz.py). CI runs a reduced, fixed-seed count; benchmarks/reliability.py runs 5,000 per tool."""

from __future__ import annotations

from _rel_common import inert_server, pools_from
from _rel_fuzz import all_names, fuzz_tool
from anyio.from_thread import start_blocking_portal
from mcp import Client

CI_INPUTS_PER_TOOL = 60


def test_no_generated_input_gets_a_traceback_a_hang_a_nan_or_a_nameless_rejection(tmp_path):
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(Client(inert_server(tmp_path))) as client:
        tools = portal.call(client.list_tools).tools
        pools = portal.call(pools_from, client)
        names = all_names(tools, pools)
        reports = [fuzz_tool(portal, client, t, pools, names, CI_INPUTS_PER_TOOL, derandomize=True) for t in tools]
    for r in reports:
        print(f"{r.tool}: {r.tried} inputs, {r.rejected} rejected, {len(r.failures)} failures, "
              f"slowest {r.slowest_cpu_s:.2f} CPU s")
    failures = [f"{r.tool}: {why} <- {inp}" for r in reports for inp, why in r.failures]
    assert failures == [], "\n".join(failures)
    assert all(r.tried == CI_INPUTS_PER_TOOL for r in reports)
    # The inputs reach the core, not only the argument checks: most tools answer some of them.
    answered = {r.tool for r in reports if r.tried > r.rejected}
    assert {"recommend_parallelism", "evaluate_plan", "estimate_memory", "check_mfu"} <= answered, answered
