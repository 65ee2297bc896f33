"""What an assistant pays for and reads: schema sizes, answer sizes, flat arguments, plan handles,
error messages, charts, progress and concurrency, through a real MCP client."""

from __future__ import annotations

import io
import json
import os
import re
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest
from mcp import Client, StdioServerParameters
from PIL import Image

from mcore_advisor.cli import main as cli_main
from mcore_advisor.launcher.jobs import JobManager
from mcore_advisor.launcher.store import JobStore
from mcore_advisor.physics.step_time import HOST_PROBE_TO_LAYER
from mcore_advisor.server import app
from mcore_advisor.server.app import build_server

pytestmark = pytest.mark.anyio

MAX_TOOL_SCHEMA = 4000
MAX_ALL_SCHEMAS = 25000
MAX_DESCRIPTION = 2048  # Claude Code cuts tool descriptions at 2 KB
MAX_ANSWER = 20000
LLAMA70B = {"model": "llama3-70b", "num_gpus": 64, "seq_length": 8192, "global_batch_size": 128}


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def server(tmp_path):
    return build_server(manager=JobManager(store=JobStore(tmp_path / "jobs.sqlite"), job_root=tmp_path / "jobs"))


def _text(res) -> str:
    return "\n".join(getattr(c, "text", "") or "" for c in res.content)


def _size(res) -> int:
    return len(_text(res)) + len(json.dumps(res.structured_content))


async def test_schemas_and_the_main_question_fit_over_stdio(tmp_path):
    env = {**os.environ, "MCORE_ADVISOR_STATE_DIR": str(tmp_path)}
    params = StdioServerParameters(command=sys.executable, args=["-m", "mcore_advisor.cli", "serve"], env=env)
    async with Client(params) as client:
        tools = (await client.list_tools()).tools
        total = 0
        for t in tools:
            schema = json.dumps(t.input_schema)
            total += len(schema)
            assert len(schema) <= MAX_TOOL_SCHEMA, (t.name, len(schema))
            assert "$ref" not in schema and "anyOf" not in schema and "oneOf" not in schema, t.name
            assert '"null"' not in schema, t.name
            assert len(t.description or "") < MAX_DESCRIPTION, t.name
        assert total <= MAX_ALL_SCHEMAS, total
        # the README's main question: both answers together stay under 20,000 characters
        small = await client.call_tool("recommend_parallelism", LLAMA70B)
        big = await client.call_tool("recommend_parallelism", {"model": "llama3.1-405b", "num_gpus": 16384})
        for res in (small, big):
            assert res.is_error is False, _text(res)
            assert res.structured_content["plans"] and res.structured_content["full"] is None
        assert _size(small) <= MAX_ANSWER and _size(big) <= MAX_ANSWER, (_size(small), _size(big))
        # every full plan is one resource read away
        pid = big.structured_content["plans"][0]["plan_id"]
        plan = json.loads((await client.read_resource(f"mcore://plans/{pid}")).contents[0].text)
        assert plan["cluster"]["num_gpus"] == 16384 and plan["model"]["name"] == "llama3.1-405b"


async def test_full_detail_carries_the_whole_result_with_a_size_hint(server):
    async with Client(server) as client:
        res = await client.call_tool("recommend_parallelism", {**LLAMA70B, "top_k": 2, "detail": "full"})
        full = res.structured_content["full"]
        assert len(full["plans"]) == 2 and "evaluation" in full["plans"][0]
        hint = res.meta["mcore-advisor/result_chars"]
        assert hint == len(_text(res)) + len(json.dumps(res.structured_content))


async def test_plan_ids_feed_every_plan_tool_and_flat_arguments_override(server):
    async with Client(server) as client:
        rec = (await client.call_tool("recommend_parallelism", {**LLAMA70B, "top_k": 1, "what_if": False})).structured_content
        best = rec["plans"][0]
        ev = (await client.call_tool("evaluate_plan", {"plan_id": best["plan_id"]})).structured_content
        assert ev["plan_id"] == best["plan_id"] and ev["valid"] is True
        assert ev["performance"]["tokens_per_s_per_gpu"] == pytest.approx(best["tokens_per_s_per_gpu"], rel=1e-9)
        # the same plan with two micro-batches per step is a new plan with its own id
        bigger = (await client.call_tool("estimate_memory", {"plan_id": best["plan_id"], "micro_batch_size": 2})).structured_content
        assert bigger["plan_id"] != best["plan_id"]
        assert bigger["memory"]["activations_gib"] > ev["memory"]["activations_gib"]
        script = await client.call_tool("render_launch_script", {"plan_id": best["plan_id"], "launcher": "slurm"})
        assert "#SBATCH" in _text(script) and script.structured_content["plan_id"] == best["plan_id"]


