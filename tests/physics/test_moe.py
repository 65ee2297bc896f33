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
                parallelism=par or {},
                # forced-balance routing unless a test says otherwise: the hand counts below assume no
                # heuristics-cache misses and an even load (both tested on their own)
                implementation={"moe_grouped_gemm": True, "moe_router_force_load_balancing": True, **(impl or {})})


def _ctx(plan: Plan):
    shape = resolve_model(plan.model)
    c = stm._context(LayoutBatch.from_plan(plan, shape), stm.hardware_params(plan.cluster), False)
    return c, stm._dense_layer(c)


def test_permute_moves_each_routed_token_row_in_and_out_twice_and_adds_it_back_at_the_index_add_rate():
    c, _ = _ctx(_plan())
    t_sp, k, h = 4 * 2048, 2, 1024
    rows = t_sp * k * h * 2.0  # one pass over the routed bf16 rows
    # the alltoall dispatcher's sort by local expert (8 local experts): 2 sorts, read + write each
    sort = 2 * 2 * t_sp * k * h * 2.0
    p = moe.permute(c, stm._moe_kit())
    assert float(p["ew_f"][0]) == pytest.approx((4 * rows + sort) / c.bw_ew, rel=1e-12)
    # backward: the unpermute's gradient gathered (read + write), the permute's added back by index_add_
    expected_b = (4 * rows + 2 * rows + sort) / c.bw_ew + rows / moe.INDEX_ADD_BYTES_PER_S
    assert float(p["ew_b"][0]) == pytest.approx(expected_b, rel=1e-12)
    ag, _ = _ctx(_plan(impl={"moe_token_dispatcher_type": "allgather"}))  # no sort by local expert
    assert float(moe.permute(ag, stm._moe_kit())["ew_f"][0]) == pytest.approx(4 * rows / ag.bw_ew, rel=1e-12)


def test_the_aux_loss_adds_its_score_bytes_to_the_router():
    kit = stm._moe_kit()
    plain = moe.router(_ctx(_plan())[0], kit)
    aux = moe.router(_ctx(_plan({**MOE8, "moe_aux_loss_coeff": 1e-2}))[0], kit)
    ratio = (moe.ROUTER_BYTES_PER_SCORE + moe.AUX_LOSS_BYTES_PER_SCORE) / moe.ROUTER_BYTES_PER_SCORE
    assert float(aux["ew_f"][0] / plain["ew_f"][0]) == pytest.approx(ratio)
    assert aux["kernels"] == (pytest.approx(7.3), pytest.approx(16.0))  # router 3.3 + 4 forward, 8 + 8 backward


# Host launches of the one-GPU MoE8 layer (TE, bf16, EP 1, 8 local experts, no shared expert), by hand:
# the dense layer launches 16 forward (4 GEMMs + 2 attention + 10 others) and 34 backward (8 GEMMs + 4
# attention + 22 others; wgrad fusion on, no separate adds); the MoE layer keeps 73% / 59% of them plus the
# pre-MLP norm's 1.7 / 3.3.
ATTN_PART = (0.73 * 16 + 1.7, 0.59 * 34 + 3.3)
PER_F, PER_B = moe.PER_EXPERT_HOST_KERNELS[True]  # the C_qwen30like trace's per-expert share (s9)
EXPERTS_8 = (9.3 + 8 * PER_F, 23.5 + 8 * PER_B)  # two GroupedLinear calls + activation, then per local expert


def test_host_launches_of_a_te_grouped_moe_layer_counted_part_by_part():
    # forced-balance routing: every expert's token count stays within cuBLASLt's heuristics cache
    c, L = _ctx(_plan(impl={"moe_router_force_load_balancing": True}))
    assert (float(L.dense["kernels_f"][0]), float(L.dense["kernels_b"][0])) == (16.0, 34.0)
    kf, kb = moe.host_kernels(c, L, moe.moe_parts(c, stm._moe_kit()))
    # attention part, router 3.3 / 8, unfused permute 5 / 6, the alltoall dispatcher's always-made work
    # 5.1 / 12.9 (no EP peers: no collectives), the grouped experts
    assert float(kf[0]) == pytest.approx(ATTN_PART[0] + 3.3 + 5.0 + 5.1 + EXPERTS_8[0])
    assert float(kb[0]) == pytest.approx(ATTN_PART[1] + 8.0 + 6.0 + 12.9 + EXPERTS_8[1])


