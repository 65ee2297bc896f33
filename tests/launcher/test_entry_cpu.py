"""The profile entry on CPU (gloo): Megatron-LM's own training loop on the rendered argv, its lines
in result.json, Megatron's torch-profiler trace, memory_at_scale through a fake process group, and
error.json on failure. Needs torch + megatron-core >= 0.19 (the `job` extra)."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("torch")
pytest.importorskip("megatron.training")

from mcore_advisor.launcher.entry import argv as A  # noqa: E402
from mcore_advisor.launcher.entry import result as result_contract  # noqa: E402
from mcore_advisor.launcher.entry.trainlog import parse_iteration_line, parse_memory_line  # noqa: E402
from mcore_advisor.launcher.spec import job_spec  # noqa: E402
from mcore_advisor.schemas import Plan  # noqa: E402

TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128}
SRC = str(Path(__file__).resolve().parents[2] / "src")


def _run(tmp_path: Path, spec: dict, nproc: int = 1) -> tuple[subprocess.CompletedProcess, Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    entry = ["-m", "mcore_advisor.launcher.entry.profile", "--spec", str(spec_path), "--out-dir", str(out), "--device", "cpu"]
    cmd = [sys.executable, *entry] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
        str(29700 + os.getpid() % 200), *entry]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300), out


def _plan(gpus: int = 1, **kw) -> Plan:
    return Plan(**({"model": TINY, "cluster": {"gpu": "h100-sxm", "num_gpus": gpus},
                    "training": {"seq_length": 64, "global_batch_size": 8, "micro_batch_size": 2}} | kw))


def _ok(proc, out: Path) -> dict:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert not (out / "error.json").exists()
    result = json.loads((out / "result.json").read_text())
    assert result_contract.check(result) == []  # what get_job reads (launcher/entry/result.py)
    return result


def test_a_tiny_gpt_trains_in_megatrons_own_loop_and_the_result_reads_megatrons_lines(tmp_path):
    plan = _plan(implementation={"manual_gc": True, "manual_gc_interval": 2})
    spec = job_spec(plan, warmup_steps=1, measure_steps=2, profile_steps=(2, 2))
    proc, out = _run(tmp_path, spec)
    r = _ok(proc, out)
    # Megatron's profiler warms up in iteration 1 and exports inside iteration 3: neither is measured
    assert r["iterations"] == ["profile", "profile", "profile", "measure", "measure"]
    lines = [parse_iteration_line(x) for x in r["megatron"]["iteration_lines"]]
    assert [x["iteration"] for x in lines] == [1, 2, 3, 4, 5] and {x["train_iters"] for x in lines} == {5}
    # step times are Megatron's own 'elapsed time per iteration (ms)'; the figures come from them
    assert r["step_times_s"] == pytest.approx([x["elapsed_ms"] / 1000 for x in lines])
    assert r["iter_s"] == pytest.approx(sorted(r["step_times_s"][3:])[0] / 2 + sorted(r["step_times_s"][3:])[1] / 2)
    assert r["tokens_per_s_per_gpu"] == pytest.approx(8 * 64 / r["iter_s"])
    assert r["tflops_per_gpu_full"] > r["tflops_per_gpu_causal"] > 0 and r["mfu_pct_causal"] is None
    # a fresh model on random tokens starts near ln(vocab 128) = 4.85, and trains
    assert 4.5 < r["losses"][0] < 5.2 and r["losses"][-1] < r["losses"][0]
    mem = [parse_memory_line(x) for x in r["megatron"]["memory_lines"]]
    assert [(m["rank"], m["iteration"]) for m in mem] == [(0, 1), (0, 2)]  # Megatron reports after 1 and 2
    assert any(x.startswith("Theoretical memory footprints") for x in r["megatron"]["theoretical_memory_lines"])
    assert any("model-and-optimizer-setup" in x for x in r["megatron"]["timer_lines"])
    # the argv Megatron parsed: the rendered one with each CPU change recorded
    adjusted = {a["flag"] for a in r["argv_adjustments"]}
    assert {"--transformer-impl", "--distributed-backend", "--tensorboard-dir"} <= adjusted
    kept = [g for g in A.groups(spec["megatron_argv"]) if g[0] not in adjusted]
    assert all(A.values(r["megatron_argv"], g[0]) == g[1:] for g in kept)
    assert r["settings"]["manual_gc"] is True and r["settings"]["manual_gc_interval"] == 2
    assert r["transformer_impl"] == "local" and r["versions"]["megatron_core"].startswith("0.19")
    # Megatron's torch profiler wrote its trace into the job directory; on a CPU collectives block
    assert r["trace"] == "torch_profile/rank-0.json.gz" and (out / r["trace"]).exists()
    assert r["exposed_comm_method"].startswith("cpu ops") and r["exposed_comm_s"] >= 0
    assert len(r["host"]["gc_pause_s_per_iteration"]) == 5 and len(r["host_step_times_s"]) == 5
    # the machine the job ran on, which pools its host probes with the next jobs' there (as_ran.machine_key)
    assert r["host"]["hostname"] == socket.gethostname()
    assert r["host"]["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    log = (out / "train.log").read_text()
    assert "------------------------ arguments ------------------------" in log and "iteration        5/       5 |" in log


def test_memory_at_scale_plays_one_rank_of_64_with_a_fake_process_group(tmp_path):
    # TP2 x PP4 x EP4 on 64 GPUs, MoE in every layer. Rank 16 is pipeline stage 1 (a middle stage:
    # no data, so do_train must be forced); rank 48 is the last stage, whose loss shows that routing on
    # the filled all-to-all outputs stays finite.
    model = {"num_layers": 8, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 256, "swiglu": True,
             "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 64}
    plan = _plan(64, model=model, training={"seq_length": 64, "global_batch_size": 64, "micro_batch_size": 1},
                 parallelism={"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4,
                              "expert_model_parallel_size": 4, "expert_tensor_parallel_size": 1, "sequence_parallel": True})
    for rank, stage in ((16, 1), (48, 3)):
        proc, out = _run(tmp_path / str(rank), job_spec(plan, mode="memory_at_scale", rank=rank))
        r = _ok(proc, out)
        assert (r["mode"], r["measured_rank"], r["world_size"], r["processes"]) == ("memory_at_scale", rank, 64, 1)
        assert r["ranks"][0]["pp_rank"] == stage and r["ranks"][0]["num_params_local"] > 0
        assert len(r["megatron"]["iteration_lines"]) == 2  # trained although no data loader lives there; nothing after the read
        assert r["memory_read_after_iteration"] == 2 and r["peak_allocated_gib"][0] > 0
        log = (out / "train.log").read_text()
        # Megatron prints its argument dump on rank 0 only and memory on data-parallel rank 0: the job
        # prints the measured rank's own
        assert "------------------------ arguments ------------------------" in log
        assert f"[Rank {rank}] (after 2 iterations) memory (MB)" in log
    assert all(math.isfinite(x) for x in r["losses"] + r["grad_norms"])


def test_a_run_megatron_refuses_leaves_error_json_with_megatrons_message(tmp_path):
    # the validators refuse this plan before rendering; an edited spec reaches Megatron: 4 query
    # heads cannot be split into 3 K/V groups
    spec = job_spec(_plan(), profile_steps=None)
    spec["megatron_argv"] += ["--group-query-attention", "--num-query-groups", "3"]
    proc, out = _run(tmp_path, spec)
    assert proc.returncode != 0
    err = json.loads((out / "error.json").read_text())
    # Megatron's parser accepts it; the attention reshape fails in the first iteration
    assert (err["status"], err["rank"], err["phase"], err["iteration"]) == ("failed", 0, "train", 1)
    assert err["error_type"] == "RuntimeError" and "is invalid for input of size" in err["message"]
    assert not (out / "result.json").exists()


def test_a_world_size_mismatch_and_fp8_on_a_cpu_are_refused_with_the_fix(tmp_path):
    proc, out = _run(tmp_path / "a", job_spec(_plan(gpus=2), profile_steps=None))
    err = json.loads((out / "error.json").read_text())
    assert proc.returncode != 0 and err["error_type"] == "ValueError" and "cluster.num_gpus" in err["message"]
    fp8 = _plan(training={"seq_length": 64, "global_batch_size": 8, "micro_batch_size": 2, "precision": "fp8"})
    proc, out = _run(tmp_path / "b", job_spec(fp8, profile_steps=None))
    err = json.loads((out / "error.json").read_text())
    assert proc.returncode != 0 and "training.precision='fp8' needs Transformer Engine" in err["message"]


def _wait(mgr, job_id: str, timeout_s: float = 300.0):
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        st = mgr.get(job_id)
        if st.state in ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED") or time.monotonic() > deadline:
            return st
        time.sleep(0.5)


def test_run_profile_job_on_the_local_backend_carries_megatrons_lines_and_memory_at_scale_its_rank_terms(tmp_path):
    from mcore_advisor.launcher.jobs import JobManager, ProfileJobRequest
    from mcore_advisor.launcher.store import JobStore

    mgr = JobManager(JobStore(tmp_path / "jobs.sqlite3"))
    sub = mgr.submit(ProfileJobRequest(plan=_plan(), warmup_steps=1, measure_steps=1, profile_steps=None))
    st = _wait(mgr, sub.job_id)
    assert st.state == "COMPLETED", (st.error, st.stderr_tail)
    lines = st.result["megatron"]["iteration_lines"]
    assert [parse_iteration_line(x)["iteration"] for x in lines] == [1, 2]
    assert st.result["megatron"]["memory_lines"] and "iteration        2/       2 |" in st.log_tail
    by = {c.figure: c for c in st.comparison}
    assert by["iteration_time_s"].measured == pytest.approx(st.result["iter_s"]) and by["iteration_time_s"].predicted
    # one process plays rank 16 of a 64-GPU plan; get_job compares it with the memory model's stage 1
    plan = _plan(64, model={**TINY, "num_layers": 8}, training={"seq_length": 64, "global_batch_size": 64, "micro_batch_size": 1},
                 parallelism={"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4})
    sub = mgr.submit(ProfileJobRequest(plan=plan, mode="memory_at_scale", rank=16))
    assert (sub.nodes, sub.gpus_per_node) == (1, 1)
    st = _wait(mgr, sub.job_id)
    assert st.state == "COMPLETED", (st.error, st.stderr_tail)
    assert st.result["measured_rank"] == 16 and st.result["ranks"][0]["pp_rank"] == 1
    terms = {t["term"]: t for t in st.memory_terms}
    # the stage's parameters as the local spec built them on the CPU (the H100 TE rows match exactly)
    assert terms["num_params"]["measured"] == pytest.approx(terms["num_params"]["predicted"], rel=0.01)
    assert terms["peak_allocated_gib"]["measured"] > 0 and terms["peak_allocated_gib"]["predicted"] > 0
    assert "rank 16 (pipeline stage 1" in st.comparison_note
