"""job_spec (the profile job's input: the rendered Megatron argv and what the entry reports with)
and the entry point's torch-free helpers: Megatron's log lines, trace analysis and the
iteration schedule."""

from __future__ import annotations

import json
import re

import pytest

from mcore_advisor.launcher.entry.trace import exposed_comm
from mcore_advisor.launcher.entry.trainlog import (
    memory_line,
    parse_iteration_line,
    parse_memory_line,
    parse_timer_line,
)
from mcore_advisor.launcher.spec import job_spec, most_loaded_rank
from mcore_advisor.physics.memory import memory_breakdown
from mcore_advisor.schemas import Plan
from mcore_advisor.tools.render import RenderRequest, render_launch_script


def _plan(**kw) -> Plan:
    base = dict(
        model={"name": "gpt3-1.3b"},
        cluster={"gpu": "h200", "num_gpus": 8},
        training={"seq_length": 2048, "global_batch_size": 64, "micro_batch_size": 2},
        parallelism={"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
    )
    base.update(kw)
    return Plan(**base)


def test_job_spec_is_plain_json_with_derived_dims_and_padded_vocab():
    spec = job_spec(_plan())
    assert json.loads(json.dumps(spec)) == spec
    # 8 GPUs / (TP2 * PP2) = DP2; 64 / (2 * 2) = 16 micro-batches per step
    assert spec["dims"] == {"tp": 2, "pp": 2, "vp": None, "cp": 1, "ep": 1, "etp": 2, "dp": 2,
                            "world_size": 8, "num_microbatches": 16}
    # 32768 is already a multiple of 128 * TP2
    assert spec["padded_vocab_size"] == 32768
    assert spec["model"]["num_layers"] == 24 and spec["model"]["ffn_hidden_size"] == 8192
    assert spec["gpu"]["bf16_dense_tflops"] == pytest.approx(989.4)
    # iterations 2 (profiler warm-up) and 4 (trace export) are disturbed too: 1 + 3 + 10
    assert spec["run"] == {"warmup_steps": 3, "measure_steps": 10, "profile_steps": [3, 3], "train_iters": 14,
                           "seed": 1234, "record_memory_history": False}
    assert Plan(**spec["plan"]) == _plan()
    assert (spec["mode"], spec["measured_rank"]) == ("profile", None)


def test_the_job_runs_exactly_the_argv_render_launch_script_renders_plus_its_run_window():
    spec = job_spec(_plan(), warmup_steps=1, measure_steps=2, profile_steps=(2, 2), seed=7, record_memory_history=True)
    rendered = render_launch_script(RenderRequest(
        plan=_plan(), launcher="torchrun", train_iters=5, profile=True, profile_step_start=2, profile_step_end=3,
        profile_ranks=[0], extra_args=["--seed", "7", "--record-memory-history"])).megatron_args
    assert spec["megatron_argv"] == rendered
    argv = spec["megatron_argv"]
    assert argv[argv.index("--train-iters") + 1] == "5" and "--use-pytorch-profiler" in argv


def test_memory_at_scale_measures_the_most_loaded_pipeline_stage_by_default_or_the_given_rank():
    plan = _plan(model={"name": "llama3-70b"}, cluster={"gpu": "h100-sxm", "num_gpus": 64},
                 training={"seq_length": 8192, "global_batch_size": 128, "micro_batch_size": 1},
                 parallelism={"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 4,
                              "sequence_parallel": True})
    spec = job_spec(plan, mode="memory_at_scale")
    # pipeline rank p is global rank p * 64 / 4 (Megatron's order tp-cp-ep-dp-pp)
    assert spec["measured_rank"] == most_loaded_rank(plan) == memory_breakdown(plan).most_loaded_pipeline_rank * 16
    assert "--fake-process-group" in spec["megatron_argv"] and "--profile" not in spec["megatron_argv"]
    assert spec["run"]["train_iters"] == 2  # memory read after iteration 2, nothing after it
    assert job_spec(plan, mode="memory_at_scale", rank=17)["measured_rank"] == 17
    with pytest.raises(ValueError, match="rank must be"):
        job_spec(plan, mode="memory_at_scale", rank=64)


def test_job_spec_pads_vocab_like_megatron_and_keeps_vp_only_with_pp():
    spec = job_spec(_plan(model={"name": "gpt3-1.3b", "vocab_size": 50257},
                          parallelism={"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 2,
                                       "virtual_pipeline_model_parallel_size": 3}))
    # Megatron _vocab_size_with_padding: multiple of 128 * 4 = 512 -> 50688
    assert spec["padded_vocab_size"] == 50688
    assert spec["dims"]["vp"] == 3
    flat = job_spec(_plan(parallelism={"virtual_pipeline_model_parallel_size": 3}))
    assert flat["dims"]["vp"] is None


def test_job_spec_rejects_batch_that_does_not_split_naming_the_field():
    with pytest.raises(ValueError, match=r"training\.global_batch_size"):
        job_spec(_plan(training={"seq_length": 2048, "global_batch_size": 30, "micro_batch_size": 4}))


def test_job_spec_rejects_world_not_divisible_by_model_parallel():
    with pytest.raises(ValueError, match=r"cluster\.num_gpus"):
        job_spec(_plan(cluster={"gpu": "h200", "num_gpus": 6}, parallelism={"tensor_model_parallel_size": 4}))


def test_job_spec_rejects_bad_profile_window():
    with pytest.raises(ValueError, match="profile_steps"):
        job_spec(_plan(), profile_steps=(3, 2))
    assert job_spec(_plan(), profile_steps=None)["run"]["profile_steps"] is None


#: one line as megatron-core 0.19.2's training_log printed it in the CPU job (tests/launcher/test_entry_cpu.py)
MEGATRON_LINE = (" [2026-11-26 06:26:51.448157] iteration        1/       4 | consumed samples:            8 |"
                 " elapsed time per iteration (ms): 295.2 | throughput per GPU (TFLOP/s/GPU): 0.0 |"
                 " learning rate: 2.627041E-04 | global batch size:     8 | lm loss: 4.860688E+00 | loss scale: 1.0 |"
                 " grad norm: 1.503 | number of skipped iterations:   0 | number of nan iterations:   0 |")


def test_megatrons_iteration_line_is_read_field_by_field():
    r = parse_iteration_line(MEGATRON_LINE)
    assert (r["iteration"], r["train_iters"], r["elapsed_ms"], r["tflops_per_gpu"]) == (1, 4, 295.2, 0.0)
    assert (r["lm_loss"], r["grad_norm"], r["learning_rate"], r["skipped"], r["nan"]) == (4.860688, 1.503, 2.627041e-4, 0, 0)
    assert r["fields"]["global batch size"] == 8
    assert parse_iteration_line("iteration 1 of something else") is None


def test_megatrons_memory_and_timer_lines_are_read_and_the_memory_line_written_byte_for_byte():
    line = memory_line(3, 2, 1024.0, 2048.5, 3000.0, 4096.25)
    assert line == ("[Rank 3] (after 2 iterations) memory (MB) | allocated: 1024.00 | max allocated: 2048.50 |"
                    " reserved: 3000.00 | max reserved: 4096.25")
    assert parse_memory_line(line) == {"rank": 3, "iteration": 2, "allocated_mb": 1024.0, "max_allocated_mb": 2048.5,
                                       "reserved_mb": 3000.0, "max_reserved_mb": 4096.25}
    assert parse_timer_line("    model-and-optimizer-setup ......................: (54.93, 61.20)") == (
        "model-and-optimizer-setup", 54.93, 61.2)
    assert parse_timer_line("    forward-backward ...............................: 12.50") == ("forward-backward", 12.5, 12.5)


def test_exposed_comm_counts_only_nccl_time_outside_compute_kernels():
    ev = [
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ts": 50, "dur": 100},  # 50 hidden, 50 exposed
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_ReduceScatter", "ts": 300, "dur": 20},  # exposed
        {"ph": "X", "cat": "kernel", "name": "elementwise_kernel", "ts": 400, "dur": 10},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},
    ]
    r = exposed_comm(ev, num_steps=2)
    assert r["comm_s"] == pytest.approx(120e-6 / 2)
    assert r["exposed_comm_s"] == pytest.approx(70e-6 / 2)
    assert r["device_busy_s"] == pytest.approx((150 + 20 + 10) * 1e-6 / 2)