def test_dispatcher_collectives_cost_host_time_only_with_expert_parallel_peers():
    kit, par = stm._moe_kit(), {"expert_model_parallel_size": 8}
    forced = {"moe_router_force_load_balancing": True}  # no heuristics-cache misses (test_heuristic_*)
    c1, L1 = _ctx(_plan(impl=forced))
    c8, L8 = _ctx(_plan(gpus=8, par=par, impl=forced))
    one = moe.host_kernels(c1, L1, moe.moe_parts(c1, kit))
    eight = moe.host_kernels(c8, L8, moe.moe_parts(c8, kit))
    # EP 8: one local expert instead of 8 (7 fewer per-expert shares), plus the all-to-alls, the counts'
    # all-gather and the split bookkeeping (8.9 forward, 9.1 backward)
    assert float(eight[0][0] - one[0][0]) == pytest.approx(8.9 - 7 * PER_F)
    assert float(eight[1][0] - one[1][0]) == pytest.approx(9.1 - 7 * PER_B)


def test_a_shared_expert_launches_what_a_dense_mlp_does():
    kit = stm._moe_kit()
    c, L = _ctx(_plan())
    cs, Ls = _ctx(_plan({**MOE8, "moe_shared_expert_intermediate_size": 2816}))
    plain = moe.host_kernels(c, L, moe.moe_parts(c, kit))
    shared = moe.host_kernels(cs, Ls, moe.moe_parts(cs, kit))
    assert float(shared[0][0] - plain[0][0]) == pytest.approx(0.27 * 16)
    assert float(shared[1][0] - plain[1][0]) == pytest.approx(0.41 * 34)


def test_cuda_graphs_of_router_and_preprocess_replace_their_launches_by_one_each():
    graphs = {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["moe_router", "moe_preprocess"]}
    c, L = _ctx(_plan(impl=graphs))
    kf, kb = moe.host_kernels(c, L, moe.moe_parts(c, stm._moe_kit()))
    assert float(kf[0]) == pytest.approx(ATTN_PART[0] + 1 + 1 + EXPERTS_8[0])
    assert float(kb[0]) == pytest.approx(ATTN_PART[1] + 1 + 1 + EXPERTS_8[1])


@pytest.mark.parametrize(("dispatcher", "graphs", "syncs"), [
    ("alltoall", {}, 1.0), ("allgather", {}, 2.0), ("flex", {}, 1.0),
    ("alltoall", {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["moe_router", "moe_preprocess"]}, 1.0),
    ("alltoall", {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["attn", "moe"]}, 0.0),
])
def test_host_syncs_per_moe_layer_follow_the_dispatcher(dispatcher, graphs, syncs):
    c, _ = _ctx(_plan(impl={"moe_token_dispatcher_type": dispatcher, **graphs}))
    assert moe.host_syncs_per_layer(c.impl) == syncs


