"""physics.moe: token drop padded to capacity, the combined 1F1B all-to-all overlap, FP8 current scaling's
per-expert host launches, and the forward/backward host race the dispatcher's sync imposes (issue 15)."""

from __future__ import annotations

import numpy as np
import pytest

from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics import moe
from mcore_advisor.physics import step_time as stm
from mcore_advisor.physics.layouts import LayoutBatch
from mcore_advisor.physics.step_time import step_time
from mcore_advisor.schemas import Plan

# a Qwen3-30B-A3B EP8 rank's MoE block on 2 GPUs (benchmarks/gpu/configs_multi.py Q30_RANK): 32 experts top-8, EP2
Q30_RANK = {"num_layers": 8, "hidden_size": 2048, "num_attention_heads": 32, "num_query_groups": 4, "ffn_hidden_size": 6144,
            "vocab_size": 32000, "swiglu": True, "normalization": "RMSNorm", "add_bias_linear": False,
            "untie_embeddings_and_output_weights": True, "position_embedding_type": "rope", "qk_layernorm": True,
            "num_experts": 32, "moe_router_topk": 8, "moe_ffn_hidden_size": 768, "moe_layer_freq": 1}
BASE = {"moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall", "moe_permute_fusion": True}
FORCED = {**BASE, "moe_router_force_load_balancing": True}
OVERLAP = {**FORCED, "overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True}
DROP = {**BASE, "moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}


def _plan(impl: dict, host: float | None = 0.0, mbs: int = 4, train: dict | None = None) -> Plan:
    return Plan(model=Q30_RANK, cluster={"gpu": "h200", "num_gpus": 2, "host_floor_ms_per_layer": host},
                training={"seq_length": 4096, "global_batch_size": 16 * mbs, "micro_batch_size": mbs, **(train or {})},
                parallelism={"expert_model_parallel_size": 2}, implementation=impl)


def _ctx(plan: Plan):
    shape = resolve_model(plan.model)
    c = stm._context(LayoutBatch.from_plan(plan, shape), stm.hardware_params(plan.cluster),
                     plan.training.precision == "fp8")
    return c, stm._dense_layer(c)


def _one(x) -> float:
    return float(np.asarray(x).reshape(-1)[0])


def test_overlap_saving_follows_the_schedule_plans_three_phases_by_hand():
    # comm: combine_bwd | dispatch_fwd -> dispatch_bwd | combine_fwd; compute: pre_f | mlp_b -> mlp_w -> mlp_f | pre_b
    p = {"pre_f": 2.0, "pre_b": 4.0, "mlp_f": 3.0, "mlp_b": 5.0, "mlp_w": 2.0}
    # a = 1: every all-to-all hides (phase 2 = max(max(5 + 2, 1) + 3, max(1, 5) + 1) = 10): 20 - (2 + 10 + 4)
    assert moe.ep_overlap_saving(p, 1.0, True) == pytest.approx(4.0)
    # a = 3: 28 alone, max(3, 2) + max(max(7, 3) + 3, max(3, 5) + 3) + max(3, 4) = 17 together
    assert moe.ep_overlap_saving(p, 3.0, True) == pytest.approx(11.0)
    # delaying the weight gradients lets dispatch_bwd start after the data gradients: 13 - 9 against 13 - 10
    q = {"pre_f": 0.0, "pre_b": 0.0, "mlp_f": 1.0, "mlp_b": 1.0, "mlp_w": 3.0}
    assert moe.ep_overlap_saving(q, 2.0, True) == pytest.approx(4.0)
    assert moe.ep_overlap_saving(q, 2.0, False) == pytest.approx(3.0)
    assert moe.ep_overlap_saving(q, 0.0, True) == pytest.approx(0.0)  # nothing to hide without EP traffic


def test_overlap_share_leaves_out_the_warm_up_and_cool_down():
    c, _ = _ctx(_plan(OVERLAP))  # PP 1, 16 samples x 4 of 2 ranks: 8 micro-batches
    assert _one(c.m) == 8 and _one(moe.combined_1f1b_share(c)) == pytest.approx(7 / 8)
    pp = Plan(model={**Q30_RANK, "num_layers": 16}, cluster={"gpu": "h200", "num_gpus": 8},
              training={"seq_length": 4096, "global_batch_size": 32, "micro_batch_size": 1},
              parallelism={"pipeline_model_parallel_size": 4, "virtual_pipeline_model_parallel_size": 2,
                           "expert_model_parallel_size": 2}, implementation=OVERLAP)
    c, _ = _ctx(pp)  # DP 2: 16 micro-batches x 2 chunks, warm-up 2 (4 - 1) + (2 - 1) 4 = 10 chunks
    assert _one(moe.combined_1f1b_share(c)) == pytest.approx(22 / 32)


def test_overlap_hides_the_all_to_alls_under_the_other_direction():
    plain, over = step_time(_plan(FORCED)).breakdown, step_time(_plan(OVERLAP)).breakdown
    assert plain.ep_comm_s > 0.1
    # 7 of 8 micro-batches hide their all-to-alls but for the SM share (OVERLAP_SM_TAX) the hidden ones still cost
    hidden = 7 / 8 * plain.ep_comm_s
    assert over.ep_comm_s == pytest.approx(plain.ep_comm_s - (1 - stm.OVERLAP_SM_TAX) * hidden, rel=0.02)
    assert over.gemm_s == pytest.approx(plain.gemm_s)


def test_padding_to_capacity_fixes_the_expert_rows_and_drops_the_sync():
    c, _ = _ctx(_plan(DROP))
    # capacity = ceil(16,384 x 8 / 32 x 1.0) = 4,096 rows from each of 2 ranks for each of 16 local experts
    t_exp, m_e, local = moe.tokens_per_expert(c)
    assert _one(local) == 16 and _one(m_e) == pytest.approx(8192.0)
    assert moe.host_syncs_per_layer(c.impl) == 0.0
    assert _one(moe.experts(c, stm._moe_kit())["miss_share"]) == 0.0  # one row count: always cached
    forced, _ = _ctx(_plan(FORCED))
    assert moe.host_syncs_per_layer(forced.impl) == 1.0
    # capacity 1.25 padded: every expert computes a quarter more rows than the balanced share
    c125, _ = _ctx(_plan({**DROP, "moe_expert_capacity_factor": 1.25}))
    assert _one(moe.tokens_per_expert(c125)[1]) == pytest.approx(1.25 * 8192.0)
    assert moe.capacity_capped(np.array([1.4, 0.9]), 1.2, False).tolist() == pytest.approx([1.2, 0.9])


def test_fp8_adds_per_expert_host_launches_current_scaling_more():
    c, _ = _ctx(_plan(FORCED, train={"precision": "fp8", "fp8_recipe": "tensorwise"}))
    d, _ = _ctx(_plan(FORCED, train={"precision": "fp8", "fp8_recipe": "delayed"}))
    b, _ = _ctx(_plan(FORCED))
    kit = stm._moe_kit()

    def extra(ctx, i):
        return _one(moe.experts(ctx, kit)["kernels"][i] - moe.experts(b, kit)["kernels"][i])

    q_f, q_b = moe.FP8_PER_EXPERT_HOST_KERNELS  # every recipe casts each expert's inputs on their own
    cs_f, cs_b = moe.FP8_CURRENT_SCALING_PER_EXPERT_HOST_KERNELS
    pad_f, pad_b = moe.FP8_EXPERT_PADDING_HOST_KERNELS  # every dropless FP8 recipe pads each expert's rows
    assert extra(d, 0) == pytest.approx(16 * q_f + pad_f) and extra(d, 1) == pytest.approx(16 * q_b + pad_b)
    assert extra(c, 0) == pytest.approx(16 * (q_f + cs_f) + pad_f) and extra(c, 1) == pytest.approx(16 * (q_b + cs_b) + pad_b)
    # padded to capacity, the rows are already aligned: TEGroupedMLP skips the FP8 padding, not the casts
    p8, _ = _ctx(_plan(DROP, train={"precision": "fp8", "fp8_recipe": "delayed"}))
    pb, _ = _ctx(_plan(DROP))
    assert _one(moe.experts(p8, kit)["kernels"][0]) == pytest.approx(_one(moe.experts(pb, kit)["kernels"][0]) + 16 * q_f)


def test_the_sync_keeps_forward_host_time_out_of_the_backward_slack():
    # on a host of 5 ms a reference layer the 16-expert forward is host-bound and the backward is not:
    # with the dispatcher's sync the forward's excess stays; padded (no sync) the backward's slack absorbs it
    host = 5.0
    dropless = step_time(_plan(FORCED, host=host)).breakdown.host_bound_s
    c, L = _ctx(_plan(FORCED, host=host))
    lay = moe.moe_layer(c, L, stm._moe_kit())
    h_f, h_b = _one(c.host_f * lay["kernels_f"]), _one(c.host_b * lay["kernels_b"])
    g_f = _one(lay["gemm_f"] + lay["attn_f"] + lay["ew_f"] + lay["ep_f"])
    g_b = _one(lay["gemm_b"] + lay["attn_b"] + lay["ew_b"] + lay["ep_b"])
    assert h_f > g_f and h_b < g_b and h_f + h_b < g_f + g_b
    # 8 layers x 8 micro-batches of the forward excess, at least
    assert dropless >= 64 * (h_f - g_f) * 0.99



def test_the_overlap_pays_off_only_where_the_host_keeps_up():
    # a VM host: the combined schedule's own launches (COMBINED_1F1B_HOST_KERNELS) cost about what hiding the
    # all-to-alls saves (E rows on 2 x H200: 1.84-1.98 s overlapped against 1.80-1.89 s); a bare-metal host gains
    vm = [step_time(_plan(x, host=5.0)).iteration_time_s for x in (FORCED, OVERLAP)]
    assert vm[1] == pytest.approx(vm[0], rel=0.15)
    metal = [step_time(_plan(x, host=1.0)).iteration_time_s for x in (FORCED, OVERLAP)]
    assert metal[1] < 0.97 * metal[0]


def test_the_estimate_says_how_drop_and_overlap_were_timed():
    said = " ".join(step_time(_plan(DROP)).assumptions)
    assert "capacity factor 1, padded to capacity: fixed expert rows, no dispatcher sync" in said
    assert "all-to-alls not overlapped" in said and "permute fused (TE)" in said
    said = " ".join(step_time(_plan(OVERLAP)).assumptions)
    assert "dropless" in said and "combined 1F1B schedule hides each all-to-all" in said
