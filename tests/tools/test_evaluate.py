"""evaluate_plan: findings + resolved model + layout + memory + performance, for valid and invalid plans."""

from __future__ import annotations

import pytest

from mcore_advisor.schemas import ClusterSpec, ModelSpec, ParallelismSpec, Plan, TrainingSpec
from mcore_advisor.tools.evaluate import Evaluation, evaluate_plan


def _plan(model="llama3-8b", num_gpus=8, gbs=32, mbs=1, s=4096, gpu="h100-sxm", **par) -> Plan:
    return Plan(
        model=ModelSpec(name=model),
        cluster=ClusterSpec(gpu=gpu, num_gpus=num_gpus),
        training=TrainingSpec(seq_length=s, global_batch_size=gbs, micro_batch_size=mbs),
        parallelism=ParallelismSpec(**par),
    )


def test_valid_plan_is_feasible_with_memory_performance_and_layout():
    e = evaluate_plan(_plan(tensor_model_parallel_size=2, sequence_parallel=True))
    assert isinstance(e, Evaluation)
    assert e.feasible
    assert not [f for f in e.findings if f.severity == "error"]
    assert e.model.hidden_size == 4096 and e.model.num_query_groups == 8
    # DP = 8 / TP2 = 4; micro-batches = 32 / (1 * 4) = 8
    assert (e.parallel.data_parallel_size, e.parallel.num_microbatches) == (4, 8)
    assert e.parallel.num_nodes == 1
    assert e.memory is not None and e.memory.fits
    assert e.performance is not None and e.performance.tokens_per_s_per_gpu > 0
    assert any(line.startswith("dominant costs: GEMMs") for line in e.explanation)
    assert any(line.startswith("fits:") for line in e.explanation)


def test_plan_breaking_a_megatron_rule_is_infeasible_and_says_why():
    # Llama-3 8B has 32 heads and 8 query groups: TP 3 divides neither (nor the 8 GPUs).
    e = evaluate_plan(_plan(tensor_model_parallel_size=3))
    assert not e.feasible
    codes = {f.code for f in e.findings if f.severity == "error"}
    assert "heads_not_divisible_by_tp" in codes
    assert e.explanation[0].startswith("not runnable")


def test_plan_that_does_not_fit_is_infeasible_with_its_memory():
    # Llama-3 70B with TP1 on 8 GPUs: 70.6e9 params x 2 B of bf16 weights alone exceed 80 GB.
    e = evaluate_plan(_plan(model="llama3-70b", gbs=8))
    assert not [f for f in e.findings if f.severity == "error"]
    assert e.memory is not None and not e.memory.fits
    assert not e.feasible
    assert any(line.startswith("does not fit") for line in e.explanation)


def test_performance_figures_name_their_convention_and_peak():
    perf = evaluate_plan(_plan(tensor_model_parallel_size=2, sequence_parallel=True)).performance
    # full s^2 counts more attention FLOPs than the causal half for the same step time
    assert perf.model_tflops_per_gpu_full > perf.model_tflops_per_gpu_causal
    assert perf.mfu_bf16_causal_pct == pytest.approx(100 * perf.model_tflops_per_gpu_causal / 989.4)
    assert perf.mfu_fp8_causal_pct is None


def test_unknown_model_raises_key_error_naming_the_known_models():
    with pytest.raises(KeyError, match="unknown model"):
        evaluate_plan(_plan(model="no-such-model"))