def test_the_launches_after_the_dispatcher_sync_cannot_hide_behind_earlier_work():
    par = {"expert_model_parallel_size": 8}
    c, L = _ctx(_plan(gpus=8, par=par))
    parts = moe.moe_parts(c, stm._moe_kit())
    # half of the always-made dispatcher work and permute (5.1 + 5), the collectives 8.9, one local
    # expert's grouped GEMMs 9.3 + its per-expert share
    post = 0.5 * (5.1 + 5.0) + 8.9 + 9.3 + PER_F
    assert float(moe.post_sync_kernels_f(c, parts)[0]) == pytest.approx(post)
    lay = moe.moe_layer(c, L, stm._moe_kit())
    ex, pm = parts["experts"], parts["permute"]
    gpu_post = ex["gemm_f"] + ex["ew_f"] + pm["ew_f"] + parts["dispatch"]["f"]
    expected = max(0.0, float((c.host_f * post - gpu_post)[0]))
    assert c.host_f > 0 and float(lay["sync_wait_f"][0]) == pytest.approx(expected)
    assert float(lay["moe_parts"]["host_wait"][0]) >= expected
    # without a host floor (a host that never binds) nothing waits
    cf, Lf = _ctx(with_changes(_plan(gpus=8, par=par), "cluster", host_floor_ms_per_layer=0))
    assert float(moe.moe_layer(cf, Lf, stm._moe_kit())["sync_wait_f"][0]) == 0.0


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
    # measured routing exactly balanced (routing_imbalance's own noise is tested below)
    a2a = moe.dispatch_s(_ctx(_plan(gpus=8, par=par, impl={"moe_routing_imbalance": 1.0}))[0], kit)
    ag = moe.dispatch_s(_ctx(_plan(gpus=8, par=par, impl={"moe_token_dispatcher_type": "allgather"}))[0], kit)
    c = _ctx(_plan(gpus=8, par=par))[0]
    ramp_half = stm.COLLECTIVE_HALF_BANDWIDTH_BYTES

    def nvlink_s(nbytes):  # 7 of 8 shares leave the GPU over NVLink, at the size ramp, + latency
        return nbytes * 7 / 8 / c.nv * (nbytes + ramp_half) / nbytes + stm.COLLECTIVE_LATENCY_S + 3 * stm.NVLINK_HOP_LATENCY_S
    assert float(a2a[0]) == pytest.approx(nvlink_s(8192 * 2 * 1024 * 2.0))  # T x top-2 rows of h bf16
    assert float(ag[0]) == pytest.approx(nvlink_s(8192 * 1024 * 2.0 * 8))  # every token to all 8 ranks


def test_routing_imbalance_forced_balance_is_sampling_noise_and_a_measured_figure_wins(monkeypatch):
    par = {"expert_model_parallel_size": 8}
    forced = _ctx(_plan(gpus=8, par=par, impl={"moe_router_force_load_balancing": True}))[0]
    # 8,192 tokens x top-2 x 8 EP ranks = 131,072 choices: a rank's share has cv sqrt(7/8 * 8 / 131072);
    # the busiest of 8 lies Blom's E[max of 8 normals] = inv_cdf(7.625 / 8.25) = 1.4342 spreads above
    assert float(moe.routing_imbalance(forced)[0]) == pytest.approx(1 + 1.43420 * (7 / 8 * 8 / 131072) ** 0.5, rel=1e-4)
    measured = _ctx(_plan(gpus=8, par=par, impl={"moe_routing_imbalance": 1.7}))[0]
    assert float(moe.routing_imbalance(measured)[0]) == 1.7
    assert float(moe.routing_imbalance(_ctx(_plan(impl={"moe_routing_imbalance": 1.7}))[0])[0]) == 1.0  # no EP peers
    monkeypatch.setattr(moe, "UNTRAINED_EXPERT_LOAD_CV", 0.5)
    free = _ctx(_plan(gpus=8, par=par, impl={"moe_router_force_load_balancing": False}))[0]
    # 8 experts on 8 ranks: one expert each, cv 0.5 (x sqrt(7/7)), sampling noise beside it
    expect = 1 + 1.43420 * (0.5 ** 2 + 7 / 8 * 8 / 131072) ** 0.5
    assert float(moe.routing_imbalance(free)[0]) == pytest.approx(expect, rel=1e-4)
    assert float(moe.routing_imbalance(forced)[0]) < 1.02  # forcing removes the router's spread


def test_the_busiest_rank_sets_expert_time_and_dispatch_bytes():
    kit = stm._moe_kit()
    par = {"expert_model_parallel_size": 8}
    one = _ctx(_plan(gpus=8, par=par, impl={"moe_routing_imbalance": 1.0}))[0]
    two = _ctx(_plan(gpus=8, par=par, impl={"moe_routing_imbalance": 2.0}))[0]
    assert float(moe.tokens_per_expert(two)[0][0]) == pytest.approx(2 * float(moe.tokens_per_expert(one)[0][0]))
    assert float(moe.experts(two, kit)["gemm_f"][0]) > 1.8 * float(moe.experts(one, kit)["gemm_f"][0])
    assert float(moe.dispatch_s(two, kit)[0]) > 1.8 * float(moe.dispatch_s(one, kit)[0]) - 1e-4


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


