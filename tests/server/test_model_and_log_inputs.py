"""Two ways in for runs the catalog or the log do not describe, through a real MCP client: check_mfu's
model / num_gpus / seq_length for a log without Megatron's arguments dump, and hf_config (a Hugging
Face config.json) in place of a catalog model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mcp import Client

from mcore_advisor.launcher.jobs import JobManager
from mcore_advisor.launcher.store import JobStore
from mcore_advisor.server.app import build_server

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "knowledge"))
from _hf_configs import LLAMA_3_1_8B, NEMOTRON_H_8B  # noqa: E402

pytestmark = pytest.mark.anyio
LOGS = ROOT / "tests" / "fixtures" / "logs"
NEMOTRON_H_8B_PARAMS = 8_100_852_736  # the checkpoint's count (tests/knowledge/test_hf_import.py derives it)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def server(tmp_path):
    return build_server(manager=JobManager(store=JobStore(tmp_path / "jobs.sqlite"), job_root=tmp_path / "jobs"))


def _text(res) -> str:
    return "\n".join(getattr(c, "text", "") or "" for c in res.content)


async def _plan(client: Client, plan_id: str) -> dict:
    return json.loads((await client.read_resource(f"mcore://plans/{plan_id}")).contents[0].text)


# ---- check_mfu: model, num_gpus, seq_length for a log without an arguments dump -------------------


async def test_check_mfu_asks_a_bridge_log_only_for_what_it_lacks(server):
    log = (LOGS / "bridge_llama3_8b_config_summary.log").read_text()
    async with Client(server) as client:
        bare = await client.call_tool("check_mfu", {"log_text": log})
        assert bare.is_error is True and "num_gpus" in _text(bare) and "model (" not in _text(bare)
        # the Bridge dump gives the layout (TP2 CP2 SP, GBS 128); the caller gives the GPU count and
        # here a sequence length that overrides the dump's 8192
        res = await client.call_tool("check_mfu", {"log_text": log, "num_gpus": 16, "seq_length": 4096})
        out = res.structured_content
        assert res.is_error is False and out["plan_source"] == "log_config", _text(res)
        plan = await _plan(client, out["plan_id"])
        assert plan["cluster"]["num_gpus"] == 16 and plan["training"]["seq_length"] == 4096
        assert plan["parallelism"]["tensor_model_parallel_size"] == 2 and plan["parallelism"]["context_parallel_size"] == 2
        assert out["iteration_time_s"] == pytest.approx(4.1149)  # the one steady Bridge line (the first is left out)
        assert out["tokens_per_s_per_gpu"] == pytest.approx(128 * 4096 / (16 * 4.1149), rel=1e-9)


async def test_check_mfu_takes_the_model_for_a_nemo_log_without_a_config(server):
    # NeMo 24.07's Llama-3 8B row: 8 x H100, GBS 128, seq 8192, 12,273 tokens/s/GPU published.
    log = (LOGS / "nemo2_llama3_8b_fp8_nemo2407_row.log").read_text()
    async with Client(server) as client:
        res = await client.call_tool("check_mfu", {"log_text": log, "model": "llama3-8b", "num_gpus": 8})
        out = res.structured_content
        assert res.is_error is False and out["plan_source"] == "log_config", _text(res)
        # seq_length from the model's context (8192) and GBS from the log: the published throughput back
        assert out["tokens_per_s_per_gpu"] == pytest.approx(12273, rel=1e-3)
        assert "sequence length" in _text(res)
        # any other plan argument describes the whole plan, as before
        full = await client.call_tool("check_mfu", {"log_text": log, "model": "llama3-8b", "num_gpus": 8, "cp": 2,
                                                    "seq_length": 8192, "global_batch_size": 128})
        assert full.structured_content["plan_source"] == "request"
        assert full.structured_content["tokens_per_s_per_gpu"] == pytest.approx(out["tokens_per_s_per_gpu"], rel=1e-12)
        bad = await client.call_tool("check_mfu", {"log_text": log, "model": "llama-9000", "num_gpus": 8})
        assert bad.is_error is True and "llama-9000" in _text(bad) and "catalog" in _text(bad)


# ---- hf_config instead of a catalog model ------------------------------------------------------


async def test_a_llama_config_json_plans_as_its_catalog_model(server):
    common = {"num_gpus": 8, "seq_length": 8192, "global_batch_size": 64, "top_k": 2, "what_if": False}
    async with Client(server) as client:
        by_name = (await client.call_tool("recommend_parallelism", {**common, "model": "llama3.1-8b"})).structured_content
        res = await client.call_tool("recommend_parallelism", {**common, "hf_config": json.dumps(LLAMA_3_1_8B)})
        assert res.is_error is False, _text(res)
        by_config = res.structured_content
        assert [p["layout"] for p in by_config["plans"]] == [p["layout"] for p in by_name["plans"]]
        assert by_config["plans"][0]["tokens_per_s_per_gpu"] == pytest.approx(by_name["plans"][0]["tokens_per_s_per_gpu"], rel=1e-12)
        assert _text(res).startswith("the hf_config model on 8 x h100-sxm")
        # its plan_id carries the config to the other tools
        pid = by_config["plans"][0]["plan_id"]
        assert json.loads((await _plan(client, pid))["model"]["hf_config"])["num_hidden_layers"] == 32
        script = await client.call_tool("render_launch_script", {"plan_id": pid})
        text = _text(script)
        assert script.is_error is False and "--num-layers 32" in text and "--num-query-groups 8" in text
        assert "--ffn-hidden-size 14336" in text and "--rotary-base 500000" in text
        # the header names the config by size, not by its text
        assert f"render_launch_script(plan_id='{pid}')" in text
        direct = await client.call_tool("render_launch_script", {"hf_config": LLAMA_3_1_8B, "num_gpus": 8, "tp": 2})
        header = next(line for line in _text(direct).splitlines() if line.startswith("# rendered by:"))
        size = len(json.dumps(LLAMA_3_1_8B))
        assert header == f"# rendered by: render_launch_script(hf_config=<config.json, {size:,} characters>, num_gpus=8, tp=2)"
        body = _text(direct).split("\n\n", 1)[1]
        assert subprocess.run(["bash", "-n"], input=body, text=True).returncode == 0


async def test_a_nemotron_h_config_json_gets_its_memory_and_speed(server):
    flat = {"num_gpus": 8, "seq_length": 8192, "global_batch_size": 64, "tp": 2, "sequence_parallel": True}
    async with Client(server) as client:
        mem = await client.call_tool("estimate_memory", {**flat, "hf_config": NEMOTRON_H_8B})  # an object works too
        assert mem.is_error is False, _text(mem)
        m = mem.structured_content["memory"]
        # BF16 weights of 8.10B parameters split over TP 2 (norms replicated: < 0.1% more)
        assert m["weights_gib"] == pytest.approx(NEMOTRON_H_8B_PARAMS * 2 / 2 / 2**30, rel=1e-3)
        catalog = (await client.call_tool("estimate_memory", {**flat, "model": "nemotron-h-8b"})).structured_content
        assert m == catalog["memory"]
        ev = await client.call_tool("evaluate_plan", {**flat, "hf_config": json.dumps(NEMOTRON_H_8B)})
        out = ev.structured_content
        assert ev.is_error is False and out["valid"] is True and out["performance"]["tokens_per_s_per_gpu"] > 0
        assert out["memory"] == m


async def test_bad_hf_config_arguments_name_the_argument(server):
    async with Client(server) as client:
        cases = [
            ({"hf_config": "{nope", "num_gpus": 8}, "hf_config is not valid JSON"),
            ({"hf_config": {**LLAMA_3_1_8B, "model_type": "gemma3", "architectures": ["Gemma3ForCausalLM"]}, "num_gpus": 8}, "hf_config.model_type 'gemma3' is not supported"),
            ({"hf_config": 5, "num_gpus": 8}, "hf_config: expected the config.json as JSON text (or an object), got int 5"),
            ({"hf_config": "x" * 70_000, "num_gpus": 8}, "hf_config: too long (70,000 characters; at most 65,536)"),
            ({"hf_config": LLAMA_3_1_8B, "model": "llama3-8b", "num_gpus": 8}, "model, hf_config: both given; keep one"),
        ]
        for args, message in cases:
            for tool in ("evaluate_plan", "recommend_parallelism"):
                res = await client.call_tool(tool, args)
                assert res.is_error is True and message in _text(res), (tool, _text(res)[:300])
        tools = {t.name: t.input_schema["properties"] for t in (await client.list_tools()).tools}
        for name in ("recommend_parallelism", "evaluate_plan", "estimate_memory", "render_launch_script", "render_chart"):
            assert tools[name]["hf_config"]["type"] == "string", name
        assert "hf_config" not in tools["check_mfu"] and "hf_config" not in tools["run_profile_job"]
