"""The time of one MoE layer and micro-batch from its parts (issue 15), for physics.step_time.

One function per part of Megatron-Core's MoELayer (megatron/core/transformer/moe/moe_layer.py): the router
(gating GEMM, top-k, the aux-loss scores, the expert bias), the token permute/unpermute (moe_utils.permute,
fused or not), the routed experts (TEGroupedMLP's grouped GEMM at the real per-expert shape, or
SequentialMLP's loop), the shared experts, the dispatcher's communication (alltoall, allgather, flex/DeepEP;
NVLink inside a node, the NICs across nodes), the load on the busiest EP rank, and the kernels the host
launches (CUDA graphs remove the captured parts' launches). `moe_layer` assembles them into the part dict
step_time's layer model reads, and `moe_part_times` / `dominant_part` say where the layer's time goes.

step_time imports this module, so this one takes step_time's primitives as a `MoeKit` instead of importing
them (no import cycle).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mcore_advisor.physics.anatomy import linear_weights

GROUPED_GEMM_RELATIVE_RATE = 0.93
"""Grouped expert GEMMs run at this fraction of the rate the GEMM model gives their per-expert shapes
(whose wave quantization over the output tiles of all local experts already carries the tiny-expert
loss). benchmarks/results/gpu_h200x2_kernel_moe.jsonl (H200, torch 2.11, kind moe_grouped_gemm): the
'torch_grouped_mm' rows over the 'dense_same_tokens' rows (one dense GEMM over the same tokens) at 4 expert
shapes x 4 or 32 local experts x 64-4,096 tokens per expert, divided by what the GEMM model gives the same
pair: geometric mean 1.08 over the 20 rows with >= 4,096 tokens in all (RMS 16%); an extra tokens-per-expert
ramp t/(t + t_half) fits worse for every t_half > 0 (RMS 18% at 64 tokens, 23% at 128). TE GroupedLinear
(a cuBLAS GEMM per expert, what TEGroupedMLP runs) is probed by benchmarks/kernel_probe.py's moe mode on H100."""

ROUTER_BYTES_PER_SCORE = 16.0
"""Router elementwise work per token and expert (fp32 scores): logits cast, softmax/sigmoid, top-k,
the probs scatter and the routing map, forward (backward twice): 4 passes of 4 B. Derived
(moe_utils.topk_routing_with_score_function, unfused)."""

AUX_LOSS_BYTES_PER_SCORE = 12.0
"""--moe-aux-loss-coeff > 0 (aux_loss / seq_aux_loss / global_aux_loss): the router recomputes the scores
for the loss (compute_routing_scores_for_aux_loss: softmax over all experts, read 4 + write 4 B) and sums
them over tokens (read 4 B). Derived."""

ROUTER_HOST_KERNELS = (9.0, 18.0)
PERMUTE_HOST_KERNELS = {False: (12.0, 24.0), True: (2.0, 4.0)}
AUX_LOSS_HOST_KERNELS = (4.0, 8.0)
EXPERT_BIAS_HOST_KERNELS = (2.0, 0.0)
"""Host launches (reference-layer launch units, as step_time counts a dense layer's kernels) of the
router (gating GEMM + routing: 9 forward, twice that backward) and of permute + unpermute (unfused: 12;
TE's fused kernels, --moe-permute-fusion: one per direction). Router + unfused permute = the 21 forward /
42 backward launches the MoE layer carried before it was split into parts (fitted with the host floor on
the one-GPU rows, benchmarks/throughput_accuracy.py --fit). The aux-loss scores and switch loss
(switch_load_balancing_loss_func, MoEAuxLossAutoScaler) and the expert-bias update (the routing bias add
and the tokens-per-expert accumulation of --moe-router-enable-expert-bias) are counted from
moe_utils/router.py. benchmarks/results/gpu_h200x2_kernel_moe.jsonl ('moe_router', H200 host): the
router's forward + backward took 0.7-0.9 ms without the aux loss and 1.2-1.4 ms with it at 4,096-16,384
tokens, independent of size: launch-bound."""

