"""evaluate_plan and estimate_memory mark a plan the validators reject as invalid at the top, list its
blocking findings first, and give no throughput for it; settings the models do not cover are flagged."""

from __future__ import annotations

from mcore_advisor.schemas import Plan
from mcore_advisor.tools.estimate_memory import estimate_memory
from mcore_advisor.tools.evaluate import evaluate_plan

# Llama 3 8B has 32 heads: TP 3 does not divide them (Megatron's validate_args asserts it), on 6 GPUs.
BAD = Plan(model={"name": "llama3-8b"}, cluster={"num_gpus": 6}, training={"global_batch_size": 96},
           parallelism={"tensor_model_parallel_size": 3})
GOOD = Plan(model={"name": "llama3-8b"}, cluster={"num_gpus": 8}, training={"global_batch_size": 64},
            parallelism={"tensor_model_parallel_size": 2, "sequence_parallel": True})


def _severity_order(findings) -> list[str]:
    return [f.severity for f in findings]


def test_evaluate_marks_a_refused_plan_invalid_and_gives_no_throughput():
    ev = evaluate_plan(BAD)
    assert ev.valid is False and ev.feasible is False
    assert ev.findings[0].severity == "error"
    sev = _severity_order(ev.findings)
    assert sev == sorted(sev, key=["error", "warning", "info"].index)  # blocking first
    assert ev.performance is None
    first_error = next(f for f in ev.findings if f.severity == "error")
    assert ev.performance_unavailable.startswith("no throughput for a plan Megatron would refuse")
    assert first_error.message in ev.performance_unavailable


def test_evaluate_of_a_valid_plan_is_valid_with_a_prediction():
    ev = evaluate_plan(GOOD)
    assert ev.valid is True and ev.performance is not None and ev.performance_unavailable is None


def test_estimate_memory_marks_a_refused_plan_invalid_with_blocking_findings_first():
    rep = estimate_memory(BAD)
    assert rep.valid is False and rep.findings[0].severity == "error"
    assert estimate_memory(GOOD).valid is True


def test_dropout_above_zero_is_modelled_not_flagged():
    drop = GOOD.model_copy(update={"training": GOOD.training.model_copy(update={"attention_dropout": 0.1, "hidden_dropout": 0.1})})
    for findings in (evaluate_plan(drop).findings, estimate_memory(drop).findings):
        assert not any(f.code == "dropout_not_modelled" for f in findings)
    # hidden dropout keeps a 1-byte mask per element of both bias-dropout-add outputs: more memory, more time
    assert estimate_memory(drop).breakdown.activations_gib > estimate_memory(GOOD).breakdown.activations_gib
    assert evaluate_plan(drop).performance.iteration_time_s > evaluate_plan(GOOD).performance.iteration_time_s
