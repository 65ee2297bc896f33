"""The profile entry point end to end on CPU (gloo): a tiny GPT trains, reports and traces; a crash
leaves error.json and a non-zero exit. Needs torch + megatron-core (the `job` extra)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from mcore_advisor.launcher.spec import job_spec  # noqa: E402
from mcore_advisor.schemas import Plan  # noqa: E402

TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128}
SRC = str(Path(__file__).resolve().parents[2] / "src")
# Megatron-LM training.py training_log, one line per iteration
LOG_LINE = re.compile(
    r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \|"
    r" elapsed time per iteration \(ms\): ([\d.]+) \| throughput per GPU \(TFLOP/s/GPU\): ([\d.]+) \|"
    r" learning rate: [\d.E+-]+ \| global batch size: +(\d+) \| lm loss: ([\d.E+-]+) \| loss scale: 1\.0 \|"
    r" grad norm: [\d.]+ \| number of skipped iterations: +0 \| number of nan iterations: +0 \|$"
)
MEM_LINE = re.compile(r"^\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: [\d.]+ \| max allocated: [\d.]+ \|"
                      r" reserved: [\d.]+ \| max reserved: [\d.]+$")


def _run(tmp_path: Path, plan: dict, nproc: int = 1, **kw) -> tuple[subprocess.CompletedProcess, Path]:
    spec = job_spec(Plan(**plan), **({"warmup_steps": 1, "measure_steps": 2, "profile_steps": (1, 1)} | kw))
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    entry = ["-m", "mcore_advisor.launcher.entry.profile", "--spec", str(spec_path), "--out-dir", str(out), "--device", "cpu"]
    if nproc == 1:
        cmd = [sys.executable, *entry]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(29700 + os.getpid() % 200), *entry]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    return proc, out


def _plan(gpus: int = 1, **kw) -> dict:
    return {"model": TINY, "cluster": {"gpu": "h100-sxm", "num_gpus": gpus},
            "training": {"seq_length": 64, "global_batch_size": 8, "micro_batch_size": 2}} | kw


def _check_ok(proc, out: Path, world: int) -> dict:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert not (out / "error.json").exists()
    r = json.loads((out / "result.json").read_text())
    assert r["status"] == "ok" and r["world_size"] == world
    assert r["iterations"] == ["profile", "measure", "measure"]
    assert len(r["step_times_s"]) == 3 and all(t > 0 for t in r["step_times_s"])
    assert r["iter_s"] > 0 and r["tokens_per_s_per_gpu"] > 0
    # tokens/s = GBS * seq / iter_s / world
    assert r["tokens_per_s_per_gpu"] == pytest.approx(8 * 64 / r["iter_s"] / world)
    assert r["tflops_per_gpu_full"] > r["tflops_per_gpu_causal"] > 0
    assert r["mfu_pct_causal"] is None and r["mfu_peak_tflops"] is None  # no peak for a CPU
    assert len(r["peak_allocated_gib"]) == world and all(x > 0.05 for x in r["peak_allocated_gib"])
    assert len(r["peak_reserved_gib"]) == world and "RSS" in r["memory_source"]
    assert r["versions"]["torch"] and r["versions"]["megatron_core"] and r["versions"]["transformer_engine"] is None
    assert r["transformer_impl"] == "local"
    assert r["exposed_comm_s"] is not None and r["exposed_comm_s"] >= 0
    trace = json.loads((out / "trace_rank0.json").read_text())
    assert any(e.get("cat") == "cpu_op" for e in trace["traceEvents"])
    lines = (out / "train.log").read_text().splitlines()
    iters = [m for m in map(LOG_LINE.match, lines) if m]
    assert [int(m.group(1)) for m in iters] == [1, 2, 3]
    assert all(int(m.group(6)) == 8 for m in iters)
    # a fresh model on random tokens starts near ln(padded vocab) and the loss falls
    losses = [float(m.group(7)) for m in iters]
    assert 4.0 < losses[0] < 6.5 and losses[-1] < losses[0]
    mem = [m for m in map(MEM_LINE.match, lines) if m]
    assert {int(m.group(2)) for m in mem} == {1, 2, 3}
    return r


def test_tiny_gpt_world_size_1_reports_times_memory_log_and_trace(tmp_path):
    proc, out = _run(tmp_path, _plan(parallelism={"recompute_granularity": "selective"}))
    r = _check_ok(proc, out, 1)
    assert "scaled_dot_product_attention" in r["attention_impl"]
    assert r["settings"]["recompute_granularity"] == "selective"


def test_tiny_gpt_tensor_parallel_2_with_sequence_parallel_over_gloo(tmp_path):
    plan = _plan(gpus=2, parallelism={"tensor_model_parallel_size": 2, "sequence_parallel": True})
    proc, out = _run(tmp_path, plan, nproc=2)
    r = _check_ok(proc, out, 2)
    assert r["settings"]["sequence_parallel"] is True
    assert sorted(x["tp_rank"] for x in r["ranks"]) == [0, 1]
    # each TP rank holds about half of the layer weights
    assert r["ranks"][0]["num_params_local"] == r["ranks"][1]["num_params_local"]


def test_impossible_shape_writes_error_json_and_exits_nonzero(tmp_path):
    # 4 query heads cannot be split into 3 K/V groups
    plan = _plan(model={**TINY, "num_query_groups": 3})
    proc, out = _run(tmp_path, plan)
    assert proc.returncode != 0
    err = json.loads((out / "error.json").read_text())
    assert err["status"] == "failed" and err["rank"] == 0
    assert err["error_type"] and err["message"]
    assert not (out / "result.json").exists()


def test_world_size_mismatch_is_reported_with_the_fix(tmp_path):
    proc, out = _run(tmp_path, _plan(gpus=2))
    assert proc.returncode != 0
    err = json.loads((out / "error.json").read_text())
    assert err["error_type"] == "ValueError" and "cluster.num_gpus" in err["message"]


@pytest.fixture(autouse=True)
def _no_leftovers(tmp_path):
    yield
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
