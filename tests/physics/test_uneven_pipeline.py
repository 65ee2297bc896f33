"""Uneven pipeline stages (decoder_first/last_pipeline_num_layers) in memory and step time."""

from __future__ import annotations

from mcore_advisor.physics.memory import memory_breakdown
from mcore_advisor.physics.step_time import step_time
from mcore_advisor.schemas import Plan


def _plan(first=None, last=None) -> Plan:
    return Plan.model_validate({
        "model": {"name": "llama3-8b"},
        "cluster": {"gpu": "h100-sxm", "num_gpus": 8, "host_floor_ms_per_layer": 0},  # the GPU pipeline alone
        "training": {"seq_length": 4096, "global_batch_size": 64, "micro_batch_size": 1},
        "parallelism": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4, "sequence_parallel": True,
                        "decoder_first_pipeline_num_layers": first, "decoder_last_pipeline_num_layers": last},
    })


def test_memory_places_the_configured_layer_counts_on_each_stage():
    # 32 layers on PP4 with first = last = 2: the two middle stages hold 14 each (schemas.layers_per_stage)
    stages = {s.pipeline_rank: s.num_layers for s in memory_breakdown(_plan(2, 2)).stages}
    assert stages[0] == 2 and stages[3] == 2 and stages[1] == 14
    even = {s.pipeline_rank: s.num_layers for s in memory_breakdown(_plan()).stages}
    assert set(even.values()) == {8}


def test_a_stage_with_more_layers_slows_the_pipeline_in_proportion():
    even, skewed = step_time(_plan()), step_time(_plan(2, 2))
    # 16 micro-batches paced by the slowest stage, plus the bubble (sum - max): in layer units
    # (16*14 + 18) / (16*8 + 24) = 1.59 at most; the logits, DP and optimizer time dilute it.
    ratio = skewed.iteration_time_s / even.iteration_time_s
    assert 1.3 < ratio < 1.6
    # lighter first/last stages that keep the largest stage at ceil(L/pp) cost at most the bubble change
    balanced = step_time(_plan(7, 7))  # 7 | 9 | 9 | 7
    assert balanced.iteration_time_s < 1.2 * even.iteration_time_s