def test_te_fused_permute_moves_each_token_once_and_its_copies_once_and_launches_once_per_direction():
    c, _ = _ctx(_plan(impl={"moe_permute_fusion": True}))
    t_sp, k, h = 4 * 2048, 2, 1024
    rows, sort = t_sp * k * h * 2.0, 2 * 2 * t_sp * k * h * 2.0
    # permute: read T tokens, write T*k rows; unpermute: read T*k rows, write T tokens (hand count)
    one_way = 2 * (t_sp * h * 2.0 + rows)
    p = moe.permute(c, stm._moe_kit())
    assert float(p["ew_f"][0]) == pytest.approx((one_way + sort) / c.bw_ew, rel=1e-12)
    # backward: the same kernels the other way round + the probabilities' gradient reads the rows once
    assert float(p["ew_b"][0]) == pytest.approx((one_way + rows + sort) / c.bw_ew, rel=1e-12)
    unfused, _ = _ctx(_plan())
    assert float(moe.permute(unfused, stm._moe_kit())["ew_b"][0]) > 2 * float(p["ew_b"][0])
    assert p["kernels"] == moe.PERMUTE_HOST_KERNELS[True]
    local, _ = _ctx(_plan(impl={"moe_permute_fusion": True, "transformer_impl": "local"}))
    assert local.impl.moe_permute_fused is False  # TE's kernels: the local spec cannot fuse


# ---- cuBLASLt's heuristics cache -------------------------------------------------------------------------

def test_heuristic_misses_need_more_row_counts_than_the_cache_holds():
    # forced routing: 2,048 rows per expert +- sqrt(2048): some 500 counts, under 8192 / 6 = 1365 -> every one cached
    assert float(moe.heuristic_miss_share(2048.0, 0.0)) == 0.0
    # no cache: every GEMM asks the heuristic
    assert float(moe.heuristic_miss_share(2048.0, 0.24, capacity_keys=0)) == 1.0
    # 64 experts as an untrained router sends them (cv 0.24, s9's C rows): thousands of counts thrash 8192
    # problems, and 65536 (10,922 counts) holds them
    uneven = float(moe.heuristic_miss_share(2048.0, 0.24))
    assert 0.1 < uneven < 0.6
    assert float(moe.heuristic_miss_share(2048.0, 0.24, capacity_keys=65536)) == 0.0
    # a wider spread misses more
    assert float(moe.heuristic_miss_share(2048.0, 0.5)) > uneven


def test_che_approximation_on_an_even_spread_misses_one_minus_capacity_over_counts():
    # uniform over N counts with an LRU of C: sum_i (1 - exp(-T/N)) = C -> miss = exp(-T/N) = 1 - C/N
    import numpy as np

    assert moe.che_miss_share(np.full(4000, 1 / 4000), 1.0, 1000) == pytest.approx(1 - 1000 / 4000, rel=1e-6)
    # the same law in 400 bins of 10 counts each
    assert moe.che_miss_share(np.full(400, 1 / 4000), 10.0, 1000) == pytest.approx(1 - 1000 / 4000, rel=1e-6)
    assert moe.che_miss_share(np.full(400, 1 / 4000), 10.0, 4000) == 0.0  # every count fits


def test_a_measured_miss_share_or_cache_size_changes_the_expert_host_launches_by_the_query_cost():
    kit = stm._moe_kit()
    even, _ = _ctx(_plan(impl={"moe_heuristic_miss_share": 0.0}))
    all_miss, _ = _ctx(_plan(impl={"moe_heuristic_miss_share": 1.0}))
    k0, k1 = moe.experts(even, kit)["kernels"], moe.experts(all_miss, kit)["kernels"]
    q_f, q_b = stm._ref_units()
    # 8 local experts x (2 forward GEMMs, 2 dgrads: a new row count is the wgrads' K, which asks no query; the s10
    # shape probe) x HEURISTIC_QUERY_REF_LAYERS reference layers each
    assert float((k1[0] - k0[0])[0]) == pytest.approx(8 * 2 * moe.HEURISTIC_QUERY_REF_LAYERS * q_f)
    assert float((k1[1] - k0[1])[0]) == pytest.approx(8 * 2 * moe.HEURISTIC_QUERY_REF_LAYERS * q_b)
    # q_f forward units (or q_b backward units) cost the host one reference layer: the host floor
    floor = stm.hardware_params(_plan().cluster).host_floor_s_per_layer
    assert even.host_f * q_f == pytest.approx(floor) and even.host_b * q_b == pytest.approx(floor)
    # a step with no cache (every expert GEMM misses) is slower than the default, which is no faster than 65536
    uneven = {"moe_router_force_load_balancing": False}
    t = [step_time(_plan(impl={**uneven, "cublaslt_heuristics_cache_capacity": cap})).iteration_time_s for cap in (0, None, 65536)]
    assert t[0] > t[1] >= t[2]


