"""recommend_parallelism's comparisons: the nearest published run matches precision, GPU and model family
first and says what differs; a 2x-GPU what-if above linear scaling names the mechanism (or is capped); a
tiny model with the default global batch gets a plan instead of an error on the wrong field."""

from __future__ import annotations

import pytest

from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics.evaluate import evaluate_plan
from mcore_advisor.planning import recommend as rec_mod
from mcore_advisor.planning.recommend import (
    RecommendRequest,
    nearest_published_run,
    recommend_parallelism,
    request_from_options,
)
from mcore_advisor.schemas import ClusterSpec, ModelSpec, with_changes


def test_a_bf16_plan_is_not_compared_with_an_fp8_run():
    # The only published Llama-3 70B row (NeMo 24.07, 64 H100) is FP8; a BF16 plan gets a BF16 H100 run.
    shape = resolve_model(ModelSpec(name="llama3-70b"))
    r = nearest_published_run(shape, ClusterSpec(gpu="h100-sxm", num_gpus=64), 8192, "bf16")
    assert "fp8" not in (r.precision or "").lower() and r.gpu == "h100-sxm"
    assert any("another family" in d for d in r.differences) and any("sequence 4096" in d for d in r.differences)
    same = nearest_published_run(shape, ClusterSpec(gpu="h100-sxm", num_gpus=64), 8192, "fp8")
    assert same.model == "LLAMA3-70B" and same.differences == []  # like for like


def test_an_moe_plan_is_compared_with_an_moe_run():
    shape = resolve_model(ModelSpec(name="mixtral-8x7b"))
    r = nearest_published_run(shape, ClusterSpec(gpu="h100-sxm", num_gpus=64), 4096, "bf16")
    assert rec_mod.row_is_moe(next(row for row, *_ in rec_mod._run_table() if row.row == r.row))
    assert not any("dense model" in d for d in r.differences)


QWEN_16 = dict(model="qwen3-30b-a3b", gpu="h100-sxm", num_gpus=16, seq_length=4096, top_k=1)


@pytest.fixture(scope="module")
def qwen_16():
    return recommend_parallelism(request_from_options(**QWEN_16))


def test_superlinear_two_x_gpus_names_a_mechanism_that_holds(qwen_16):
    rec = qwen_16
    w = next(w for w in rec.what_if if w.scenario == "2x_gpus")
    if w.change_tokens_per_s_pct <= 100.5:
        pytest.skip("the model no longer predicts superlinear scaling here")
    assert "above linear scaling because" in w.note
    # The named layout must really not fit on 16 GPUs (else the 16-GPU search would have chosen it).
    layout = w.note.split("because ", 1)[1].split(" instead of ", 1)[0]
    assert layout == w.layout
    best = rec.plans[0].plan
    req = request_from_options(model="qwen3-30b-a3b", gpu="h100-sxm", num_gpus=32, seq_length=4096, top_k=1, what_if=False)
    top32 = rec_mod._quick_best(req, resolve_model(req.model), rec.global_batch_size)
    assert top32.layout == w.layout
    on16 = evaluate_plan(with_changes(top32.plan, "cluster", num_gpus=16))
    assert on16.memory.total_gib > on16.memory.capacity_gib * (1 - req.min_headroom_fraction)
    assert best != top32.plan


def test_superlinear_two_x_gpus_without_a_mechanism_is_capped_at_linear(monkeypatch, qwen_16):
    monkeypatch.setattr(rec_mod, "_superlinear_mechanism", lambda *a: None)
    req = request_from_options(**QWEN_16)
    w = next(w for w in rec_mod._what_ifs(req, resolve_model(req.model), qwen_16.global_batch_size, qwen_16.plans[0])
             if w.scenario == "2x_gpus")
    assert w.change_tokens_per_s_pct <= 100.0 + 1e-9 and w.change_tokens_per_s_per_gpu_pct <= 1e-9
    assert "capped at linear scaling" in w.note or w.change_tokens_per_s_pct <= 100.5


def test_tiny_model_with_the_default_global_batch_gets_a_plan():
    # seq 128 -> the default 4M-token batch is 32768 samples on one GPU: micro-batches above the plan's
    # 4096 limit used to be proposed and failed as 'micro_batch_size <= 4096 (got 32768)'.
    req = RecommendRequest(model=ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000),
                           cluster=ClusterSpec(num_gpus=1), seq_length=128, what_if=False)
    rec = recommend_parallelism(req)
    assert rec.global_batch_size == 32768 and rec.feasible
    assert all(p.plan.training.micro_batch_size <= 4096 for p in rec.plans)