def test_exposed_comm_on_cpu_counts_blocking_collectives():
    ev = [
        {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "ts": 10, "dur": 30},
        {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "ts": 15, "dur": 10},  # nested: no double count
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 50, "dur": 100},
    ]
    assert exposed_comm(ev)["exposed_comm_s"] == pytest.approx(30e-6)


def test_iteration_plan_never_measures_a_profiled_iteration():
    from mcore_advisor.launcher.entry.profile import iteration_plan

    # Megatron's profiler warms up in iteration 2 and writes the trace inside iteration 4
    assert iteration_plan(3, 4, (3, 3)) == ["warmup", "profile", "profile", "profile", "measure", "measure", "measure", "measure"]
    assert iteration_plan(1, 3, (2, 3)) == ["profile", "profile", "profile", "profile", "measure", "measure", "measure"]
    assert iteration_plan(2, 2, None) == ["warmup", "warmup", "measure", "measure"]
    # a window after the measured iterations is still reached, export iteration included
    assert iteration_plan(0, 1, (3, 3)) == ["measure", "profile", "profile", "profile"]


def test_entry_modules_import_neither_pydantic_nor_the_rest_of_mcore_advisor():
    import pathlib

    entry = pathlib.Path(__file__).resolve().parents[2] / "src/mcore_advisor/launcher/entry"
    for f in entry.glob("*.py"):
        text = f.read_text()
        assert not re.search(r"^\s*(import|from)\s+pydantic", text, re.M), f.name
        for m in re.finditer(r"^\s*from\s+(mcore_advisor[\w.]*)\s+import", text, re.M):
            assert m.group(1).startswith("mcore_advisor.launcher.entry"), (f.name, m.group(1))


def test_gpu_traces_flag_the_host_bound_run_and_not_the_h100_megatron_loop_run():
    # Rank-0 torch.profiler traces (benchmarks/results/gpu_traces): an H200 run of the earlier job, GPT
    # 1.3B TE DP2 mbs 4 (step 0.990 s, gpu_memory_sweep.jsonl), and Megatron's own profiler on an H100,
    # GPT 1.3B TE mbs 4 (iteration 2 traced; unprofiled step 1.187 s, gpu_h100_megatron_runs.jsonl).
    import gzip
    from pathlib import Path

    from mcore_advisor.launcher.entry.profile import device_idle

    traces = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu_traces"

    def busy(name: str) -> float:
        events = json.loads(gzip.decompress((traces / f"{name}.trace_rank0.json.gz").read_bytes()))["traceEvents"]
        return exposed_comm(events, num_steps=1)["device_busy_s"]

    small = busy("m_gpt1.3b_dp2_distopt_mbs4")
    idle, note = device_idle(small, 0.990)
    assert small == pytest.approx(0.508, abs=0.005) and idle == pytest.approx(0.49, abs=0.01)
    assert note and note.startswith("host-bound")
    h100 = busy("i14_7_d13_te_s2k_mbs4")
    idle, note = device_idle(h100, 1.18665)
    assert h100 == pytest.approx(1.057, abs=0.005) and 0.05 < idle < 0.15 and note is None