def test_a_miss_costs_the_torch_query_where_megatrons_own_linears_issue_the_expert_gemms():
    # the local spec's SequentialMLP runs torch's aten::mm through cuBLAS: 0.31 ms a new shape in the s10 traces,
    # against Transformer Engine's 0.135 ms; the launches without a miss are the SequentialMLP's either way
    kit = stm._moe_kit()
    q_f, q_b = stm._ref_units()
    local = {"transformer_impl": "local"}
    even, _ = _ctx(_plan(impl={**local, "moe_heuristic_miss_share": 0.0}))
    all_miss, _ = _ctx(_plan(impl={**local, "moe_heuristic_miss_share": 1.0}))
    k0, k1 = moe.experts(even, kit)["kernels"], moe.experts(all_miss, kit)["kernels"]
    assert float((k1[0] - k0[0])[0]) == pytest.approx(8 * 2 * moe.HEURISTIC_QUERY_TORCH_REF_LAYERS * q_f)
    assert float((k1[1] - k0[1])[0]) == pytest.approx(8 * 2 * moe.HEURISTIC_QUERY_TORCH_REF_LAYERS * q_b)
    assert moe.HEURISTIC_QUERY_TORCH_REF_LAYERS * 5.5 == pytest.approx(0.31, abs=0.005)  # ms at the catalog's host
    te_miss, _ = _ctx(_plan(impl={"moe_heuristic_miss_share": 1.0, "moe_grouped_gemm": False}))
    te_even, _ = _ctx(_plan(impl={"moe_heuristic_miss_share": 0.0, "moe_grouped_gemm": False}))
    te_gap = float((moe.experts(te_miss, kit)["kernels"][0] - moe.experts(te_even, kit)["kernels"][0])[0])
    assert te_gap == pytest.approx(8 * 2 * moe.HEURISTIC_QUERY_REF_LAYERS * q_f)


def test_forward_misses_stall_the_gpu_where_a_query_outlasts_one_experts_gemm():
    # TE's grouped GEMM asks the heuristic for each expert right before launching its GEMM, after the
    # dispatcher's sync: the GPU idles for whatever part of a query the previous expert's GEMM does not cover
    kit = stm._moe_kit()
    c, _ = _ctx(_plan(impl={"moe_heuristic_miss_share": 1.0}))
    ex = moe.experts(c, kit)
    query = moe.HEURISTIC_QUERY_REF_LAYERS * stm.hardware_params(_plan().cluster).host_floor_s_per_layer
    per_gemm = float(ex["gemm_f"][0]) / (2 * 8)  # 8 local experts, fc1 and fc2
    assert float(ex["miss_wait_f"][0]) == pytest.approx(2 * 8 * max(0.0, query - per_gemm), rel=1e-9)
    none, _ = _ctx(_plan(impl={"moe_heuristic_miss_share": 0.0}))
    assert float(moe.experts(none, kit)["miss_wait_f"][0]) == 0.0


