"""physics.moe: the MoE layer's parts (issue 15)."""

from __future__ import annotations

import pytest

from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics import moe
from mcore_advisor.physics import step_time as stm
from mcore_advisor.physics.layouts import LayoutBatch
from mcore_advisor.physics.step_time import step_time
from mcore_advisor.schemas import Plan, with_changes

# the one-GPU evidence row's model (benchmarks/gpu/configs.py MOE): 8 experts top-2, hidden 1024
MOE8 = {"num_layers": 12, "hidden_size": 1024, "num_attention_heads": 16, "num_query_groups": 4, "ffn_hidden_size": 2816,
        "vocab_size": 32000, "swiglu": True, "normalization": "RMSNorm", "add_bias_linear": False,
        "untie_embeddings_and_output_weights": True, "position_embedding_type": "rope",
        "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 2816, "moe_layer_freq": 1}


def _plan(model=None, gpus=1, impl=None, par=None) -> Plan:
    return Plan(model=model or MOE8, cluster={"gpu": "h100-sxm", "num_gpus": gpus},
                training={"seq_length": 2048, "global_batch_size": 32, "micro_batch_size": 4},
                parallelism=par or {}, implementation={"moe_grouped_gemm": True, **(impl or {})})


def _ctx(plan: Plan):
    shape = resolve_model(plan.model)
    c = stm._context(LayoutBatch.from_plan(plan, shape), stm.hardware_params(plan.cluster), False)
    return c, stm._dense_layer(c)


def test_permute_moves_each_routed_token_row_in_and_out_twice():
    c, _ = _ctx(_plan())
    t_sp, k, h = 4 * 2048, 2, 1024
    expected = 2 * 2 * t_sp * k * h * 2.0 / c.bw_ew  # read + write, permute + unpermute, bf16
    assert float(moe.permute(c, stm._moe_kit())["ew_f"][0]) == pytest.approx(expected, rel=1e-12)


def test_the_aux_loss_adds_its_score_bytes_to_the_router():
    kit = stm._moe_kit()
    plain = moe.router(_ctx(_plan())[0], kit)
    aux = moe.router(_ctx(_plan({**MOE8, "moe_aux_loss_coeff": 1e-2}))[0], kit)
    ratio = (moe.ROUTER_BYTES_PER_SCORE + moe.AUX_LOSS_BYTES_PER_SCORE) / moe.ROUTER_BYTES_PER_SCORE
    assert float(aux["ew_f"][0] / plain["ew_f"][0]) == pytest.approx(ratio)
    assert aux["kernels"] == (13.0, 26.0)  # 9 + 4 forward, 18 + 8 backward


def test_host_launches_of_a_te_grouped_moe_layer_counted_part_by_part():
    c, L = _ctx(_plan())
    kf, kb = moe.host_kernels(c, L, moe.moe_parts(c, stm._moe_kit()))
    # attention half of the dense layer's launches (forward 4 GEMMs + 2 attention + 10 others = 16; backward
    # 8 GEMMs + 4 attention + 22 others = 34, wgrad fusion on: no separate adds), router 9/18, unfused
    # permute 12/24, 8 local experts x (0, 6) through TE's GroupedLinear
    assert float(kf[0]) == pytest.approx(0.5 * 16 + 9 + 12)
    assert float(kb[0]) == pytest.approx(0.5 * 34 + 18 + 24 + 8 * 6)


def test_cuda_graphs_of_router_and_preprocess_replace_their_launches_by_one_each():
    graphs = {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["moe_router", "moe_preprocess"]}
    c, L = _ctx(_plan(impl=graphs))
    kf, kb = moe.host_kernels(c, L, moe.moe_parts(c, stm._moe_kit()))
    assert float(kf[0]) == pytest.approx(0.5 * 16 + 1 + 1)
    assert float(kb[0]) == pytest.approx(0.5 * 34 + 1 + 1 + 8 * 6)


def test_graphs_shorten_a_host_bound_moe_step_and_leave_gpu_work_alone():
    eager = step_time(_plan())
    graphed = step_time(_plan(impl={"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["attn", "moe_router",
                                                                                                    "moe_preprocess"]}))
    assert eager.host_bound and graphed.iteration_time_s < 0.8 * eager.iteration_time_s
    assert graphed.breakdown.gemm_s == pytest.approx(eager.breakdown.gemm_s)


def test_no_dispatch_time_without_expert_parallelism_and_allgather_sends_every_token():
    kit = stm._moe_kit()
    assert float(moe.dispatch_s(_ctx(_plan())[0], kit)[0]) == 0.0
    par = {"expert_model_parallel_size": 8}
    a2a = moe.dispatch_s(_ctx(_plan(gpus=8, par=par))[0], kit)
    ag = moe.dispatch_s(_ctx(_plan(gpus=8, par=par, impl={"moe_token_dispatcher_type": "allgather"}))[0], kit)
    c = _ctx(_plan(gpus=8, par=par))[0]
    ramp_half = stm.COLLECTIVE_HALF_BANDWIDTH_BYTES

    def nvlink_s(nbytes):  # 7 of 8 shares leave the GPU over NVLink, at the size ramp, + latency
        return nbytes * 7 / 8 / c.nv * (nbytes + ramp_half) / nbytes + stm.COLLECTIVE_LATENCY_S + 3 * stm.NVLINK_HOP_LATENCY_S
    assert float(a2a[0]) == pytest.approx(nvlink_s(8192 * 2 * 1024 * 2.0))  # T x top-2 rows of h bf16
    assert float(ag[0]) == pytest.approx(nvlink_s(8192 * 1024 * 2.0 * 8))  # every token to all 8 ranks


def test_grouped_experts_run_at_the_probed_fraction_of_the_gemm_model():
    c, _ = _ctx(_plan())
    ex = moe.experts(c, stm._moe_kit())
    h, fe, local = 1024.0, 2816.0, 8.0
    m_e = 4 * 2048 * 2 / local
    rate = c.rate * moe.GROUPED_GEMM_RELATIVE_RATE
    fc1 = stm._linear_s(m_e, 2 * fe, h, rate, c.bw, 132.0, local)
    fc2 = stm._linear_s(m_e, h, fe, rate, c.bw, 132.0, local)
    assert float(ex["gemm_f"][0]) == pytest.approx(float(fc1[0] + fc2[0]))


def test_each_moe_prediction_names_its_dominant_part():
    e = step_time(_plan())
    assert e.moe_dominant_part == max(e.moe_layer_parts_s, key=e.moe_layer_parts_s.get)
    assert any(a.startswith("MoE layer per micro-batch") and e.moe_dominant_part in a for a in e.assumptions)
    dense = step_time(with_changes(_plan({**MOE8, "num_experts": None, "moe_router_topk": None, "moe_ffn_hidden_size": None,
                                          "moe_layer_freq": None}), "implementation", moe_grouped_gemm=False))
    assert dense.moe_dominant_part is None and dense.moe_layer_parts_s is None


def test_dominant_part_reports_the_largest_share():
    assert moe.dominant_part({"experts": 3.0, "dispatch": 1.0}) == ("experts", pytest.approx(0.75))