PER_EXPERT_HOST_KERNELS = {True: (0.0, 6.0), False: (3.0, 5.0)}
"""Per local expert: TE's GroupedLinear (moe_grouped_gemm) issues a cuBLAS GEMM per expert from one Python
call (C++ launches, charged like backward kernels: 2 dgrad + 2 wgrad + their main_grad adds, 6 in all);
SequentialMLP runs each expert's MLP module in a Python loop (fc1, activation, fc2 forward; 5 backward)."""

SHARED_EXPERT_HOST_KERNELS = (2.0, 4.0)

GRAPHED_LAUNCHES = 1.0
"""A captured part replays as one graph launch (torch.cuda.CUDAGraph.replay)."""

ROUTING_IMBALANCE = 1.0
"""Tokens on the busiest EP rank over the mean, for real routing. 1.0: the model assumes routing as
balanced as --moe-router-force-load-balancing makes it (the plan has no routing-statistics field). The
2 x H200 traces (benchmarks/results/gpu_h200x2_table.md) put 0.10-1.18 s per step into all-to-all waits on
mock-data runs without an aux loss; that is rank skew (host and routing), not yet separated, so not used."""


@dataclass(frozen=True)
class MoeKit:
    """step_time's primitives and constants the MoE parts use."""

    ring_s: Callable[..., Any]  # ring collective seconds (bytes, n, bw, hop latency, steps)
    ramp: Callable[[Any], Any]  # NCCL size ramp
    wgrad_s: Callable[..., Any]  # weight-gradient accumulation seconds
    local_weights: Callable[..., Any]
    linears: Callable[..., Any]  # GEMM seconds of an anatomy block's linear layers (tokens, TP or ETP, groups, rate)
    kernel_s: float  # KERNEL_LAUNCH_S
    latency_s: float  # COLLECTIVE_LATENCY_S
    nvlink_hop_s: float
    network_hop_s: float


def _aux_loss_on(shape) -> bool:
    kind = shape.moe_router_load_balancing_type or "aux_loss"
    return bool(shape.moe_aux_loss_coeff) and kind in ("aux_loss", "seq_aux_loss", "global_aux_loss")


def router(c, kit: MoeKit) -> dict:
    """Router (TopKRouter): gating GEMM [T_sp, h] x [h, E] + score function and top-k; with an aux loss
    the scores for the switch loss; with the expert bias its update. Seconds and host launches."""
    shape = c.shape
    E, h = float(shape.num_experts), float(shape.hidden_size)
    gemm = c.linear(c.T_sp, E, h)
    per_score = ROUTER_BYTES_PER_SCORE + (AUX_LOSS_BYTES_PER_SCORE if _aux_loss_on(shape) else 0.0)
    kf, kb = ROUTER_HOST_KERNELS
    if _aux_loss_on(shape):
        kf, kb = kf + AUX_LOSS_HOST_KERNELS[0], kb + AUX_LOSS_HOST_KERNELS[1]
    if shape.moe_router_enable_expert_bias:
        kf, kb = kf + EXPERT_BIAS_HOST_KERNELS[0], kb + EXPERT_BIAS_HOST_KERNELS[1]
    ew = c.T_sp * E * per_score / c.bw_ew
    return {"gemm_f": gemm[0], "gemm_b": gemm[1] + gemm[2], "ew_f": ew, "ew_b": 2.0 * ew, "kernels": (kf, kb)}


def permute(c, kit: MoeKit, fused: bool = False) -> dict:
    """Token permute before the experts and unpermute after them (moe_utils.permute / unpermute): each
    reads and writes T_sp * k rows of h bf16 values, forward and backward. `fused` = --moe-permute-fusion
    (TE's kernels; no plan field yet, so Megatron's default, unfused)."""
    k, h = float(c.shape.moe_router_topk), float(c.shape.hidden_size)
    bytes_f = 2 * 2 * c.T_sp * k * h * 2.0
    return {"ew_f": bytes_f / c.bw_ew, "ew_b": 2.0 * bytes_f / c.bw_ew, "kernels": PERMUTE_HOST_KERNELS[fused]}


