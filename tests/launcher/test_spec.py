"""job_spec (the profile job's input) and the entry point's torch-free helpers: FLOPs, log lines,
trace analysis and the iteration schedule."""

from __future__ import annotations

import json
import re
from datetime import datetime

import pytest

from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.launcher.entry import flops as entry_flops
from mcore_advisor.launcher.entry.trace import exposed_comm
from mcore_advisor.launcher.entry.trainlog import iteration_line, memory_line
from mcore_advisor.launcher.spec import job_spec
from mcore_advisor.schemas import ModelSpec, Plan

tools_flops = pytest.importorskip("mcore_advisor.physics.flops")


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
    assert spec["run"] == {"warmup_steps": 3, "measure_steps": 10, "profile_steps": [3, 3], "seed": 1234}
    assert Plan(**spec["plan"]) == _plan()


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


SHAPES = [
    {"name": "gpt3-1.3b"},
    {"name": "llama3-8b"},
    {"name": "llama3-70b"},
    {"name": "mixtral-8x7b"},
    {"name": "deepseek-v3"},  # MLA + MoE with dense first layers + MTP
    {"name": "qwen3-30b-a3b"},
    {"num_layers": 12, "hidden_size": 1024, "num_attention_heads": 16, "num_query_groups": 4, "vocab_size": 32000,
     "swiglu": True, "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 2816,
     "moe_shared_expert_intermediate_size": 1408, "moe_layer_freq": 2},
]


@pytest.mark.parametrize("model", SHAPES, ids=lambda m: m.get("name", "custom-moe"))
@pytest.mark.parametrize("convention", ["causal", "full"])
@pytest.mark.parametrize("tp", [1, 8])
def test_entry_flops_copy_equals_tools_flops(model, convention, tp):
    try:
        shape = resolve_model(ModelSpec(**model))
    except KeyError:
        pytest.skip(f"{model} not in this catalog")
    spec_model = json.loads(json.dumps(shape.model_dump(mode="json")))
    pv = entry_flops.padded_vocab_size(spec_model, tp)
    assert pv == shape.padded_vocab_size(tp)
    for seq, gbs in ((2048, 32), (8192, 7)):
        ours = entry_flops.flops_per_iteration(spec_model, seq, gbs, convention, padded_vocab=pv)
        ref = tools_flops.flops_per_iteration(shape, seq, gbs, convention, tensor_model_parallel_size=tp)
        assert ours == pytest.approx(ref, rel=1e-12)


def test_entry_flops_matches_narayanan_closed_form_for_gpt_shapes():
    # Narayanan et al. 2021 eq. 3 (full s^2 convention): 72*B*s*L*h^2*(1 + s/(6h) + V/(12*L*h))
    m = json.loads(json.dumps(resolve_model(ModelSpec(name="gpt3-1.3b")).model_dump(mode="json")))
    B, s, L, h, V = 32, 2048, 24, 2048, 32768
    want = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert entry_flops.flops_per_iteration(m, s, B, "full", padded_vocab=V) == pytest.approx(want, rel=1e-12)
    # causal halves only the s^2 term: 72*B*s*L*h^2 * s/(6h) / 2 less
    causal = entry_flops.flops_per_iteration(m, s, B, "causal", padded_vocab=V)
    assert want - causal == pytest.approx(72 * B * s * L * h * h * s / (6 * h) / 2, rel=1e-12)


def test_iteration_line_has_megatron_training_log_format():
    line = iteration_line(when=datetime(2026, 11, 21, 23, 59, 29, 393678), iteration=5, train_iters=10,
                          consumed_samples=160, elapsed_ms=1068.04, tflops_per_gpu=507.26, learning_rate=1e-4,
                          global_batch_size=32, losses={"lm loss": 10.3721}, grad_norm=1.0694)
    # megatron/training/training.py training_log, field by field
    assert line == (
        " [2026-11-21 23:59:29.393678] iteration        5/      10 | consumed samples:          160 |"
        " elapsed time per iteration (ms): 1068.0 | throughput per GPU (TFLOP/s/GPU): 507.3 |"
        " learning rate: 1.000000E-04 | global batch size:    32 | lm loss: 1.037210E+01 |"
        " loss scale: 1.0 | grad norm: 1.069 | number of skipped iterations:   0 |"
        " number of nan iterations:   0 |"
    )
    nan = iteration_line(when=datetime(2026, 1, 1), iteration=1, train_iters=1, consumed_samples=1,
                         elapsed_ms=1.0, tflops_per_gpu=None, learning_rate=None, global_batch_size=1,
                         losses={"lm loss": float("nan")}, nan_iterations=1)
    assert "lm loss" not in nan and "number of nan iterations:   1 |" in nan


def test_memory_line_has_megatron_report_memory_format():
    assert memory_line(3, 2, 1024.0, 2048.5, 3000.0, 4096.25) == (
        "[Rank 3] (after 2 iterations) memory (MB) | allocated: 1024.00 | max allocated: 2048.50 |"
        " reserved: 3000.00 | max reserved: 4096.25"
    )


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

    assert iteration_plan(3, 4, (3, 3)) == ["warmup", "warmup", "profile", "measure", "measure", "measure", "measure"]
    kinds = iteration_plan(1, 3, (2, 3))
    assert kinds == ["warmup", "profile", "profile", "measure", "measure", "measure"]
    assert iteration_plan(2, 2, None) == ["warmup", "warmup", "measure", "measure"]
    # a window after the measured iterations is still reached
    assert iteration_plan(0, 1, (3, 3)) == ["measure", "extra", "profile"]


def test_entry_modules_import_neither_pydantic_nor_the_rest_of_mcore_advisor():
    import pathlib

    entry = pathlib.Path(__file__).resolve().parents[2] / "src/mcore_advisor/launcher/entry"
    for f in entry.glob("*.py"):
        text = f.read_text()
        assert not re.search(r"^\s*(import|from)\s+pydantic", text, re.M), f.name
        for m in re.finditer(r"^\s*from\s+(mcore_advisor[\w.]*)\s+import", text, re.M):
            assert m.group(1).startswith("mcore_advisor.launcher.entry"), (f.name, m.group(1))
