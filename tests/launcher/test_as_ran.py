"""Predictions for the plan as a profile job ran it (the entry falls back without TE or Apex)."""

from __future__ import annotations

import pytest

from mcore_advisor.launcher import jobs
from mcore_advisor.launcher.as_ran import as_ran
from mcore_advisor.physics.memory import memory_breakdown
from mcore_advisor.physics.step_time import step_time
from mcore_advisor.schemas import ClusterSpec, ModelSpec, Plan, TrainingSpec, with_changes

PLAN = Plan(model=ModelSpec(name="gpt3-1.3b"), cluster=ClusterSpec(gpu="h200", num_gpus=1),
            training=TrainingSpec(seq_length=2048, global_batch_size=32, micro_batch_size=8))


def test_a_run_that_matched_the_plan_changes_nothing():
    ran = as_ran(PLAN, {"transformer_impl": "transformer_engine",
                        "settings": {"gradient_accumulation_fusion": "all layers", "cross_entropy_loss_fusion": True}})
    assert ran.plan == PLAN and ran.differences == [] and ran.output_layer_wgrad_fusion is None
    assert as_ran(PLAN, None).plan == PLAN
    assert jobs._as_ran_prediction(PLAN.model_dump(mode="json"), None) == (None, None)


def test_no_te_and_no_apex_fallbacks_are_what_gets_predicted():
    # a machine without Transformer Engine: local spec, no wgrad fusion, the run's cross entropy
    local = as_ran(PLAN, {"transformer_impl": "local",
                          "settings": {"gradient_accumulation_fusion": False, "cross_entropy_loss_fusion": False}})
    im = local.plan.implementation
    assert (im.transformer_impl, im.gradient_accumulation_fusion, im.cross_entropy_loss_fusion) == ("local", False, False)
    assert any("transformer_impl local" in d for d in local.differences)
    # TE without Apex: TE layers fuse, Megatron's output layer does not
    te_only = as_ran(PLAN, {"transformer_impl": "transformer_engine", "settings": {"gradient_accumulation_fusion": "TE layers"}})
    assert te_only.plan.implementation.gradient_accumulation_fusion is True and te_only.output_layer_wgrad_fusion is False
    figures, note = jobs._as_ran_prediction(PLAN.model_dump(mode="json"),
                                            {"transformer_impl": "local", "settings": {"gradient_accumulation_fusion": False}})
    ran_plan = with_changes(PLAN, "implementation", transformer_impl="local", gradient_accumulation_fusion=False)
    assert figures.iteration_time_s == pytest.approx(step_time(ran_plan).iteration_time_s)
    assert figures.iteration_time_s != pytest.approx(step_time(PLAN).iteration_time_s)
    assert "as the job ran it" in note and "transformer_impl local" in note
    figures, _ = jobs._as_ran_prediction(PLAN.model_dump(mode="json"),
                                         {"transformer_impl": "transformer_engine", "settings": {"gradient_accumulation_fusion": "TE layers"}})
    assert figures.peak_allocated_gib == pytest.approx(memory_breakdown(PLAN, output_layer_wgrad_fusion=False).peak_allocated_gib)
    assert figures.peak_allocated_gib < memory_breakdown(PLAN).peak_allocated_gib  # 128 MiB: no output-layer dummy