def tokens_per_expert(c):
    """(tokens through this GPU's local experts, per local expert, local experts): balanced routing
    T*k*etp/tp over E/ep experts, times the busiest EP rank's share (ROUTING_IMBALANCE)."""
    shape = c.shape
    local = float(shape.num_experts) / c.ep
    T_exp = c.T * float(shape.moe_router_topk) * c.etp / c.tp * np.where(c.ep > 1, ROUTING_IMBALANCE, 1.0)
    return T_exp, T_exp / local, local


def experts(c, kit: MoeKit) -> dict:
    """Routed experts at their real per-expert shape: one grouped GEMM over the local experts (wave
    quantization over all of them, GROUPED_GEMM_RELATIVE_RATE) or SequentialMLP's GEMMs one expert after
    another; the activation; the weight-gradient accumulation."""
    shape, impl = c.shape, c.impl
    h, fe = float(shape.hidden_size), float(shape.moe_ffn_hidden_size)
    T_exp, M_e, local = tokens_per_expert(c)
    grouped = impl.moe_grouped_gemm
    rate = c.rate * (GROUPED_GEMM_RELATIVE_RATE if grouped else 1.0)
    groups = local if grouped else 1.0
    lw = linear_weights(shape)["expert"]
    fc1, fc2 = kit.linears(c, lw, M_e, c.etp, groups, rate)
    n = 1.0 if grouped else local  # SequentialMLP: one GEMM per local expert, launched in sequence
    act = T_exp * (3.0 if shape.swiglu else 2.0) * fe / c.etp * 2 / c.bw_ew
    w_exp = local * kit.local_weights(lw, c.etp) + h * float(shape.num_experts)  # routed experts + router
    acc = kit.wgrad_s(w_exp, len(lw) * local + 1.0, impl, c.bw, c.bw_ew)
    per_f, per_b = PER_EXPERT_HOST_KERNELS[bool(grouped)]
    return {"gemm_f": n * (fc1[0] + fc2[0]), "gemm_b": n * (fc1[1] + fc1[2] + fc2[1] + fc2[2]),
            "ew_f": act, "ew_b": 2.0 * act, "acc_b": acc, "T_exp": T_exp, "kernels": (per_f * local, per_b * local)}


def shared_experts(c, kit: MoeKit) -> dict:
    """The shared expert(s): a dense MLP of moe_shared_expert_intermediate_size over every token, split by TP."""
    shape = c.shape
    fsh = float(shape.moe_shared_expert_intermediate_size)
    if fsh <= 0:
        return {"gemm_f": 0.0, "gemm_b": 0.0, "ew_f": 0.0, "ew_b": 0.0, "acc_b": 0.0, "kernels": (0.0, 0.0)}
    lw = linear_weights(shape)["shared_expert"]
    sh1, sh2 = kit.linears(c, lw)
    act = c.T * (3.0 if shape.swiglu else 2.0) * fsh / c.tp * 2 / c.bw_ew
    acc = kit.wgrad_s(kit.local_weights(lw, c.tp), len(lw), c.impl, c.bw, c.bw_ew)
    return {"gemm_f": sh1[0] + sh2[0], "gemm_b": sh1[1] + sh1[2] + sh2[1] + sh2[2], "ew_f": act, "ew_b": 2.0 * act,
            "acc_b": acc, "kernels": SHARED_EXPERT_HOST_KERNELS}


