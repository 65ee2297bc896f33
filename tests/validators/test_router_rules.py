"""MoE router settings Megatron-Core rejects at startup: top-1 softmax routing needs --moe-router-pre-softmax
(TransformerConfig.__post_init__, megatron-core 0.19.2)."""

from __future__ import annotations

import pytest

from mcore_advisor.knowledge.hardware import gpu
from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.schemas import ModelSpec
from mcore_advisor.validators import Ctx, layout_errors

CODE = "router_top1_needs_pre_softmax"
ONE_GPU = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}


def _top1(kit, **router):
    return kit.plan(model=dict(kit.MIXTRAL, moe_router_topk=1, **router), cluster={"num_gpus": 8},
                    parallelism=ONE_GPU)


def test_top1_softmax_routing_without_pre_softmax_is_an_error_with_both_fixes(kit):
    # Megatron's defaults: score function softmax, load balancing aux_loss, pre-softmax off.
    f = kit.one(_top1(kit), CODE)
    assert f.severity == "error"
    assert f.fields == ["model.moe_router_topk", "model.moe_router_pre_softmax"]
    assert "Please use --moe-router-pre-softmax when topk is 1" in f.message
    assert "model.moe_router_pre_softmax=true (--moe-router-pre-softmax)" in f.fix
    assert "model.moe_router_topk to 2" in f.fix


@pytest.mark.parametrize("router", [
    {"moe_router_score_function": "softmax"},
    {"moe_router_pre_softmax": False},
    {"moe_router_load_balancing_type": "aux_loss"},
    {"moe_router_load_balancing_type": "seq_aux_loss"},
    {"moe_router_load_balancing_type": "none"},
])
def test_explicit_settings_equal_to_megatrons_defaults_still_fire(kit, router):
    assert CODE in kit.codes(_top1(kit, **router))


@pytest.mark.parametrize("router", [
    {"moe_router_pre_softmax": True},
    {"moe_router_score_function": "sigmoid"},
    {"moe_router_load_balancing_type": "sinkhorn"},
])
def test_top1_is_accepted_with_pre_softmax_sigmoid_scores_or_sinkhorn(kit, router):
    assert CODE not in kit.codes(_top1(kit, **router))


def test_top2_softmax_without_pre_softmax_is_accepted(kit):
    p = kit.plan(model=dict(kit.MIXTRAL, moe_router_topk=2), cluster={"num_gpus": 8}, parallelism=ONE_GPU)
    assert CODE not in kit.codes(p)


def test_dense_model_with_a_top1_setting_does_not_fire(kit):
    # Without experts no --moe-router-topk is rendered: Megatron keeps its default of 2.
    p = kit.plan(model=dict(kit.MIXTRAL, num_experts=None, moe_router_topk=1), cluster={"num_gpus": 8},
                 parallelism=ONE_GPU)
    assert CODE not in kit.codes(p)


def test_fast_path_reports_it_on_every_layout(kit):
    shape = resolve_model(ModelSpec(**dict(kit.MIXTRAL, moe_router_topk=1)))
    c = Ctx(shape, gpu("h100-sxm"), num_gpus=8, seq_length=4096, gbs=64)
    assert CODE in layout_errors(c) and CODE in layout_errors(c.with_layout(ep=8))
    fixed = Ctx(resolve_model(ModelSpec(**dict(kit.MIXTRAL, moe_router_topk=1, moe_router_pre_softmax=True))),
                gpu("h100-sxm"), num_gpus=8, seq_length=4096, gbs=64)
    assert CODE not in layout_errors(fixed)
