"""CUDA graphs in the step-time model: a captured part of a dense layer costs the host one replay (GRAPHED_LAUNCHES)."""

from __future__ import annotations

import pytest

from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics import step_time as stm
from mcore_advisor.physics.layouts import LayoutBatch
from mcore_advisor.physics.moe import DENSE_MLP_HOST_SHARE, GRAPHED_LAUNCHES
from mcore_advisor.schemas import Plan

# benchmarks/gpu/configs.py LLAMA1B, the Z set's dense model (benchmarks/results/gpu_h100_Z_runs.jsonl)
LLAMA1B = {"num_layers": 16, "hidden_size": 2048, "num_attention_heads": 16, "num_query_groups": 4,
           "ffn_hidden_size": 5632, "vocab_size": 32000, "swiglu": True, "normalization": "RMSNorm",
           "add_bias_linear": False, "untie_embeddings_and_output_weights": True, "position_embedding_type": "rope"}


def _plan(**impl) -> Plan:
    return Plan(model=LLAMA1B, cluster={"gpu": "h100-sxm", "num_gpus": 1, "host_floor_ms_per_layer": 5.5},
                training={"seq_length": 2048, "global_batch_size": 16, "micro_batch_size": 1},
                implementation={"create_attention_mask_in_dataloader": False, **impl})


def _dense(plan: Plan) -> tuple[dict, dict]:
    c = stm._context(LayoutBatch.from_plan(plan, resolve_model(plan.model)), stm.hardware_params(plan.cluster), False)
    d = stm._dense_layer(c).dense
    return d, stm._graphed_dense(c, d)


def test_a_whole_layer_graph_costs_the_host_one_replay_per_half_and_direction():
    d, g = _dense(_plan(cuda_graph_impl="transformer_engine"))
    assert float(g["kernels_f"][0]) == pytest.approx(2 * GRAPHED_LAUNCHES)
    assert float(g["kernels_b"][0]) == pytest.approx(2 * GRAPHED_LAUNCHES)
    assert float(d["kernels_f"][0]) > 8 * GRAPHED_LAUNCHES  # the eager layer (host units), untouched


def test_an_attention_graph_leaves_the_mlp_half_eager():
    d, g = _dense(_plan(cuda_graph_impl="transformer_engine", cuda_graph_modules=["attn"]))
    for i, key in enumerate(("kernels_f", "kernels_b")):
        mlp = DENSE_MLP_HOST_SHARE[i] * float(d[key][0])  # no query/key norms in this model
        assert float(g[key][0]) == pytest.approx(mlp + GRAPHED_LAUNCHES)


def test_the_local_impl_captures_the_whole_layer_for_attn_as_megatron_does():
    _, local = _dense(_plan(cuda_graph_impl="local", cuda_graph_modules=["attn"]))
    _, whole = _dense(_plan(cuda_graph_impl="local"))
    assert float(local["kernels_f"][0]) == float(whole["kernels_f"][0]) == pytest.approx(2 * GRAPHED_LAUNCHES)


def test_graphs_take_a_host_bound_dense_step_to_its_gpu_time():
    eager, graphed = (stm.step_time(_plan(**impl)) for impl in ({}, {"cuda_graph_impl": "local"}))
    # measured on one H100 (gpu_h100_Z_runs.jsonl): 1.61-1.93 s eager, 0.481-0.490 s with the layer graphed
    assert eager.host_bound and not graphed.host_bound
    assert graphed.iteration_time_s < 0.4 * eager.iteration_time_s
    assert graphed.breakdown.gemm_s == pytest.approx(eager.breakdown.gemm_s)