def dispatch_s(c, kit: MoeKit) -> Any:
    """One dispatch (or combine) over EP: alltoall sends T_sp*k token rows (the busiest rank's share),
    allgather every token to every EP rank, flex (DeepEP) each token once per remote node it needs. The
    part inside the node crosses NVLink, the rest the rank's NIC; both run at once (the slower sets it)."""
    shape, ep, gpn = c.shape, c.ep, float(c.hw.gpus_per_node)
    h, k = float(shape.hidden_size), float(shape.moe_router_topk)
    disp = c.T_sp * k * h * 2.0 * np.where(ep > 1, ROUTING_IMBALANCE, 1.0)
    if c.impl.moe_dispatcher == "allgather":
        disp = c.T_sp * h * 2.0 * ep
    ep_span = c.etp * ep
    inside = ep_span <= gpn
    peers_in_node = np.minimum(ep, np.maximum(1.0, np.floor(gpn / c.etp)))
    frac_in = (peers_in_node - 1.0) / np.maximum(ep, 1.0)
    frac_out = np.where(inside, 0.0, (ep - peers_in_node) / ep)
    net_bytes = disp * frac_out
    if c.impl.moe_dispatcher == "flex":
        # with k experts among E spread over N nodes, a given remote node is touched with probability
        # 1 - (1 - 1/N)^k (DeepEP internode dispatch; Megatron's flex dispatcher)
        nodes = np.maximum(1.0, np.ceil(ep_span / gpn))
        touched = (nodes - 1.0) * (1.0 - (1.0 - 1.0 / nodes) ** k)
        net_bytes = np.where(inside, 0.0, c.T_sp * h * 2.0 * touched)
    hop = np.where(inside, kit.nvlink_hop_s, kit.network_hop_s)
    a2a = (np.maximum(disp * (frac_in + frac_out) / c.nv, net_bytes / c.net) / kit.ramp(disp) + kit.latency_s
           + hop * np.log2(np.maximum(ep, 2.0)))
    return np.where(ep > 1, a2a, 0.0)


def host_kernels(c, L, parts: dict) -> tuple:
    """(forward, backward) launches of one MoE layer and micro-batch as the host pays for them: the
    attention half of a dense layer and every MoE part, each captured part (cuda_graph_impl with
    cuda_graph_modules: 'attn', 'moe_router' (router + shared experts), 'moe_preprocess' (the
    permute), 'moe' (the whole MoE block); none listed = the whole layer) replaced by one launch."""
    impl = c.impl
    graphs = impl.cuda_graph_impl
    mods = set(impl.cuda_graph_modules) or {"attn", "moe"}
    if graphs == "full_iteration":
        mods = {"attn", "moe"}
    on = graphs != "none"

    def cost(names: tuple[str, ...], kernels: tuple) -> tuple:
        captured = on and bool(mods & set(names)) and (kernels[0] > 0 or kernels[1] > 0)
        return (GRAPHED_LAUNCHES, GRAPHED_LAUNCHES) if captured else kernels

    attn_half = (0.5 * L.dense["kernels_f"], 0.5 * L.dense["kernels_b"])
    r, sh = parts["router"]["kernels"], parts["shared"]["kernels"]
    pieces = [cost(("attn",), attn_half), cost(("moe", "moe_router"), (r[0] + sh[0], r[1] + sh[1])),
              cost(("moe", "moe_preprocess"), parts["permute"]["kernels"]), cost(("moe",), parts["experts"]["kernels"])]
    return sum(p[0] for p in pieces), sum(p[1] for p in pieces)


def moe_parts(c, kit: MoeKit) -> dict:
    """Every part of the MoE block (router, permute, experts, shared, dispatch + ETP collectives)."""
    a2a = dispatch_s(c, kit)
    ex = experts(c, kit)
    etp_bw, etp_lat = c.link(1.0, c.etp)
    etp_c = kit.ring_s(ex["T_exp"] * float(c.shape.hidden_size) * 2.0, c.etp, etp_bw, etp_lat)  # AG / RS of dispatched tokens
    comm = 2 * a2a + 2 * etp_c
    return {"router": router(c, kit), "permute": permute(c, kit), "experts": ex, "shared": shared_experts(c, kit),
            "dispatch": {"f": comm, "b": comm}, "a2a": a2a}


