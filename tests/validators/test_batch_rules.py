"""Batch rules: global batch divisibility and what the pipeline schedule needs."""

from __future__ import annotations

GBS = "training.global_batch_size"


def test_global_batch_not_divisible_by_dp_names_nearby_batches(kit):
    # DP = 64 / (8 * 2) = 4
    p = kit.plan(training={"global_batch_size": 102})
    f = kit.one(p, "global_batch_not_divisible")
    assert f.severity == "error"
    assert f.fields == [GBS, "training.micro_batch_size", "cluster.num_gpus"]
    assert f.message == (
        "global batch size (102) is not divisible by micro batch size (1) times data parallel size (4)"
    )
    assert "100 or 104" in f.fix


def test_global_batch_fix_also_offers_micro_batch_sizes(kit):
    p = kit.plan(training={"global_batch_size": 128, "micro_batch_size": 3})
    f = kit.one(p, "global_batch_not_divisible")
    # GBS multiples of 3 * 4 = 12 around 128; micro-batches dividing 128 / 4 = 32 nearest 3
    assert "120 or 132" in f.fix
    assert "micro_batch_size to 2, 4 or 8" in f.fix


def test_batch_rule_stays_silent_while_dp_is_undefined(kit):
    p = kit.plan(cluster={"num_gpus": 63}, training={"global_batch_size": 101})
    codes = kit.codes(p)
    assert "world_not_divisible_by_model_parallel" in codes
    assert "global_batch_not_divisible" not in codes


def test_interleaved_schedule_needs_microbatches_multiple_of_pp(kit):
    # TP8 PP4 -> DP2; GBS 20 -> 10 micro-batches, 10 % 4 != 0
    p = kit.plan(
        training={"global_batch_size": 20},
        parallelism={"pipeline_model_parallel_size": 4, "virtual_pipeline_model_parallel_size": 2},
    )
    f = kit.one(p, "interleaved_microbatches_not_divisible_by_pp")
    assert f.severity == "error"
    assert f.message.startswith(
        "number of microbatches (10) is not divisible by pipeline-model-parallel-size (4) when using interleaved schedule"
    )
    assert "16 or 24" in f.fix and "virtual_pipeline_model_parallel_size" in f.fix


def test_non_interleaved_pipeline_accepts_any_microbatch_count(kit):
    p = kit.plan(training={"global_batch_size": 20}, parallelism={"pipeline_model_parallel_size": 4})
    assert "interleaved_microbatches_not_divisible_by_pp" not in kit.codes(p)


def test_fewer_microbatches_than_stages_warns_with_the_bubble(kit):
    # DP4, GBS 4 -> one micro-batch through 2 stages: bubble (p-1)/m = 100% of ideal, 1/(1+1) = 50% of the step
    p = kit.plan(training={"global_batch_size": 4})
    f = kit.one(p, "pipeline_bubble")
    assert f.severity == "warning"
    assert "100% of the ideal" in f.message and "50% of each step" in f.message


def test_a_large_bubble_with_enough_microbatches_is_info(kit):
    # TP8 PP4 -> DP2; GBS 16 -> 8 micro-batches: (4-1)/8 = 38%
    p = kit.plan(training={"global_batch_size": 16}, parallelism={"pipeline_model_parallel_size": 4})
    f = kit.one(p, "pipeline_bubble")
    assert f.severity == "info"
    assert "38% of the ideal" in f.message
    assert "32" in f.fix  # 4 * PP micro-batches * mbs 1 * DP 2


def test_the_baseline_has_no_bubble_finding(kit):
    assert "pipeline_bubble" not in kit.codes(kit.plan())  # 32 micro-batches, bubble 1/32
