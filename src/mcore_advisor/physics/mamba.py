"""Mamba-2 layers of Megatron's hybrid models (pretrain_hybrid.py): FLOPs, activations, time.

A hybrid model (`ModelShape.hybrid_layer_pattern`) stacks one-block layers: 'M' a Mamba-2 mixer,
'*' self-attention, '-' a dense MLP, 'E' an MoE MLP, each behind its own pre-norm (Megatron
`HybridStack`, models/hybrid/hybrid_layer_specs.py; the norm is fused into the first linear).
This module holds the Mamba mixer's physics (Megatron `core/ssm/mamba_mixer.py`, training path
`_ssm_training` -> mamba_ssm `mamba_split_conv1d_scan_combined`) and the assembly of the other
layer kinds from the halves of a GPT layer that physics.memory and physics.step_time compute; it
imports neither (they call it), so each formula stays in one place. The mixer's matrices, its
parameters and Megatron's FLOP count are physics.anatomy's (the one description of every layer kind).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mcore_advisor.physics.anatomy import anatomy, mamba_flops_per_token  # noqa: F401 (re-exported)
from mcore_advisor.schemas import ModelShape, mamba_conv_dim
from mcore_advisor.schemas import mamba_in_proj_width as in_proj_width

# MambaMixer's chunk_size: SSD works on 128-token chunks and materialises one fp32 state
# (head_dim x state_dim per head) per chunk.
SSD_CHUNK = 128


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------


def mamba_activation_bytes(shape: ModelShape, tokens: float, tp: int, fp8: bool) -> float:
    """Bytes one Mamba mixer saves for backward, per micro-batch on one rank (without its pre-norm,
    which the caller counts like any layer's: input, statistics and the normalised in_proj input).

    Megatron `_ssm_training` makes a contiguous (b, l, d) copy of the in_proj output, which
    `mamba_split_conv1d_scan_combined` saves whole (z, x, B, C, dt: in_proj_width / TP), and saves
    the SSM output before gating (d_inner / TP); the conv output and chunk states are recomputed in
    its backward. The gated RMSNorm (ExtendedRMSNorm) saves its input (d_inner) and an fp32 rstd
    per group; out_proj saves the norm output (d_inner; a 1-byte copy under FP8). CP leaves these
    per-rank sizes unchanged (the all-to-all trades sequence for heads). `tokens` = s/cp x b.
    """
    d_in = shape.mamba_d_inner / tp
    saved = 2.0 * in_proj_width(shape) / tp + 2.0 * d_in + 2.0 * d_in + 4.0 * shape.mamba_num_groups / tp
    saved += (1.0 if fp8 else 2.0) * d_in
    return saved * tokens


def mamba_backward_working_bytes(shape: ModelShape, tokens: float, tp: int, sp_div: int) -> float:
    """Temporaries of a Mamba layer's backward: the in_proj output gradient (in_proj_width), the
    gradients of the SSM output and norm (d_inner each), residual-stream gradients (h, as a GPT
    layer's) and, with SP, the re-gathered in_proj input."""
    h = shape.hidden_size
    grads = 2.0 * tokens * (in_proj_width(shape) + 2 * shape.mamba_d_inner) / tp + 3 * 2.0 * h * tokens / sp_div
    return grads + (2.0 * h * tokens if sp_div > 1 else 0.0)


def hybrid_layer_bytes(shape: ModelShape, dense: dict[str, float], moe: dict[str, float] | None,
                       mamba: float) -> dict[str, float]:
    """Saved bytes per micro-batch of each hybrid layer kind, by symbol, from the terms of a GPT
    dense layer (`dense`) and MoE layer (`moe`) as physics.memory.layer_activation_terms gives them:
    every hybrid layer has one pre-norm (half the GPT layer's two) and one dropout site."""
    norm = (dense["norm_inputs"] + dense["norm_outputs"] + dense["dropout_masks"]) / 2
    out = {
        "*": norm + dense["qkv"] + dense["attention_scores"] + dense["attention_output"],
        "-": norm + dense["mlp_activations"],
        "M": norm + mamba,
    }
    if moe is not None:
        out["E"] = norm + sum(moe[k] for k in ("moe_router", "moe_dispatched_tokens", "moe_expert_activations",
                                                "moe_combine", "mlp_activations"))
    return out


# ---------------------------------------------------------------------------------------------
# Parameters on a rank
# ---------------------------------------------------------------------------------------------


def hybrid_rank_params(shape: ModelShape, layers: list[int], tp: int, ep: int, etp: int) -> tuple[float, float, float]:
    """(non-expert, expert, FP8-eligible linear) parameters of a hybrid stage's `layers` on one rank,
    each layer as physics.anatomy describes its block (Mamba: every tensor split over TP, as
    MambaMixer marks each tensor_model_parallel), its one pre-norm whole."""
    a = anatomy(shape)
    out = [a.layer_params_on_rank(a.layers[i], tp, ep, etp) for i in layers]
    return tuple(float(sum(x[k] for x in out)) for k in range(3))


# ---------------------------------------------------------------------------------------------
# Time
# ---------------------------------------------------------------------------------------------

SCAN_BACKWARD_FACTOR = 2.5
"""Backward of the fused conv + SSD scan over its forward: it recomputes the convolution and the
chunk states and writes gradients for every input (z, x, B, C, dt). The same ratio step_time uses
for fused attention; not measured for the SSD kernels here (no Mamba kernels on this workplace)."""


def ssd_scan_bytes_per_token(shape: ModelShape, tp: Any) -> Any:
    """HBM bytes per token of the forward conv + chunked scan on one rank: the depthwise conv reads
    and writes x, B, C (bf16); the scan reads the in_proj output, writes and re-reads one fp32
    state (head_dim x state) per head and chunk, and writes the gated output and the pre-gate output
    (bf16, d_inner each)."""
    d_in = shape.mamba_d_inner
    conv = 2 * 2.0 * mamba_conv_dim(shape)
    states = 2 * 4.0 * d_in * shape.mamba_state_dim / SSD_CHUNK
    return (2.0 * in_proj_width(shape) + conv + states + 2 * 2.0 * d_in) / tp


@dataclass(frozen=True, slots=True)
class MambaTiming:
    """What step_time hands the Mamba layer's time: tokens per micro-batch on the rank (`T`; `T_sp`
    with SP), TP, its GEMM timer (`linear_s(m, n, k)` -> forward, dgrad, wgrad seconds), its TP
    communication of a column -> row block (`tp_comm`) and CP all-to-all (`cp_a2a(bytes)`), the
    elementwise bandwidth, the GEMM rate, one kernel launch, and the pre-norm + residual bytes per token."""

    T: Any
    T_sp: Any
    tp: Any
    linear_s: Callable
    tp_comm: Callable
    cp_a2a: Callable
    bw_ew: float
    rate: float
    kernel_s: float
    norm_resid_bytes: float


def mamba_layer_parts(shape: ModelShape, t: MambaTiming) -> dict:
    """Forward/backward seconds of one Mamba layer per micro-batch, in step_time's part keys.

    GEMMs: in_proj (column-parallel, its TP comm like an MLP's fc1) and out_proj (row-parallel) at
    their built sizes. 'ssm': the conv + SSD scan, the larger of its bytes at elementwise bandwidth
    and Megatron's scan FLOPs (7*d_in*N per token) at the GEMM rate. Elementwise: the pre-norm and
    residual (`norm_resid_bytes` per token, SP-sharded), the (l,b,d) <-> (b,l,d) copies around the
    scan and the gated RMSNorm. CP: MambaContextParallel's all-to-alls before (in_proj width) and
    after (d_inner) the scan, forward and backward, not overlapped.
    """
    T, tp = t.T, t.tp
    h, d_in, width = float(shape.hidden_size), float(shape.mamba_d_inner), float(in_proj_width(shape))
    inp = t.linear_s(T, width / tp, h)
    out = t.linear_s(T, h, d_in / tp)
    scan_f = np.maximum(T * ssd_scan_bytes_per_token(shape, tp) / t.bw_ew,
                        7.0 * T * d_in * shape.mamba_state_dim / tp / t.rate) + 4 * t.kernel_s
    copies = T * (2 * 2.0 * width + 2 * 2.0 * d_in + 2 * 2.0 * d_in) / tp  # two transposing copies + gated norm
    ew_f = (t.T_sp * t.norm_resid_bytes + copies) / t.bw_ew + 6 * t.kernel_s
    tp_f, tp_b = t.tp_comm(inp[1], inp[2], out[1], out[0], inp[0])
    a2a = t.cp_a2a(T * (width + d_in) * 2.0 / tp)
    return {
        "gemm_f": inp[0] + out[0], "gemm_b": inp[1] + inp[2] + out[1] + out[2],
        "attn_f": 0.0, "attn_b": 0.0, "ssm_f": scan_f, "ssm_b": SCAN_BACKWARD_FACTOR * scan_f,
        "ew_f": ew_f, "ew_b": 2.0 * ew_f, "tp_f": tp_f, "tp_b": tp_b, "cp_f": a2a, "cp_b": a2a,
        "ep_f": 0.0, "ep_b": 0.0, "mlp_rc_f": 0.0, "norms": 1.0,
    }


def hybrid_kinds(shape: ModelShape, attn: dict, mlp: dict, moe: dict | None, mamba: dict | None) -> list[tuple[dict, float, bool]]:
    """(parts, share of the layers, is MoE) for each layer kind of a hybrid pattern, from the
    attention and MLP halves of a GPT layer and the MoE and Mamba layers step_time builds."""
    pattern = shape.hybrid_layer_pattern or ""
    L = float(len(pattern))
    kinds = [(attn, "*", False), (mlp, "-", False), (moe, "E", True), (mamba, "M", False)]
    return [(parts, pattern.count(sym) / L, is_moe) for parts, sym, is_moe in kinds if parts is not None and sym in pattern]
