"""Reliability and security figures (issue 19): hostile inputs, injection, HTTP transport, load, job-system faults.

The full counts of what tests/reliability runs reduced in CI, with the same code (tests/reliability/_rel_*.py):
- fuzzing: N inputs per MCP tool (default 5,000) generated from each tool's published input schema,
  through the in-memory client; inputs tried, rejected, answered, failures and the slowest call;
- injection: every payload through every string that reaches a shell, Slurm or a path; tried /
  rejected / run under bash with stand-ins / executed (must be 0);
- HTTP transport: the checks of tests/reliability/test_http.py against a real server process;
- load: concurrent mixed calls over streamable HTTP on 127.0.0.1 (default 200, 50 of them check_mfu
  on a 10 MB log); failures, p50/p99 latency, server RSS before and after; a cheap call during searches;
- faults: tests/reliability/test_faults.py (the Slurm ones when a local Slurm is up), each with its
  final job state.

    .venv/bin/python benchmarks/reliability.py [--fuzz-per-tool 5000] [--load-calls 200] [--big-logs 50]
    .venv/bin/python benchmarks/reliability.py --only fuzz --fuzz-tool recommend_parallelism   # one tool's rows

Writes benchmarks/results/reliability.txt (and prints it).
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from importlib.metadata import version
from pathlib import Path

import anyio
from anyio.from_thread import start_blocking_portal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "reliability"))

import _rel_common as common  # noqa: E402
import _rel_fuzz as fuzz  # noqa: E402
import _rel_inject as inject  # noqa: E402
import _rel_load as load  # noqa: E402
from mcp import Client  # noqa: E402

from mcore_advisor.launcher.backends.local import LocalBackend  # noqa: E402
from mcore_advisor.launcher.backends.slurm_cli import SlurmCliBackend  # noqa: E402
from mcore_advisor.launcher.jobs import JobManager  # noqa: E402
from mcore_advisor.launcher.store import JobStore  # noqa: E402
from mcore_advisor.server.app import build_server  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "reliability.txt"
FAILURES_SHOWN = 6  # distinct failure reasons listed per tool


def header() -> list[str]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return [
        "# mcore-advisor reliability and security figures (benchmarks/reliability.py)",
        f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; commit {commit}{'+ (uncommitted changes)' if dirty else ''}",
        f"host: {platform.node()}, {os.cpu_count()} CPUs (shared), load average at start {os.getloadavg()[0]:.1f}; "
        f"Python {platform.python_version()}, mcp {version('mcp')}, pydantic {version('pydantic')}, hypothesis {version('hypothesis')}",
        "",
    ]


# ---- fuzzing ------------------------------------------------------------------------------------------------


def run_fuzz(per_tool: int, only: list[str] | None = None) -> list[str]:
    lines = [f"## Fuzzing: {per_tool:,} generated inputs per tool through the in-memory MCP client",
             f"failure = an exception or traceback reaching the client, 'internal error', NaN/Infinity in an answer, "
             f"a call over {fuzz.CALL_LIMIT_S:g} CPU s or {fuzz.WALL_LIMIT_S:g} s wall, or a rejection naming no field",
             "", f"{'tool':24} {'tried':>7} {'rejected':>8} {'answered':>8} {'failures':>8} {'slowest CPU s':>13} {'wall s':>7}  slowest input"]
    details: list[str] = []
    with tempfile.TemporaryDirectory() as tmp, start_blocking_portal() as portal, \
            portal.wrap_async_context_manager(Client(common.inert_server(Path(tmp)))) as client:
        tools = portal.call(client.list_tools).tools
        pools = portal.call(common.pools_from, client)
        names = fuzz.all_names(tools, pools)
        total = collections.Counter()
        for tool in tools:
            if only and tool.name not in only:
                continue
            t0 = time.monotonic()
            r = fuzz.fuzz_tool(portal, client, tool, pools, names, per_tool)
            print(f"  fuzz {tool.name}: {r.tried} in {time.monotonic() - t0:.0f} s, {len(r.failures)} failures", flush=True)
            lines.append(f"{r.tool:24} {r.tried:7,} {r.rejected:8,} {r.tried - r.rejected:8,} {len(r.failures):8,} "
                         f"{r.slowest_cpu_s:13.2f} {r.slowest_s:7.2f}  {r.slowest_input[:110]}")
            total.update(tried=r.tried, rejected=r.rejected, failures=len(r.failures))
            seen: collections.Counter[str] = collections.Counter()
            for inp, why in r.failures:
                key = why[:60]
                seen[key] += 1
                if seen[key] == 1 and len(seen) <= FAILURES_SHOWN:
                    details.append(f"- {r.tool}: {why[:300]}\n    input: {inp[:300]}")
            if len(seen) > FAILURES_SHOWN:
                details.append(f"- {r.tool}: ... {len(seen) - FAILURES_SHOWN} more distinct failure reasons")
    lines.append(f"{'all tools':24} {total['tried']:7,} {total['rejected']:8,} {total['tried'] - total['rejected']:8,} "
                 f"{total['failures']:8,}   (host load average {os.getloadavg()[0]:.1f} at the end)")
    lines += ["", "failures (one input per distinct reason):" if details else "failures: none", *details, ""]
    return lines


# ---- injection ---------------------------------------------------------------------------------------------


def run_injection() -> list[str]:
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        bin_dir, canary = tmp / "bin", tmp / "canary"
        inject.make_standins(bin_dir)
        factories = {"slurm": lambda: SlurmCliBackend(bin_dir=str(bin_dir), env={"ARGV_LOG": str(tmp / "sbatch.log")}),
                     "local": LocalBackend}
        server = build_server(manager=JobManager(store=JobStore(tmp / "jobs.sqlite3"), job_root=tmp / "jobs",
                                                 backend_factories=factories))

        async def go() -> inject.InjectionReport:
            async with Client(server) as client:
                return await inject.run_injection(client, tmp / "sandbox", bin_dir, canary, tmp / "jobs")

        r = anyio.run(go)
        n_payloads = len(inject.payloads(canary))
    fields = len(inject.render_cases("x")) + len(inject.job_cases("x"))
    return [
        f"## Injection: {n_payloads} payloads x {fields} string fields (render_launch_script options, run_profile_job "
        "name / Slurm partition and account / model name)",
        "payloads: ; $( ) backticks quotes newlines CR leading '-' '--wrap=' '|' '&&' #SBATCH lines ../ absolute paths and globs",
        f"tried {r.tried}, rejected naming the field {r.rejected}, accepted {r.rendered}, scripts run under bash with "
        f"stand-ins {r.scripts_run}, values seen whole in one argv element {r.intact}, EXECUTED {r.executed}",
        f"a plain Slurm submission through the stand-in sbatch ran its batch script to srun: {r.baseline_submitted}",
        *(["problems:", *[f"- {p}" for p in r.problems]] if r.problems else ["problems: none"]),
        "",
    ]


# ---- load -------------------------------------------------------------------------------------------------------


def run_load(calls_n: int, big_logs: int) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = common.serve_http(Path(tmp))
        try:
            common.wait_http(url, proc)
            load_before = os.getloadavg()[0]
            rss_start = common.rss_mb(proc.pid)
            calls = load.call_mix(calls_n, big_logs, load.big_log())
            expected = anyio.run(load.expected_answers, url, calls)
            rss_warm = common.rss_mb(proc.pid)
            r = anyio.run(load.run_load, url, calls, expected)
            rss_after = common.rss_mb(proc.pid)
            alone, during = anyio.run(load.cheap_while_searching, url)
        finally:
            common.stop(proc)
    per_tool = [f"  {tool}: {len(v)} calls, p50 {r.pct(0.5, v):.2f} s, p99 {r.pct(0.99, v):.2f} s" for tool, v in sorted(r.by_tool.items())]
    return [
        f"## Load: {calls_n} concurrent mixed calls over streamable HTTP on 127.0.0.1 (4 sessions), {big_logs} of them "
        "check_mfu on a 10 MB Megatron log; each answer compared with the same call made alone",
        f"requests {r.requests}, failures {len(r.failures)}, p50 {r.pct(0.5):.2f} s, p99 {r.pct(0.99):.2f} s, "
        f"all answered in {r.wall_s:.1f} s (host load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after)",
        *per_tool,
        f"server RSS: {rss_start:.0f} MB at start, {rss_warm:.0f} MB after each call once, {rss_after:.0f} MB after the load",
        f"cheap call (evaluate_plan) median {load.median(alone) * 1000:.0f} ms alone, {load.median(during) * 1000:.0f} ms "
        f"while 3 searches ({load.HEAVY_SEARCH['model']} on {load.HEAVY_SEARCH['num_gpus']} GPUs) run",
        *(["failures:", *[f"- {f}" for f in r.failures[:20]]] if r.failures else []),
        "",
    ]


# ---- pytest-based sections (HTTP transport, faults) ------------------------------------------------------------------


def run_pytest(title: str, test_file: str) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"tests/reliability/{test_file}",
                        f"--junitxml={xml}", "-o", "junit_family=legacy"], cwd=ROOT, capture_output=True, text=True)
        root = ET.parse(xml).getroot()
    lines = [title]
    for case in root.iter("testcase"):
        name = case.get("name", "")
        result = "FAILED" if case.find("failure") is not None or case.find("error") is not None else (
            "skipped" if case.find("skipped") is not None else "passed")
        outcome = next((p.get("value") for p in case.iter("property") if p.get("name") == "outcome"), "")
        why = case.find("skipped").get("message", "") if result == "skipped" else ""
        lines.append(f"- [{result}] {name}" + (f": {outcome}" if outcome else "") + (f" ({why})" if why else ""))
    return [*lines, ""]


SECTIONS = ("injection", "http", "load", "faults", "fuzz")


def section(name: str, a: argparse.Namespace) -> list[str]:
    if name == "injection":
        return run_injection()
    if name == "http":
        return run_pytest("## HTTP transport (tests/reliability/test_http.py against `mcore-advisor serve --http` processes)", "test_http.py")
    if name == "load":
        return run_load(a.load_calls, a.big_logs)
    if name == "faults":
        return run_pytest("## Faults of the job system (tests/reliability/test_faults.py): each with its final state", "test_faults.py")
    return run_fuzz(a.fuzz_per_tool, a.fuzz_tool)


def merge(old: str, name: str, new: list[str]) -> str:
    """`old` (a previous results file) with the section of that name replaced by `new`."""
    blocks = old.split("\n## ")
    titles = {"injection": "Injection", "http": "HTTP transport", "load": "Load", "faults": "Faults", "fuzz": "Fuzzing"}
    body = "\n".join(new).removeprefix("## ")
    for i, block in enumerate(blocks):
        if i and block.startswith(titles[name]):
            blocks[i] = body.rstrip("\n") + ("\n" if i < len(blocks) - 1 else "")
    return "\n## ".join(blocks)


def _rows_total(rows: list[str]) -> str:
    n = [sum(int(r.split()[i].replace(",", "")) for r in rows) for i in (1, 2, 3, 4)]
    return f"{'all tools':24} {n[0]:7,} {n[1]:8,} {n[2]:8,} {n[3]:8,}"


def merge_fuzz_tools(old: str, new: list[str], tools: list[str], stamp: str) -> str:
    """`old` with only these tools' rows and failure lines of the fuzzing section replaced by `new`'s
    (the totals row recomputed from the rows), and `stamp` noting the rerun."""
    blocks = old.split("\n## ")
    i = next(i for i, b in enumerate(blocks) if i and b.startswith("Fuzzing"))
    lines = blocks[i].split("\n")
    first = next(j for j, ln in enumerate(lines) if ln.startswith("tool "))
    end = next(j for j, ln in enumerate(lines) if ln.startswith("all tools"))
    fresh = {ln.split()[0]: ln for ln in new if ln.split() and ln.split()[0] in tools}
    rows = [fresh.get(ln.split()[0], ln) for ln in lines[first + 1:end]]
    tail = lines[end + 1:]
    details, k = [], 0
    while k < len(tail):  # failure entries: "- tool: why" plus indented lines
        ln = tail[k]
        k += 1
        if ln.startswith("- "):
            entry = [ln]
            while k < len(tail) and tail[k].startswith("    "):
                entry.append(tail[k])
                k += 1
            if ln[2:].split(":")[0] not in tools:
                details += entry
    start = next((j for j, ln in enumerate(new) if ln.startswith("failures")), len(new))
    details += [ln for ln in new[start + 1:] if ln.startswith(("- ", "    "))]
    total_run = [ln for ln in tail if ln.startswith("total run time") or ln.startswith("(")]
    body = [*lines[:first + 1], *rows, _rows_total(rows), "",
            "failures (one input per distinct reason):" if details else "failures: none", *details, "", *total_run, stamp, ""]
    blocks[i] = "\n".join(body).rstrip("\n") + ("\n" if i < len(blocks) - 1 else "")
    return "\n## ".join(blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fuzz-per-tool", type=int, default=5000)
    ap.add_argument("--load-calls", type=int, default=200)
    ap.add_argument("--big-logs", type=int, default=50)
    ap.add_argument("--only", choices=SECTIONS, action="append",
                    help="rerun only these sections and replace them in the existing results file")
    ap.add_argument("--fuzz-tool", action="append",
                    help="fuzz only this tool (repeatable); with --only fuzz, only its rows are replaced")
    a = ap.parse_args()
    logging.getLogger("mcp").setLevel(logging.CRITICAL)  # the SDK logs every rejected call
    t0 = time.monotonic()
    if a.only:
        text = OUT.read_text()
        load0 = os.getloadavg()[0]
        for name in a.only:
            stamp = f"(section rerun {time.strftime('%Y-%m-%d %H:%M:%S %Z')})"
            if name == "fuzz" and a.fuzz_tool:
                stamp = (f"({', '.join(a.fuzz_tool)} rerun {time.strftime('%Y-%m-%d %H:%M:%S %Z')} at {a.fuzz_per_tool:,} "
                         f"inputs, commit {header()[1].split('commit ')[1]}, host load average {load0:.1f} at start)")
                text = merge_fuzz_tools(text, section(name, a), a.fuzz_tool, stamp)
            else:
                text = merge(text, name, [*section(name, a), stamp, ""])
        OUT.write_text(text)
        print(text)
        return
    out = header()
    for name in SECTIONS:
        out += section(name, a)
        print("\n".join(out), flush=True)
    out.append(f"total run time {time.monotonic() - t0:.0f} s")
    OUT.write_text("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
