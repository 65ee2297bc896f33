"""Pipeline balance: every stage's time counts what sits on it, the slowest stage sets the step, and the
breakdown books each term where it occurs: over every catalog model and several splits, no term is
negative and the terms add up to the step."""

from __future__ import annotations

import pytest

from mcore_advisor.knowledge.models import model_catalog, resolve_model
from mcore_advisor.physics.step_time import step_time
from mcore_advisor.schemas import ModelSpec, Plan, layers_per_stage

# (PP, VP, first, last, embedding/loss-aware): even, interleaved, lighter first or last, both, Megatron-Bridge's split
_SPLITS = [(1, None, None, None, False), (4, None, None, None, False), (4, 2, None, None, False),
           (4, None, 1, None, False), (4, None, None, 1, False), (4, None, 2, 2, False), (8, None, None, None, True),
           (8, 2, None, None, True)]


def _plans(key: str):
    L = resolve_model(ModelSpec(name=key)).num_layers
    for pp, vp, first, last, ends in _SPLITS:
        try:
            stages = layers_per_stage(L, pp, first, last, embedding=ends, loss=ends)
        except ValueError:
            continue
        if vp and (ends and (L + 2) // pp % vp or not ends and any(n % vp for n in stages)):
            continue
        yield Plan.model_validate({
            "model": {"name": key},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 8 * pp},
            "training": {"seq_length": 4096, "global_batch_size": 64, "micro_batch_size": 1},
            "parallelism": {"pipeline_model_parallel_size": pp, "virtual_pipeline_model_parallel_size": vp,
                            "decoder_first_pipeline_num_layers": first, "decoder_last_pipeline_num_layers": last,
                            "account_for_embedding_in_pipeline_split": ends, "account_for_loss_in_pipeline_split": ends},
        })


@pytest.mark.parametrize("key", sorted(model_catalog()))
def test_no_breakdown_term_is_negative_and_the_terms_add_up(key):
    n = 0
    for plan in _plans(key):
        est = step_time(plan)
        terms = est.breakdown.model_dump()
        negative = {k: v for k, v in terms.items() if v < 0}
        p = plan.parallelism
        assert not negative, (p.pipeline_model_parallel_size, p.decoder_first_pipeline_num_layers, negative)
        assert sum(terms.values()) == pytest.approx(est.iteration_time_s, rel=1e-9)
        n += 1
    assert n >= 1


def _llama8b(first=None, last=None, ends=False) -> Plan:
    return Plan.model_validate({
        "model": {"name": "llama3-8b"},
        "cluster": {"gpu": "h100-sxm", "num_gpus": 16, "host_floor_ms_per_layer": 0},
        "training": {"seq_length": 4096, "global_batch_size": 64, "micro_batch_size": 1},
        "parallelism": {"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 4, "sequence_parallel": True,
                        "decoder_first_pipeline_num_layers": first, "decoder_last_pipeline_num_layers": last,
                        "account_for_embedding_in_pipeline_split": ends, "account_for_loss_in_pipeline_split": ends},
    })


def test_a_heavier_middle_stage_books_no_output_layer_time():
    # 32 layers as 2 | 14 | 14 | 2: a middle stage (14 layers, no embedding, no output layer) is slowest, so
    # the output layer's GEMMs and loss are not in the breakdown's compute terms: the GEMM term is 14 layers'
    # worth per micro-batch, which the even split's last stage (8 layers + the 128k-vocabulary output layer)
    # exceeds per layer.
    skewed, even = step_time(_llama8b(2, 2)), step_time(_llama8b())
    m = 64 // 4  # micro-batches: GBS / (mbs x DP 1)
    per_layer_skewed = skewed.breakdown.gemm_s / (m * 14)
    per_layer_even = even.breakdown.gemm_s / (m * 8)
    assert per_layer_even > 1.05 * per_layer_skewed


def test_the_last_stage_with_mtp_and_its_output_layer_is_timed_with_them():
    # DeepSeek-V3's last stage also runs the MTP layer, its own output layer and loss: with an even split the
    # last stage is the slowest, and taking a layer off it (account_for_loss) shortens the step.
    def plan(**par):
        return Plan.model_validate({
            "model": {"name": "deepseek-v3"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 1024},
            "training": {"seq_length": 4096, "global_batch_size": 1024, "micro_batch_size": 1},
            "parallelism": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 16,
                            "expert_model_parallel_size": 64, "sequence_parallel": True, **par},
        })
    lighter_last = step_time(plan(decoder_last_pipeline_num_layers=1, decoder_first_pipeline_num_layers=0))
    assert lighter_last.iteration_time_s > 0
    with_mtp = step_time(plan(decoder_first_pipeline_num_layers=4, decoder_last_pipeline_num_layers=1))
    without = step_time(plan(decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=4))
    assert with_mtp.iteration_time_s < without.iteration_time_s
