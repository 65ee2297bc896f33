"""The MCP server through a real client: in memory for most behaviour, over stdio for the wire."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

import pytest
from mcp import Client, StdioServerParameters

from mcore_advisor.launcher.jobs import JobManager
from mcore_advisor.launcher.store import JobStore
from mcore_advisor.server.app import build_server

pytestmark = pytest.mark.anyio

TOOLS = {
    "recommend_parallelism", "evaluate_plan", "estimate_memory", "check_mfu", "render_launch_script",
    "render_chart", "run_profile_job", "get_job", "list_jobs", "cancel_job",
}
READ_ONLY = {"recommend_parallelism", "evaluate_plan", "estimate_memory", "check_mfu", "render_launch_script",
             "render_chart", "get_job", "list_jobs"}
# image content goes without an output schema: clients drop images next to structured content
NO_OUTPUT_SCHEMA = {"render_chart"}
HAVE_MEGATRON = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("megatron") is not None

LLAMA70B_64 = {
    "model": {"name": "llama3-70b"},
    "cluster": {"gpu": "h100-sxm", "num_gpus": 64},
    "training": {"seq_length": 4096, "global_batch_size": 128, "micro_batch_size": 1},
    "parallelism": {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 2, "sequence_parallel": True},
}
TINY = {
    "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 256},
    "cluster": {"num_gpus": 1},
    "training": {"seq_length": 64, "global_batch_size": 4, "micro_batch_size": 2},
    "parallelism": {},
    "implementation": {"transformer_impl": "local"},
}


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def server(tmp_path):
    return build_server(manager=JobManager(store=JobStore(tmp_path / "jobs.sqlite"), job_root=tmp_path / "jobs"))


def _text(res) -> str:
    return " ".join(getattr(c, "text", "") for c in res.content)


async def _check_listing(client: Client) -> None:
    tools = {t.name: t for t in (await client.list_tools()).tools}
    assert set(tools) == TOOLS
    for name, t in tools.items():
        assert t.input_schema["type"] == "object", name
        if name in NO_OUTPUT_SCHEMA:
            assert t.output_schema is None, name
        else:
            assert t.output_schema is not None and t.output_schema.get("type") == "object", name
        assert bool(t.annotations.read_only_hint) == (name in READ_ONLY), name
    assert tools["cancel_job"].annotations.destructive_hint is True
    resources = (await client.list_resources()).resources
    uris = {str(r.uri) for r in resources}
    assert {"mcore://hardware", "mcore://models", "mcore://published-runs", "mcore://seed-claims"} <= uris
    templates = {t.uri_template for t in (await client.list_resource_templates()).resource_templates}
    assert "mcore://plans/{plan_id}" in templates
    for uri in uris:
        body = (await client.read_resource(uri)).contents[0].text
        assert json.loads(body), uri


async def test_lists_every_tool_with_schemas_and_reads_every_resource(server):
    async with Client(server) as client:
        await _check_listing(client)
        model = json.loads((await client.read_resource("mcore://models/llama3-70b")).contents[0].text)
        assert model["spec"]["num_query_groups"] == 8
        hw = json.loads((await client.read_resource("mcore://hardware")).contents[0].text)
        h100 = next(g for g in hw if g["key"] == "h100-sxm")
        assert h100["bf16_dense_tflops"] == 989.4  # dense; 1979 is the 2:4-sparse figure


async def test_evaluate_plan_returns_memory_and_performance(server):
    async with Client(server) as client:
        res = await client.call_tool("evaluate_plan", {"plan": LLAMA70B_64})
        assert res.is_error is False, _text(res)
        out = res.structured_content
        assert out["feasible"] is True
        perf = out["performance"]
        assert 0 < perf["mfu_bf16_causal_pct"] < 70
        assert perf["model_tflops_per_gpu_full"] > perf["model_tflops_per_gpu_causal"]
        assert out["memory"]["peak_allocated_gib"] > 10


async def test_implementation_choices_reach_the_tools_through_mcp(server):
    plan = {**LLAMA70B_64, "implementation": {"gradient_accumulation_fusion": False, "manual_gc": True,
                                              "manual_gc_interval": 100}}
    async with Client(server) as client:
        fused = (await client.call_tool("evaluate_plan", {"plan": LLAMA70B_64})).structured_content
        res = await client.call_tool("evaluate_plan", {"plan": plan})
        assert res.is_error is False, _text(res)
        # the separate main_grad add costs time; TE's cached dummy wgrads are gone from memory: on the
        # most-loaded (first) stage at TP8, 2 B x 8192 x (1280 + 1024 + 7168 + 3584) for qkv, proj, fc1, fc2
        assert res.structured_content["performance"]["iteration_time_s"] > fused["performance"]["iteration_time_s"]
        saved = fused["memory"]["peak_allocated_gib"] - res.structured_content["memory"]["peak_allocated_gib"]
        assert saved * 2**30 == pytest.approx(2 * 8192 * (1280 + 1024 + 7168 + 3584))
        rendered = await client.call_tool("render_launch_script", {"plan": plan, "launcher": "slurm"})
        assert rendered.is_error is False, _text(rendered)
        art = rendered.structured_content
        args = art["megatron_args"]
        assert "--no-gradient-accumulation-fusion" in args and "--manual-gc" in args
        assert args[args.index("--manual-gc-interval") + 1] == "100"
        bad = await client.call_tool("evaluate_plan", {"plan": {**LLAMA70B_64, "implementation": {"manual_gc_interval": -1}}})
        assert bad.is_error is True and "manual_gc_interval" in _text(bad)


async def test_unknown_model_is_a_tool_error_naming_the_field_and_known_keys(server):
    async with Client(server) as client:
        res = await client.call_tool("evaluate_plan", {"plan": {**LLAMA70B_64, "model": {"name": "llama-9000"}}})
        assert res.is_error is True
        assert "model.name" in _text(res) and "llama3-70b" in _text(res)
        assert "Traceback" not in _text(res)


async def test_a_string_for_an_integer_is_a_tool_error_naming_the_field(server):
    async with Client(server) as client:
        bad = {**LLAMA70B_64, "cluster": {"gpu": "h100-sxm", "num_gpus": "lots"}}
        res = await client.call_tool("estimate_memory", {"plan": bad})
        assert res.is_error is True
        assert "num_gpus" in _text(res)


async def test_unknown_gpu_lists_the_catalog(server):
    async with Client(server) as client:
        res = await client.call_tool("estimate_memory", {"plan": {**LLAMA70B_64, "cluster": {"gpu": "h1000", "num_gpus": 64}}})
        assert res.is_error is True
        assert "h100-sxm" in _text(res) and "cluster.gpu" in _text(res)


async def test_tp3_with_64_heads_is_infeasible_with_a_fix(server):
    async with Client(server) as client:
        plan = {**LLAMA70B_64, "cluster": {"gpu": "h100-sxm", "num_gpus": 48},
                "parallelism": {"tensor_model_parallel_size": 3, "pipeline_model_parallel_size": 1}}
        res = await client.call_tool("evaluate_plan", {"plan": plan})
        assert res.is_error is False  # an infeasible plan is a result, not an error
        out = res.structured_content
        assert out["feasible"] is False
        heads = [f for f in out["findings"] if f["code"] == "heads_not_divisible_by_tp"]
        assert heads and "parallelism.tensor_model_parallel_size" in heads[0]["fields"]
        assert "2, 4 or 8" in heads[0]["fix"] or "4 or 8" in heads[0]["fix"]


async def test_63_gpus_for_tp8_is_infeasible_with_the_nearest_counts(server):
    async with Client(server) as client:
        plan = {**LLAMA70B_64, "cluster": {"gpu": "h100-sxm", "num_gpus": 63},
                "parallelism": {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 1}}
        out = (await client.call_tool("evaluate_plan", {"plan": plan})).structured_content
        world = [f for f in out["findings"] if "cluster.num_gpus" in f["fields"] and f["severity"] == "error"]
        assert world and "56" in world[0]["fix"] and "64" in world[0]["fix"]


async def test_check_mfu_flags_the_sparse_peak_claim(server):
    async with Client(server) as client:
        res = await client.call_tool("check_mfu", {
            "plan": LLAMA70B_64, "reported_tflops_per_gpu": 390.0, "claimed_mfu_pct": 47.0})
        assert res.is_error is False, _text(res)
        assert "39.4" in _text(res)  # 390 / 989.4 dense peak
        assert res.structured_content["peak_tflops_per_gpu"] == 989.4


async def test_render_profile_target_fills_the_job_spec(server):
    async with Client(server) as client:
        res = await client.call_tool("render_launch_script", {"plan": TINY, "target": "profile", "detail": "full"})
        assert res.is_error is False, _text(res)
        assert "mcore_advisor.launcher.entry.profile" in _text(res)  # the script is the text answer
        out = res.structured_content["full"]
        assert json.loads(out["spec_json"])["model"]["hidden_size"] == 64


async def test_rejected_submission_creates_no_job(server):
    async with Client(server) as client:
        bad = {**TINY, "parallelism": {"tensor_model_parallel_size": 3}}
        res = await client.call_tool("run_profile_job", {"plan": bad})
        assert res.is_error is True
        assert "tensor_model_parallel_size" in _text(res)
        listed = (await client.call_tool("list_jobs", {})).structured_content
        assert listed["jobs"] == []


async def test_dry_run_shows_the_command_and_creates_no_job(server):
    async with Client(server) as client:
        res = await client.call_tool("run_profile_job", {"plan": TINY, "dry_run": True})
        assert res.is_error is False, _text(res)
        assert "mcore_advisor.launcher.entry.profile" in json.dumps(res.structured_content)
        assert (await client.call_tool("list_jobs", {})).structured_content["jobs"] == []


async def test_unknown_job_id_is_a_clear_error(server):
    async with Client(server) as client:
        res = await client.call_tool("get_job", {"job_id": "nope"})
        assert res.is_error is True and "nope" in _text(res)


async def test_prompts_carry_their_arguments(server):
    async with Client(server) as client:
        p = await client.get_prompt("plan_a_run", {"model": "llama3-70b", "num_gpus": "64"})
        assert "llama3-70b" in p.messages[0].content.text and "recommend_parallelism" in p.messages[0].content.text


def _stdio(state_dir) -> StdioServerParameters:
    env = {**os.environ, "MCORE_ADVISOR_STATE_DIR": str(state_dir)}
    return StdioServerParameters(command=sys.executable, args=["-m", "mcore_advisor.cli", "serve"], env=env)


async def test_stdio_lists_tools_reads_resources_and_maps_errors(tmp_path):
    async with Client(_stdio(tmp_path)) as client:
        await _check_listing(client)
        res = await client.call_tool("estimate_memory", {"plan": LLAMA70B_64})
        assert res.is_error is False
        assert res.structured_content["fits"] in (True, False)
        bad = await client.call_tool("evaluate_plan", {"plan": {"model": {"name": "gpt-17"}}})
        assert bad.is_error is True and "model.name" in _text(bad)


async def _poll(client: Client, job_id: str, timeout_s: float = 240) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        st = (await client.call_tool("get_job", {"job_id": job_id, "detail": "full"})).structured_content["full"]
        if st["state"] not in ("PENDING", "RUNNING") or time.monotonic() > deadline:
            return st
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_MEGATRON, reason="needs the job extra (torch + megatron-core)")
async def test_cpu_profile_job_completes_and_a_crash_fails(tmp_path):
    async with Client(_stdio(tmp_path)) as client:
        sub = (await client.call_tool("run_profile_job", {"plan": TINY, "measure_steps": 3})).structured_content
        st = await _poll(client, sub["job_id"])
        assert st["state"] == "COMPLETED", st
        assert st["result"]["tokens_per_s_per_gpu"] > 0
        assert max(st["result"]["peak_allocated_gib"]) > 0
        # a valid plan for an H100 that this CPU machine cannot run: FP8 needs Transformer Engine
        crash = {**TINY, "training": {**TINY["training"], "precision": "fp8"},
                 "implementation": {"transformer_impl": "transformer_engine"}}
        res = await client.call_tool("run_profile_job", {"plan": crash})
        if not res.is_error:  # rejected up front is fine too; if accepted it must end FAILED, not hang
            st = await _poll(client, res.structured_content["job_id"])
            assert st["state"] == "FAILED"


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_MEGATRON, reason="needs the job extra (torch + megatron-core)")
async def test_server_restart_mid_job_keeps_the_job(tmp_path):
    async with Client(_stdio(tmp_path)) as client:
        req = {"plan": {**TINY, "training": {**TINY["training"], "global_batch_size": 8}}, "measure_steps": 30}
        sub = (await client.call_tool("run_profile_job", req)).structured_content
    # the first server process is gone now; a new one must find the job and see it finish
    async with Client(_stdio(tmp_path)) as client:
        listed = (await client.call_tool("list_jobs", {})).structured_content["jobs"]
        assert [j["job_id"] for j in listed] == [sub["job_id"]]
        st = await _poll(client, sub["job_id"])
        assert st["state"] == "COMPLETED", st


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_streamable_http_requires_the_bearer_token_when_one_is_set(tmp_path):
    import subprocess

    import anyio
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    port = _free_port()
    env = {**os.environ, "MCORE_ADVISOR_STATE_DIR": str(tmp_path), "MCORE_ADVISOR_TOKEN": "s3cret-token"}
    proc = subprocess.Popen([sys.executable, "-m", "mcore_advisor.cli", "serve", "--http", "--port", str(port)],
                            env=env, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        async with httpx2.AsyncClient() as anon:
            for _ in range(100):
                try:
                    r = await anon.post(url, json={})
                    break
                except httpx2.TransportError:
                    await anyio.sleep(0.1)
            assert r.status_code == 401
        async with httpx2.AsyncClient(headers={"Authorization": "Bearer s3cret-token"}) as http:
            async with Client(streamable_http_client(url, http_client=http)) as client:
                names = {t.name for t in (await client.list_tools()).tools}
                assert "evaluate_plan" in names
    finally:
        proc.terminate()
        proc.wait(timeout=10)