def moe_part_times(parts: dict) -> dict:
    """Seconds per layer and micro-batch (forward + backward, GPU work) of each named part."""
    def fb(p):
        return p.get("gemm_f", 0.0) + p.get("gemm_b", 0.0) + p.get("ew_f", 0.0) + p.get("ew_b", 0.0) + p.get("acc_b", 0.0)
    return {"router": fb(parts["router"]), "permute": fb(parts["permute"]), "experts": fb(parts["experts"]),
            "shared_experts": fb(parts["shared"]), "dispatch": parts["dispatch"]["f"] + parts["dispatch"]["b"]}


def moe_layer(c, L, kit: MoeKit) -> dict:
    """One MoE layer: the attention half of the dense layer `L` + router, dispatch, experts, combine.
    Returns the part dict step_time's layer model reads (gemm/attn/ew/tp/cp/ep x f/b, host kernels,
    the recompute pieces) plus 'moe_parts': moe_part_times and 'host_wait', the GPU's wait for the host's
    launches beyond the layer's GPU work (attention half included)."""
    parts = moe_parts(c, kit)
    r, pm, ex, sh = parts["router"], parts["permute"], parts["experts"], parts["shared"]
    # the attention half of a dense layer's elementwise bytes (norm, residual, RoPE; not the MLP activation)
    ew_attn_half = (L.ew.ew_dense_f - c.T * L.ew.act_b_dense) / c.bw_ew
    launches = 20 * kit.kernel_s
    ew_f = ew_attn_half + r["ew_f"] + pm["ew_f"] + ex["ew_f"] + sh["ew_f"] + launches
    acc_b = L.dense["acc_attn_b"] + ex["acc_b"] + sh["acc_b"]
    ew_b = 2.0 * ew_attn_half + r["ew_b"] + pm["ew_b"] + ex["ew_b"] + sh["ew_b"] + 2 * launches + acc_b
    kf, kb = host_kernels(c, L, parts)
    comm = parts["dispatch"]["f"]
    times = moe_part_times(parts)
    gpu = (L.attn.gemm_f + L.attn.gemm_b + L.dense["attn_f"] + L.dense["attn_b"] + L.tpa[0] + L.tpa[1]
           + L.dense["cp_f"] + L.dense["cp_b"] + ew_attn_half * 3.0 + sum(times.values()))
    # the GPU waits for the host only where launching the layer takes longer than running it
    times["host_wait"] = np.maximum(0.0, c.host_f * kf + c.host_b * kb - gpu)
    return {
        "kernels_f": kf, "kernels_b": kb,
        "gemm_f": L.attn.gemm_f + ex["gemm_f"] + sh["gemm_f"] + r["gemm_f"],
        "gemm_b": L.attn.gemm_b + ex["gemm_b"] + sh["gemm_b"] + r["gemm_b"],
        "attn_f": L.dense["attn_f"], "attn_b": L.dense["attn_b"], "ew_f": ew_f, "ew_b": ew_b,
        # SP: the MoE layer takes T/tp tokens, so no MLP all-gather/reduce-scatter; without SP the
        # attention half keeps its all-reduce.
        "tp_f": L.tpa[0], "tp_b": L.tpa[1], "cp_f": L.dense["cp_f"], "cp_b": L.dense["cp_b"],
        "ep_f": comm, "ep_b": comm,
        "moe_f": r["gemm_f"] + ex["gemm_f"] + sh["gemm_f"] + ex["ew_f"] + pm["ew_f"] + sh["ew_f"] + 2 * parts["a2a"],
        "moe_act_f": ex["ew_f"],
        "shared_f": sh["gemm_f"] + sh["ew_f"],
        "moe_parts": times,
    }


def dominant_part(times: dict) -> tuple[str, float]:
    """(name, share) of the largest part of one MoE layer's time (moe_parts of `moe_layer`, one row)."""
    vals = {k: float(np.asarray(v).reshape(-1)[0]) for k, v in times.items()}
    total = sum(vals.values())
    name = max(vals, key=vals.get)
    return name, (vals[name] / total if total > 0 else 0.0)


__all__ = ["MoeKit", "dispatch_s", "dominant_part", "experts", "host_kernels", "moe_layer", "moe_part_times",
           "moe_parts", "permute", "router", "shared_experts", "tokens_per_expert"]