def test_evaluate_warns_when_uneven_fine_grained_experts_thrash_the_cublaslt_cache():
    from mcore_advisor.physics.evaluate import evaluate_plan

    # the C rows' 64-expert model (hidden 2048, top-8, 1,408 wide) on EP4, routed as an untrained router does
    e64 = {**MOE8, "num_layers": 8, "hidden_size": 2048, "num_attention_heads": 16, "num_query_groups": 4,
           "ffn_hidden_size": 5632, "num_experts": 64, "moe_router_topk": 8, "moe_ffn_hidden_size": 1408}
    plan = Plan(model=e64, cluster={"gpu": "h100-sxm", "num_gpus": 4},
                training={"seq_length": 4096, "global_batch_size": 32, "micro_batch_size": 4},
                parallelism={"expert_model_parallel_size": 4}, implementation={"moe_grouped_gemm": True})
    ev = evaluate_plan(plan)
    share = ev.performance.moe_expert_gemm_miss_share
    assert share == pytest.approx(float(moe.heuristic_miss_share(16384 * 8 * 4 / 64, moe.UNTRAINED_EXPERT_LOAD_CV)), rel=0.05)
    found = [f for f in ev.findings if f.code == "expert_gemm_cache_thrash"]
    assert found and found[0].fields == ["implementation.cublaslt_heuristics_cache_capacity"]
    for fix in ({"moe_router_force_load_balancing": True}, {"cublaslt_heuristics_cache_capacity": 65536}):
        fixed = evaluate_plan(with_changes(plan, "implementation", **fix))
        assert not [f for f in fixed.findings if f.code == "expert_gemm_cache_thrash"]
    assert evaluate_plan(_plan()).performance.moe_expert_gemm_miss_share == 0.0  # forced routing, 8 experts


def test_query_and_key_norms_are_two_norm_modules_in_every_layer_that_the_host_issues_whole():
    """--qk-layernorm (Qwen3): TE's spec makes q_layernorm and k_layernorm norm modules of their own, each issued
    like the MoE layer's pre-MLP norm (moe.NORM_OP_HOST_KERNELS), and a pass over each head's q and k."""
    _, plain = _ctx(_plan())
    cq, qk = _ctx(_plan({**MOE8, "qk_layernorm": True}))
    two_f, two_b = 2 * moe.NORM_OP_HOST_KERNELS[0], 2 * moe.NORM_OP_HOST_KERNELS[1]
    assert float((qk.dense["kernels_f"] - plain.dense["kernels_f"])[0]) == pytest.approx(two_f)
    assert float((qk.dense["kernels_b"] - plain.dense["kernels_b"])[0]) == pytest.approx(two_b)
    # the MoE layer keeps its attention part whole: the norms are not scaled by the dense MLP's host share
    f0, b0 = moe.attention_part_kernels(plain)
    f1, b1 = moe.attention_part_kernels(qk)
    assert (float((f1 - f0)[0]), float((b1 - b0)[0])) == (pytest.approx(two_f), pytest.approx(two_b))
    # GPU: 16 query + 4 key heads of 64 at 4 x 2,048 tokens, read + written in bf16 (4 B an element), and the launches
    extra_bytes = 4 * 2048 * (16 + 4) * 64 * 4
    expected = extra_bytes / cq.bw_ew + two_f * stm.KERNEL_LAUNCH_S
    assert float((qk.ew.ew_f_s - plain.ew.ew_f_s)[0]) == pytest.approx(float(expected), rel=1e-9)
    slower = step_time(_plan({**MOE8, "qk_layernorm": True})).iteration_time_s
    assert slower > step_time(_plan()).iteration_time_s


def test_the_layer_pays_the_heuristic_misses_of_the_ep_rank_that_misses_most():
    # 16 local experts missing with probability 1/4 each: 4 a rank on average, spread sqrt(16 x 1/4 x 3/4) = 1.732;
    # the largest of 4 ranks' counts lies E[max of 4 normals] spreads above (Blom: 1.049; the all-to-all waits for it)
    assert float(moe.busiest_rank_misses(16, 0.25, 1)) == pytest.approx(4.0)
    assert float(moe.busiest_rank_misses(16, 0.25, 4)) == pytest.approx(4.0 + 1.0491 * 3 ** 0.5, rel=1e-4)
    assert float(moe.busiest_rank_misses(16, 0.0, 8)) == 0.0 and float(moe.busiest_rank_misses(16, 1.0, 8)) == 16.0


def test_rare_misses_cost_at_most_every_ep_ranks_misses_together():
    # a miss in a million row counts: the normal's tail would charge 1.42 spreads (sqrt(8e-6)) on 8 ranks; the most
    # any rank can miss is all 8 ranks' misses together
    assert float(moe.busiest_rank_misses(8, 1e-6, 8)) == pytest.approx(8 * 8e-6)