async def test_plans_come_as_objects_json_strings_or_flat_arguments(server):
    plan = {"model": {"name": "llama3-8b"}, "cluster": {"num_gpus": 8},
            "training": {"seq_length": 8192, "global_batch_size": 64}, "parallelism": {"tensor_model_parallel_size": 2}}
    stringly = {**plan, "parallelism": json.dumps(plan["parallelism"]), "model": "llama3-8b"}
    flat = {"model": "llama3-8b", "num_gpus": 8, "seq_length": 8192, "global_batch_size": 64, "tp": 2}
    async with Client(server) as client:
        ids = set()
        for args in ({"plan": plan}, {"plan": json.dumps(plan)}, {"plan": stringly}, flat):
            res = await client.call_tool("evaluate_plan", args)
            assert res.is_error is False, (args, _text(res))
            ids.add(res.structured_content["plan_id"])
        assert len(ids) == 1  # one plan, however it was spelt


async def test_bad_arguments_get_one_line_per_field_with_range_and_example(server):
    async with Client(server) as client:
        res = await client.call_tool("evaluate_plan", {"model": "llama3-8b", "num_gpus": 0, "tp": "eight", "precision": "fp4"})
        assert res.is_error is True
        lines = _text(res).split(": ", 1)[1].splitlines()
        assert lines == [
            "num_gpus: too small (got 0); allowed: integer >= 1 and <= 1048576; e.g. num_gpus=8",
            "precision: not an allowed value (got 'fp4'); allowed: one of 'bf16', 'fp8'; e.g. precision='bf16'",
            "tp: not an integer (got 'eight'); allowed: integer >= 1 and <= 1024; e.g. tp=1",
        ]
        res = await client.call_tool("evaluate_plan", {"plan": {"model": {"name": "llama3-8b"}, "cluster": {"num_gpu": 8}}})
        assert "cluster.num_gpu: unknown field; known fields here: gpu, num_gpus" in _text(res)
        assert "validation error for" not in _text(res) and "Input should be" not in _text(res)
        typo = await client.call_tool("evaluate_plan", {"model": "llama3-8b", "num_gpus": 8, "tensor_parallel": 2})
        assert typo.is_error is True and "'tensor_parallel': unknown argument; did you mean tp?" in _text(typo)
        no_model = await client.call_tool("evaluate_plan", {"num_gpus": 8})
        assert "model: required" in _text(no_model)


async def test_errors_never_echo_a_huge_argument(server):
    huge = "x" * 100_000
    async with Client(server) as client:
        for tool, args in (("get_job", {"job_id": huge}), ("cancel_job", {"job_id": huge}),
                           ("evaluate_plan", {"model": huge, "num_gpus": 8}), ("evaluate_plan", {"plan_id": huge})):
            res = await client.call_tool(tool, args)
            text = _text(res)
            assert res.is_error is True and len(text) < 300 and "x" * 100 not in text, text[:400]
            assert "100,000 characters" in text or "100,002 characters" in text, text


async def test_a_plan_megatron_refuses_is_marked_invalid_without_a_speed(server):
    async with Client(server) as client:
        res = await client.call_tool("evaluate_plan", {"model": "llama3-70b", "num_gpus": 48, "tp": 3})
        out = res.structured_content
        assert res.is_error is False and out["valid"] is False and out["feasible"] is False
        assert out["performance"] is None
        assert out["findings"][0]["severity"] == "error"
        assert _text(res).startswith("verdict: INVALID") and "tokens/s" not in _text(res)


async def test_non_finite_core_figures_reach_the_client_as_null(server, monkeypatch):
    # whatever the core computes, no NaN or infinity leaves the server: they become null / 'n/a'
    real = app._evaluate_plan

    def broken(plan):
        ev = real(plan)
        perf = ev.performance.model_copy(update={"iteration_time_s": float("nan"), "tokens_per_s_per_gpu": float("inf")})
        return ev.model_copy(update={"performance": perf})

    monkeypatch.setattr(app, "_evaluate_plan", broken)
    async with Client(server) as client:
        res = await client.call_tool("evaluate_plan", {"model": "llama3-8b", "num_gpus": 8})
        assert res.is_error is False, _text(res)
        body = json.dumps(res.structured_content, allow_nan=False)  # raises on NaN/Infinity
        perf = res.structured_content["performance"]
        assert perf["iteration_time_s"] is None and perf["tokens_per_s_per_gpu"] is None
        words = set(re.findall(r"[A-Za-z]+", _text(res)))
        assert not words & {"nan", "inf", "NaN", "Infinity"} and "Infinity" not in body


