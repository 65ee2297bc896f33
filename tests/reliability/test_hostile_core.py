"""The hostile-input probe's findings (issue 19), at the core: each is now a prompt error naming the field,
a bounded search, or a finite answer."""

from __future__ import annotations

import functools
import math
import sys
import time

import pytest
from _rel_fuzz import CALL_LIMIT_S
from pydantic import ValidationError

from mcore_advisor.diagnosis.mfu import MfuRequest, check_mfu
from mcore_advisor.physics.evaluate import evaluate_plan
from mcore_advisor.planning import recommend as rec
from mcore_advisor.schemas import ModelSpec, Plan, TrainingSpec

REQUEST = {"model": {"name": "llama3-8b"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 8}, "seq_length": 4096}
PLAN = {"model": {"name": "llama3-8b"}, "cluster": {"num_gpus": 8},
        "training": {"seq_length": 4096, "global_batch_size": 128, "micro_batch_size": 1}, "parallelism": {}}


@pytest.mark.parametrize("change, field", [
    ({"fixed": {"pipeline_model_parallel_size": 2**63}}, "fixed.pipeline_model_parallel_size"),
    ({"fixed": {"virtual_pipeline_model_parallel_size": 2**31 - 1}}, "fixed.virtual_pipeline_model_parallel_size"),
    ({"fixed": {"micro_batch_size": 2**64}}, "fixed.micro_batch_size"),
    ({"global_batch_size": 2**62}, "global_batch_size"),
    ({"fixed": {"decoder_first_pipeline_num_layers": 2**40}}, "fixed.decoder_first_pipeline_num_layers"),
])
def test_sizes_that_hung_the_search_are_refused_at_once_naming_the_field(change, field):
    t0 = time.monotonic()
    with pytest.raises(ValidationError) as info:
        rec.RecommendRequest.model_validate({**REQUEST, **change})
    assert time.monotonic() - t0 < 1.0
    assert [".".join(map(str, e["loc"])) for e in info.value.errors()] == [field]


def test_a_pinned_size_above_the_world_size_is_refused_with_the_reason():
    with pytest.raises(ValidationError, match=r"fixed.pipeline_model_parallel_size: 16 is more than cluster.num_gpus \(8\)"):
        rec.RecommendRequest.model_validate({**REQUEST, "fixed": {"pipeline_model_parallel_size": 16}})


def test_moe_layer_freq_0_is_refused_like_megatron_would_divide_by_it():
    with pytest.raises(ValidationError, match="moe_layer_freq"):
        ModelSpec(name="mixtral-8x7b", moe_layer_freq=0)
    with pytest.raises(ValidationError, match="moe_layer_freq"):
        ModelSpec(name="mixtral-8x7b", moe_layer_freq=[1, 2])
    assert ModelSpec(moe_layer_freq=[0, 1]).moe_layer_freq == [0, 1]
    with pytest.raises(ValidationError, match="global_batch_size"):
        TrainingSpec(global_batch_size=2**62)


@pytest.mark.parametrize("measured", [
    {"tokens_per_s": 5e-324}, {"iteration_time_s": 1e-320}, {"tokens_per_s_per_gpu": 5e-324},
    {"reported_tflops_per_gpu": 5e-324}, {"peak_tflops_per_gpu": 5e-324, "iteration_time_s": 1.0},
    {"claimed_mfu_pct": 5e-324, "reported_tflops_per_gpu": 400.0},
])
def test_measurements_that_overflowed_check_mfu_are_refused_naming_the_field(measured):
    with pytest.raises(ValidationError) as info:
        MfuRequest(plan=Plan.model_validate(PLAN), **measured)
    assert {e["loc"][0] for e in info.value.errors()} <= set(measured)


def _finite(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(_finite(v) for v in value)
    return True


@pytest.mark.parametrize("measured", [{"iteration_time_s": 1e-6}, {"iteration_time_s": 1e7}, {"tokens_per_s": 1e-3},
                                      {"tokens_per_s_per_gpu": 1e9}, {"reported_tflops_per_gpu": 1e-6},
                                      {"peak_tflops_per_gpu": 1e-3, "iteration_time_s": 1.0}])
def test_check_mfu_at_the_bounds_answers_with_finite_numbers_only(measured):
    report = check_mfu(MfuRequest(plan=Plan.model_validate(PLAN), **measured))
    assert _finite(report.model_dump())


def test_a_tiny_model_with_context_parallelism_has_finite_figures():
    plan = Plan.model_validate({"model": {"num_layers": 2, "hidden_size": 3, "num_attention_heads": 1, "vocab_size": 10},
                                "cluster": {"num_gpus": 8}, "parallelism": {"context_parallel_size": 2}})
    assert _finite(evaluate_plan(plan).model_dump())


def test_a_search_space_over_the_budget_runs_the_quicker_space_and_says_so(monkeypatch):
    monkeypatch.setattr(rec, "MAX_LAYOUTS", 50)
    out = rec.recommend_parallelism(rec.RecommendRequest.model_validate({**REQUEST, "what_if": False}))
    note = next(n for n in out.notes if n.startswith("the full search space has"))
    assert "more than the 50 one answer may take: searched the quicker space instead" in note
    assert out.feasible and out.stats.layouts_enumerated < int(note.split()[5].replace(",", ""))


def test_follow_up_searches_share_a_budget_and_skipped_ones_are_named(monkeypatch):
    monkeypatch.setattr(rec, "MAX_FOLLOW_UP_LAYOUTS", 0)
    out = rec.recommend_parallelism(rec.RecommendRequest.model_validate(REQUEST))
    assert out.what_if == []
    assert "2 follow-up search(es) (what-ifs, suggestions) skipped" in " ".join(out.notes)


def _clear_package_caches() -> None:
    """A cold server: every functools cache of the package emptied (the per-layout memory tables are
    most of a cold search's cost)."""
    for name, mod in list(sys.modules.items()):
        if name.startswith("mcore_advisor") and mod is not None:
            for obj in vars(mod).values():
                if isinstance(obj, functools._lru_cache_wrapper):
                    obj.cache_clear()


@pytest.mark.parametrize("model, num_gpus", [("qwen3-30b-a3b", 1024), ("gpt-oss-20b", 2048)])
def test_the_slowest_fuzzed_searches_answer_within_the_call_limit_with_a_cpu_clock(model, num_gpus):
    # The fuzzer's two calls over 5 CPU s (5.8 and 5.0 s through the server, before the search had a
    # CPU deadline): cold, they cost 9-10 s of CPU uncut on a 2-core host; with the calling thread's CPU
    # clock the searches stop within SEARCH_CPU_BUDGET_S and the call stays under the fuzzer's limit.
    req = rec.RecommendRequest.model_validate({**REQUEST, "model": {"name": model}, "cluster": {"num_gpus": num_gpus}})
    _clear_package_caches()
    c0 = time.thread_time()
    out = rec.recommend_parallelism(req, cpu_clock=time.thread_time)
    assert time.thread_time() - c0 < CALL_LIMIT_S
    assert out.feasible and out.plans[0].memory_total_gib <= out.plans[0].capacity_gib