async def test_charts_are_png_images_and_the_cli_writes_the_same_bytes(server, tmp_path):
    plan = {"model": {"name": "llama3-70b"}, "cluster": {"num_gpus": 64},
            "training": {"seq_length": 4096, "global_batch_size": 128},
            "parallelism": {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 4, "sequence_parallel": True}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    async with Client(server) as client:
        for chart in ("memory", "step_time", "pipeline"):
            res = await client.call_tool("render_chart", {"plan": plan, "chart": chart})
            assert res.is_error is False, _text(res)
            image = next(c for c in res.content if c.type == "image")
            assert image.mime_type == "image/png" and res.structured_content is None
            import base64

            data = base64.b64decode(image.data)
            with Image.open(io.BytesIO(data)) as im:
                assert im.size == (900, 500)
                colors = im.convert("RGB").getcolors(maxcolors=100_000)
                assert colors is not None and len(colors) > 50  # drawn, not blank
                white = max(n for n, c in colors if c == (255, 255, 255))
                assert white < 0.9 * 900 * 500
            out = tmp_path / f"{chart}.png"
            assert cli_main(["chart", chart, str(tmp_path / "plan.json"), "--png", str(out)]) == 0
            assert out.read_bytes() == data
        bad = await client.call_tool("render_chart", {"model": "llama3-8b", "num_gpus": 8, "chart": "pipeline"})
        assert bad.is_error is True and "pp=1" in _text(bad)


async def test_a_cheap_call_stays_fast_while_a_search_runs(server):
    async with Client(server) as client:
        await client.call_tool("evaluate_plan", {"model": "llama3-8b", "num_gpus": 8})  # warm imports
        done: dict[str, float] = {}
        t0 = time.perf_counter()

        async def search() -> None:  # several seconds of CPU in the core
            await client.call_tool("recommend_parallelism", {"model": "deepseek-v3", "num_gpus": 1024})
            done["search"] = time.perf_counter() - t0

        async def cheap() -> None:
            await anyio.sleep(0.2)
            res = await client.call_tool("evaluate_plan", {"model": "llama3-8b", "num_gpus": 8, "tp": 2})
            assert res.is_error is False
            done["cheap"] = time.perf_counter() - t0

        async with anyio.create_task_group() as tg:
            tg.start_soon(search)
            tg.start_soon(cheap)
        assert done["cheap"] < done["search"] / 2, done


async def test_concurrent_searches_are_bounded(server, monkeypatch):
    real = app._recommend(app.recommend_request({"model": "llama3-8b", "num_gpus": 8, "what_if": False}))
    running, peak = 0, 0

    def slow_search(request, clock=None, cpu_clock=None):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        time.sleep(0.3)
        running -= 1
        return real

    monkeypatch.setattr(app, "_recommend", slow_search)
    async with Client(server) as client:
        async with anyio.create_task_group() as tg:
            for n in range(5):
                tg.start_soon(client.call_tool, "recommend_parallelism", {"model": "llama3-8b", "num_gpus": 8 * (n + 1)})
    assert peak == app.MAX_CONCURRENT_SEARCHES


FAKE_ENTRY = textwrap.dedent('''
    import json, os, sys, time
    out = sys.argv[sys.argv.index("--out-dir") + 1]
    run = json.load(open(sys.argv[sys.argv.index("--spec") + 1]))["run"]
    n = run["warmup_steps"] + run["measure_steps"]
    mode, pause = sys.argv[1], float(sys.argv[2])
    with open(os.path.join(out, "train.log"), "a") as fh:
        for i in range(1, n + 1):
            while mode == "wait" and i == 3 and not os.path.exists(os.path.join(out, "go")):
                time.sleep(0.01)
            time.sleep(pause)
            fh.write(f" iteration {i:8d}/{n:8d} | consumed samples: {4 * i:12d} | elapsed time per iteration (ms): 250.0 |\\n")
            fh.flush()
    json.dump({"status": "ok", "iter_s": 0.25, "tokens_per_s_per_gpu": 800.0, "tflops_per_gpu_causal": 4.0,
               "peak_allocated_gib": [0.5], "step_times_s": [0.25] * n, "device": "NVIDIA H100 80GB HBM3",
               "host": {"hostname": "fake-node", "boot_id": "b1", "probe": {"ms_per_layer": 6.0, "impl": "transformer_engine"}}},
              open(os.path.join(out, "result.json"), "w"))
''')
TINY = {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 256},
        "cluster": {"num_gpus": 1}, "training": {"seq_length": 32, "global_batch_size": 2, "micro_batch_size": 1}}
JOB = {"plan": TINY, "warmup_steps": 2, "measure_steps": 3, "options": {"profile_steps": None}}


def _fake_server(tmp_path: Path, mode: str, pause: float):
    entry = tmp_path / "fake_entry.py"
    entry.write_text(FAKE_ENTRY)
    return build_server(manager=JobManager(store=JobStore(tmp_path / "jobs.sqlite"), job_root=tmp_path / "jobs",
                                           entry=[str(entry), mode, str(pause)]))


async def test_run_profile_job_reports_progress_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(app, "PROGRESS_POLL_S", 0.05)
    seen: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress, total, message):
        seen.append((progress, total, message))

    async with Client(_fake_server(tmp_path, "ok", 0.3)) as client:
        res = await client.call_tool("run_profile_job", JOB, progress_callback=on_progress)
        assert res.is_error is False, _text(res)
        assert res.structured_content["state"] == "COMPLETED"
        values = [p for p, _, _ in seen]
        assert values == sorted(set(values)) and values[-1] == seen[-1][1] == 7  # queued/started + 5 steps + done
        messages = " | ".join(m for _, _, m in seen)
        assert "warm-up 1/2" in messages and "measured step 2/3" in messages and messages.endswith("completed: done")
        # without a progress token it answers at once
        quick = await client.call_tool("run_profile_job", JOB)
        assert quick.structured_content["state"] in ("PENDING", "RUNNING")
        chart = await client.call_tool("render_chart", {"chart": "job", "job_id": res.structured_content["job_id"]})
        assert chart.is_error is False and any(c.type == "image" for c in chart.content)


async def test_get_job_reports_phase_and_eta(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    async with Client(_fake_server(tmp_path, "wait", 0.0)) as client:
        sub = (await client.call_tool("run_profile_job", JOB)).structured_content
        deadline = time.monotonic() + 20
        while True:
            st = (await client.call_tool("get_job", {"job_id": sub["job_id"]})).structured_content
            if st["steps_done"] == 2 or time.monotonic() > deadline:
                break
            await anyio.sleep(0.05)
        # two warm-up steps of 250 ms logged; three measured ones to go
        assert st["state"] == "RUNNING" and st["phase"] == "warm-up 2/2", st
        assert st["steps_total"] == 5 and st["eta_s"] == pytest.approx(0.75)
        (Path(sub["job_dir"]) / "go").touch()
        while st["state"] == "RUNNING" and time.monotonic() < deadline:
            await anyio.sleep(0.05)
            st = (await client.call_tool("get_job", {"job_id": sub["job_id"]})).structured_content
        assert st["state"] == "COMPLETED" and st["phase"] == "done"
        assert {c["figure"] for c in st["comparison"]} >= {"iteration_time_s", "tokens_per_s_per_gpu"}
        # the job's host probe is the machine's host figure, handed back for planning more runs there
        assert st["host_floor_ms_per_layer"] == pytest.approx(6.0 * HOST_PROBE_TO_LAYER)
        text = _text(await client.call_tool("get_job", {"job_id": sub["job_id"]}))
        assert "this machine's host: 6.00 ms per reference layer" in text


async def test_hostile_argument_errors_name_the_argument_the_caller_passed(server):
    # Found by the reliability fuzzer: a 5,000-digit number inside a JSON-string plan, and an over-long
    # string for a flat argument whose request field has another name.
    async with Client(server) as client:
        huge = await client.call_tool("evaluate_plan", {"plan": '{"model": {"name": "llama3-8b"}, "cluster": {"num_gpus": '
                                                         + "9" * 5000 + "}}"})
        assert huge.is_error is True and _text(huge).split(": ", 1)[1].startswith("plan: holds a number too large")
        long = await client.call_tool("recommend_parallelism", {"model": "llama3-8b", "num_gpus": 8, "max_tp": "x" * 300})
        assert long.is_error is True and "max_tp:" in _text(long) and "max_tensor_model_parallel_size" not in _text(long)


def test_a_job_the_scheduler_cannot_report_is_not_called_ended():
    from types import SimpleNamespace

    from mcore_advisor.server.progress import job_phase

    phase = job_phase(SimpleNamespace(state="UNKNOWN", last_known_state="RUNNING", job_dir=None, log_tail=None))
    assert phase.phase.startswith("unknown") and "RUNNING" in phase.phase
