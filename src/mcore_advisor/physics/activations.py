"""What one layer's forward keeps for backward, block by block, from the layer anatomy.

Every width here is a matrix's (physics.anatomy: each block's linear layers with their in/out
features and how TP splits them; routed experts over expert TP; core attention's heads and head
widths): a GEMM saves its input (`in_features`, / TP when row-parallel) and its output feeds the
next saved tensor (`out_features`, / TP when column-parallel). What this module adds is which of
those tensors each implementation keeps and in what precision (Megatron-Core `transformer_layer.py`,
`attention.py`, `dot_product_attention.py`, `mlp.py`, `moe/`, the TE modules), not a fitted
constant. physics.memory turns the per-layer bytes into each pipeline rank's activations.

For GPT-3 shapes (MHA, GeLU 4h, no RoPE, dropout 0.1, bf16 softmax) the terms reduce exactly to
Korthikanti et al. 2022 (arXiv 2205.05198) Table 2: 34*s*b*h + 5*a*s^2*b per layer, 10 + 24/t with
TP, 34/t with TP+SP, 2*s*b*h with full recompute. What changes with modern models, term by term:

- GQA: the QKV output is (n + 2g)*d wide instead of 3h; RoPE writes new q and k tensors.
- SwiGLU: the fused activation saves its 2f-wide input (fc1's output), fc2 saves the f-wide
  product (its input; unfused: also silu's output).
- Flash/fused attention saves q, k, v, the output and fp32 softmax statistics (b*n*s), never the
  s x s matrix. Megatron's own DotProductAttention (always the local spec's core attention) saves the
  softmax output per score (`softmax_bytes_per_score`): 2 B from the fused masked-softmax kernel or
  PyTorch's bf16 softmax (Megatron-LM's default, --attention-softmax-in-fp32 off), 6 B from the fp32
  softmax (its fp32 output and the bf16 copy the PV matmul saves); dropout adds its mask and output.
- TE's DotProductAttention makes v contiguous (`get_qkv_layout`), so the QKV GEMM output is freed;
  Megatron's DotProductAttention keeps it alive through the v view its PV matmul saves (MHA), or
  saves the repeat_interleave'd k and v of GQA (n heads wide each) instead. Selective
  core_attn recompute under TE brings it back: Megatron's CheckpointFunction saves the v view, so
  with flash attention selective recompute needs more memory than none.
- FP8 (TE): GEMM inputs kept for the weight gradient are stored as 1-byte FP8 copies.
- CP divides s; SP divides the h-wide tensors outside the TP regions by t.

A layer is its blocks (anatomy.layers): each block brings its pre-norm (input, fp32 statistics and
the normalised output, the first GEMM's input) and its bias-dropout-add's mask; a GPT layer is
('attention', 'mlp' | 'moe'), a hybrid layer one block ('mamba' is physics.mamba's mixer).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np

from mcore_advisor.physics.anatomy import Block, Matrix, anatomy, block
from mcore_advisor.physics.layouts import Implementation
from mcore_advisor.physics.mamba import mamba_activation_bytes, mamba_backward_working_bytes
from mcore_advisor.schemas import ModelShape

# ---------------------------------------------------------------------------------------------
# Implementation facts and token counts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ActivationOptions:
    """Implementation facts that decide which tensors a layer's forward keeps for backward."""

    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    transformer_impl: Literal["transformer_engine", "local"] = "transformer_engine"
    unfused_attention: bool = False
    attention_backend: str = "auto"
    fp8: bool = False
    fused_activation: bool = True
    attention_softmax_in_fp32: bool = False
    masked_softmax_fusion: bool = True
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    recompute_modules: frozenset[str] = frozenset()
    ep: int = 1
    etp: int = 1
    moe_token_imbalance: float = 1.0


def activation_options(impl: Implementation, tp: int, cp: int, sp: int, fp8: int, ep: int, etp: int,
                       selective: bool) -> ActivationOptions:
    """The options of one layout: the batch's implementation, its TP/CP/EP/ETP, SP (only with TP > 1, as
    Megatron runs it), FP8, and the selective modules when `selective` (else none recomputed)."""
    return ActivationOptions(
        tp=tp, cp=cp, sequence_parallel=bool(sp) and tp > 1, transformer_impl=impl.transformer_impl,
        unfused_attention=impl.unfused_attention, attention_backend=impl.attention_backend, fp8=bool(fp8),
        fused_activation=impl.bias_activation_fusion, attention_softmax_in_fp32=impl.attention_softmax_in_fp32,
        masked_softmax_fusion=impl.masked_softmax_fusion, hidden_dropout=impl.hidden_dropout,
        attention_dropout=impl.attention_dropout,
        recompute_modules=impl.selective_modules if selective else frozenset(), ep=ep, etp=etp,
    )


@dataclass(frozen=True, slots=True)
class _LayerTokens:
    """Token counts of one micro-batch on one rank, as the per-layer byte counts use them."""

    tok: float  # tokens of the micro-batch on this rank (s/cp x b)
    sp_div: int  # TP when SP shards the h-wide tensors outside the TP regions, else 1
    gemm_in: float  # bytes per saved GEMM input element (1 with FP8)
    scores_per_head: float  # b x s/cp x s attention scores per head
    seq_k: int  # keys each query attends over (the whole sequence)


def _tokens(seq_length: int, micro_batch_size: float, o: ActivationOptions) -> _LayerTokens:
    s_local = seq_length / o.cp
    return _LayerTokens(tok=s_local * micro_batch_size, sp_div=o.tp if o.sequence_parallel and o.tp > 1 else 1,
                        gemm_in=1.0 if o.fp8 else 2.0, scores_per_head=micro_batch_size * s_local * seq_length,
                        seq_k=seq_length)


def _out_on_rank(m: Matrix, tp: float) -> float:
    """A GEMM's output features on one rank of its TP group: split when column-parallel."""
    return m.out_features / tp if m.split == "column" else float(m.out_features)


def _in_on_rank(m: Matrix, tp: float) -> float:
    """A GEMM's input features on one rank of its TP group: split when row-parallel."""
    return m.in_features / tp if m.split == "row" else float(m.in_features)


def _matrix(b: Block, name: str) -> Matrix | None:
    return next((m for m in b.matrices if m.name == name), None)


def _norm_stats_bytes(shape: ModelShape) -> float:
    # fp32 statistics per token: LayerNorm keeps mean and rstd, RMSNorm rstd only.
    return 8.0 if shape.normalization == "LayerNorm" else 4.0


# ---------------------------------------------------------------------------------------------
# Unfused attention's softmax
# ---------------------------------------------------------------------------------------------


def megatron_dot_product_attention(o: ActivationOptions) -> bool:
    """Core attention is Megatron's own DotProductAttention: always under the local spec
    (LocalSpecProvider.core_attention), and 'local' under Transformer Engine."""
    return o.unfused_attention and (o.transformer_impl == "local" or o.attention_backend == "local")


def fused_softmax_kernel(megatron_dpa: bool, masked_softmax_fusion: bool, heads_per_rank, seq_k: int):
    """Whether unfused attention's masked softmax runs a fused CUDA kernel (`heads_per_rank` a number or
    an array of them).

    Megatron's DotProductAttention (fusions/fused_softmax.py FusedScaleMaskSoftmax.is_kernel_available):
    masked_softmax_fusion, bf16 input, 16 < sk <= 4096, sq and sk multiples of 4 and b*np a multiple of 4
    (taken here as np % 4 == 0, so the figure stays linear in b). TE's UnfusedDotProductAttention has
    its own kernel for 16 < sk < 16384 with sk % 8 == 0 (TE attention/dot_product_attention/softmax.py).
    """
    if not megatron_dpa:
        return 16 < seq_k < 16384 and seq_k % 8 == 0
    seq_ok = masked_softmax_fusion and 16 < seq_k <= 4096 and seq_k % 4 == 0
    return np.logical_and(seq_ok, np.mod(heads_per_rank, 4) == 0)


def softmax_bytes_per_score(o: ActivationOptions, heads_per_rank: int, seq_k: float) -> tuple[float, float]:
    """(bytes saved for backward, bytes live at the softmax backward) per attention score of unfused attention.

    - fused kernel (ScaledUpperTriangMaskedSoftmax): saves its bf16 output (2 B); its backward writes the
      gradient in place over the incoming one: 2 + 2 live.
    - PyTorch softmax in bf16 (Megatron-LM's default, no --attention-softmax-in-fp32): masked_fill_
      works in place on the QK^T output, softmax saves its bf16 output (2 B). The in-place fill is on a
      view of baddbmm's output, so autograd's backward of it is CopySlices: it holds the incoming
      gradient, a result buffer, a contiguous clone and masked_fill's output at once (8 B; the softmax
      backward before it holds 6). Measured (s11, 2 x H200, GPT-2.7B layers at 2k tokens, the memory
      peak replayed): four score-sized bf16 tensors live at the last layer's backward.
    - PyTorch softmax in fp32: `.float()` copy, softmax saves its fp32 output (4 B) and the bf16 copy
      the PV matmul saves (2 B) = 6 B. At its backward's peak the fp32 output and three fp32 score-sized
      gradient tensors are live (16 B; the bf16 copy is freed by then): measured (s11, 4 x H200, GPT-2.7B
      layers at 2k tokens, Q_gpt27_dp4_fp32softmax's replayed peak: 8 x 2 GiB softmax outputs and 3 x 2 GiB
      from the autograd thread); an op-by-op CPU trace of the same ops holds one gradient fewer (12 B).
    With attention dropout p > 0 (torch.nn.Dropout, skipped at p = 0) the dropout keeps a 1-byte mask
    and the PV matmul saves the dropped bf16 output instead of the softmax's bf16 one.
    """
    dpa = megatron_dot_product_attention(o)
    fused = bool(fused_softmax_kernel(dpa, o.masked_softmax_fusion, heads_per_rank, seq_k))
    fp32 = not fused and (o.attention_softmax_in_fp32 or not dpa)
    if fused:
        out, live = 2.0, 4.0
    elif fp32:
        out, live = 4.0, 16.0
    else:
        out, live = 2.0, 8.0
    pv_input = 2.0 if (fp32 or o.attention_dropout > 0) else 0.0  # a bf16 tensor besides the softmax output
    mask = 1.0 if o.attention_dropout > 0 else 0.0
    return out + pv_input + mask, live


# ---------------------------------------------------------------------------------------------
# Saved tensors, block by block
# ---------------------------------------------------------------------------------------------


def _pre_norm_terms(shape: ModelShape, o: ActivationOptions, c: _LayerTokens) -> dict[str, float]:
    """One block's pre-norm and bias-dropout-add, on the residual stream (hidden_size wide, / TP with SP).

    The norm saves its input and fp32 statistics; its output is the block's first GEMM input (TE's
    LayerNormLinear / Megatron's linear keep the local SP shard and re-gather it in backward; FP8 keeps
    a 1-byte copy), dropped with 'layernorm' recompute (recomputed from the saved input). With hidden
    dropout the bias-dropout-add (fusions/fused_bias_dropout.py) keeps a 1-byte mask per element of its
    output; the residual add saves nothing."""
    h = anatomy(shape).hidden_size * c.tok / c.sp_div
    return {
        "norm_inputs": 2.0 * h + _norm_stats_bytes(shape) * c.tok / c.sp_div,
        "norm_outputs": 0.0 if "layernorm" in o.recompute_modules else c.gemm_in * h,
        "dropout_masks": 1.0 * h if o.hidden_dropout > 0 else 0.0,
    }


def _gqa_bytes(shape: ModelShape, att: Block, o: ActivationOptions, c: _LayerTokens) -> float:
    """Bytes kept of the QKV projection's output and the tensors made from it (MHA / GQA)."""
    core, t, tok, rec = att.core, o.tp, c.tok, o.recompute_modules
    q, k, v = core.heads * core.qk_dim / t, core.kv_heads * core.qk_dim / t, core.kv_heads * core.v_dim / t
    qkv_out = _out_on_rank(_matrix(att, "linear_qkv"), t)
    dpa = megatron_dot_product_attention(o)
    if dpa and core.kind == "gqa" and "core_attn" not in rec:
        # Megatron's DotProductAttention with GQA: the query is reshaped out of the grouped QKV output
        # (a copy) or RoPE'd (new), and repeat_interleave makes n-head k and v, which the QK^T and PV
        # matmuls save; nothing keeps the QKV GEMM output itself.
        return 2.0 * tok * (q + core.heads * (core.qk_dim + core.v_dim) / t)
    rope = shape.position_embedding_type == "rope"
    roped = 2.0 * tok * (q + k) if rope else 0.0
    if o.transformer_impl == "local" or dpa or not rope:
        # MHA under Megatron's attention (or no RoPE): the PV matmul saves v, a view of the QKV GEMM
        # output, which keeps the whole (q + 2kv)-wide tensor alive; RoPE adds new q and k tensors.
        return 2.0 * tok * qkv_out + roped
    if "core_attn" in rec:
        # TE + selective core_attn: Megatron's CheckpointFunction (tensor_parallel/random.py,
        # `ctx.save_for_backward(*args)`) keeps q, k, v exactly as attention.py's
        # _checkpointed_attention_forward passes them: the RoPE'd q and k, and v, a view of the
        # QKV GEMM output, which so stays alive whole. TE's contiguous v copy (get_qkv_layout)
        # is made under no_grad and dropped. So selective costs 2*(q + kv) B/token more here
        # than the TE branch below, minus the fp32 softmax statistics it no longer saves:
        # measured 54.74 vs 51.76 GiB for GPT 1.3B mbs 8 (benchmarks/results).
        return roped + 2.0 * tok * qkv_out
    # TE: RoPE writes q, k; TE's get_qkv_layout finds the strided v 'not_supported' and makes q, k, v
    # contiguous (a copy of v only); FusedAttention saves those, so the QKV GEMM output is freed.
    return 2.0 * tok * (q + k + v)


def _mla_bytes(shape: ModelShape, att: Block, o: ActivationOptions, c: _LayerTokens) -> float:
    """Bytes kept by MLA's projections (Megatron MLASelfAttention, multi_latent_attention.py).

    The down-projections are whole on every TP rank and, with SP, run on the local sequence shard, so
    their outputs are s/TP long. linear_q_up_proj / linear_kv_up_proj (norm fused) save their input
    (q_compressed; kv_compressed, a view that keeps all of the kv down-projection's output, latent
    and RoPE key, alive), the normed local shard and fp32 statistics. The up-projection outputs are
    split, RoPE'd and concatenated into new query/key/value tensors without being saved; core
    attention saves those. With 'mla_up_proj' recompute the query/key/value are discarded after the
    attention forward, leaving the checkpoint's extra input, the gathered RoPE key (k_pos_emb).
    """
    core, t, tok = att.core, o.tp, c.tok
    pairs = [(_matrix(att, "linear_q_down_proj"), _matrix(att, "linear_q_up_proj")),
             (_matrix(att, "linear_kv_down_proj"), _matrix(att, "linear_kv_up_proj"))]
    pairs = [(down, up) for down, up in pairs if down is not None]
    per_token = sum(2.0 * _out_on_rank(down, t) + c.gemm_in * _in_on_rank(up, t) + _norm_stats_bytes(shape)
                    for down, up in pairs)
    down = per_token * tok / c.sp_div
    if "mla_up_proj" in o.recompute_modules:
        kv_down, kv_up = pairs[-1]
        rope_key = kv_down.out_features - kv_up.in_features  # the down-projection's part beside the latent
        return down + 2.0 * tok * rope_key
    return down + 2.0 * tok * (core.heads * core.qk_dim + core.kv_heads * (core.qk_dim + core.v_dim)) / t


def _attention_terms(shape: ModelShape, o: ActivationOptions, c: _LayerTokens) -> dict[str, float]:
    """The attention block: the projections' tensors ('qkv'), core attention's scores or softmax
    statistics, and its output, which is linear_proj's input (row-parallel: n*d_v / TP)."""
    att = block(shape, "attention")
    heads = att.core.heads / o.tp
    v_out = _in_on_rank(_matrix(att, "linear_proj"), o.tp)
    terms = {"qkv": (_mla_bytes if att.core.latent else _gqa_bytes)(shape, att, o, c)}
    core_recomputed = "core_attn" in o.recompute_modules
    if o.unfused_attention and not core_recomputed:
        saved, _ = softmax_bytes_per_score(o, att.core.heads // o.tp, c.seq_k)
        # the s x s softmax output per head; the contiguous context is the proj input
        return {**terms, "attention_scores": saved * heads * c.scores_per_head, "attention_output": 2.0 * c.tok * v_out}
    if o.unfused_attention or core_recomputed:
        return {**terms, "attention_scores": 0.0, "attention_output": c.gemm_in * c.tok * v_out}
    # Flash/fused: the output is saved by the attention and is the proj input (FP8 adds the
    # 1-byte copy TE's Linear keeps); fp32 log-sum-exp per head and token.
    fp8_copy = 1.0 if o.fp8 else 0.0
    return {**terms, "attention_scores": 4.0 * heads * c.tok, "attention_output": (2.0 + fp8_copy) * c.tok * v_out}


def _mlp_bytes(shape: ModelShape, mats: tuple[Matrix, ...], tokens: float, tp: float, o: ActivationOptions,
               keep_fc2_input: bool = True) -> float:
    """An MLP's (fc1, fc2) saved tensors for `tokens` tokens: the activation's input (fc1's output,
    2f wide with the SwiGLU gate), fc2's input (f wide, 1 B under FP8) unless recomputed, and silu's
    output when a SwiGLU is not fused."""
    fc1, fc2 = mats
    act_in = 2.0 * _out_on_rank(fc1, tp) * tokens
    fc2_in = (1.0 if o.fp8 else 2.0) * _in_on_rank(fc2, tp) * tokens if keep_fc2_input else 0.0
    silu = 2.0 * _in_on_rank(fc2, tp) * tokens if (shape.swiglu and not o.fused_activation) else 0.0
    return act_in + fc2_in + silu


def _mlp_terms(shape: ModelShape, o: ActivationOptions, c: _LayerTokens) -> dict[str, float]:
    mlp = block(shape, "mlp")
    return {"mlp_activations": 0.0 if "mlp" in o.recompute_modules else _mlp_bytes(shape, mlp.matrices, c.tok, o.tp, o)}


def _moe_terms(shape: ModelShape, o: ActivationOptions, c: _LayerTokens) -> dict[str, float]:
    """The MoE block: router logits/probs (E per token), dispatched tokens (k per token) as the
    experts' fc1 input, the experts' activations (the probs are applied in the activation, so the
    unpermute keeps no outputs) and the shared expert's MLP."""
    rec = o.recompute_modules
    if "moe" in rec:
        # MoELayer.forward (moe_layer_recompute) checkpoints route, dispatch, experts, combine and the
        # shared experts as one function: only the layer's input (the norm output, counted there) is kept.
        return dict.fromkeys(("moe_router", "moe_dispatched_tokens", "moe_expert_activations", "moe_combine",
                              "mlp_activations"), 0.0)
    moe = block(shape, "moe")
    # MoE needs SP with TP > 1: the router sees the local tokens.
    tok_moe = c.tok / o.tp
    # Tokens this rank's experts process: k copies of each local token on average (EP exchanges
    # them evenly), gathered over ETP ranks; x imbalance for skewed routing.
    n_e = tok_moe * moe.topk * o.etp * o.moe_token_imbalance
    shared = moe.matrices and "shared_experts" not in rec
    return {
        "moe_router": (2.0 + 4.0 + 4.0 + 1.0) * moe.router.out_features * tok_moe,  # bf16 logits, fp32 scores+probs, routing map
        "moe_dispatched_tokens": c.gemm_in * _in_on_rank(moe.experts[0], o.etp) * n_e,
        # 'moe_act' recompute reruns the activation: its output (the fc2 input) is not kept.
        "moe_expert_activations": _mlp_bytes(shape, moe.experts, n_e, o.etp, o, keep_fc2_input="moe_act" not in rec),
        # The routing probs are applied inside the experts' activation (experts.py bias_act_func /
        # weighted_bias_swiglu_impl: it saves its input, counted above, and the probs), so the combine's
        # unpermute runs without probs (token_dispatcher.py) and keeps only its index map: no expert outputs.
        "moe_combine": 0.0,
        "mlp_activations": _mlp_bytes(shape, moe.matrices, c.tok, o.tp, o) if shared else 0.0,
    }


_BLOCK_TERMS = {"attention": _attention_terms, "mlp": _mlp_terms, "moe": _moe_terms}


def block_activation_terms(shape: ModelShape, kind: str, seq_length: int, micro_batch_size: float,
                           o: ActivationOptions) -> dict[str, float]:
    """Bytes one block ('attention', 'mlp', 'moe', 'mamba') and its pre-norm save for backward, per
    micro-batch on one rank, by tensor group ('mamba': physics.mamba's mixer)."""
    c = _tokens(seq_length, micro_batch_size, o)
    terms = _pre_norm_terms(shape, o, c)
    if kind == "mamba":
        return {**terms, "mamba": mamba_activation_bytes(shape, c.tok, o.tp, o.fp8)}
    if kind not in _BLOCK_TERMS:
        raise ValueError(f"block kind must be one of {sorted((*_BLOCK_TERMS, 'mamba'))}, got {kind!r}")
    return {**terms, **_BLOCK_TERMS[kind](shape, o, c)}


def layer_activation_terms(shape: ModelShape, seq_length: int, micro_batch_size: float, moe_layer: bool,
                           o: ActivationOptions) -> dict[str, float]:
    """Bytes one GPT decoder layer (attention + MLP, or + MoE when `moe_layer` on an MoE model) saves
    for backward, per micro-batch on one rank, by tensor group: its two blocks' terms, the pre-norm
    and dropout terms of both summed."""
    kinds = ("attention", "moe" if moe_layer and shape.num_experts else "mlp")
    terms: dict[str, float] = {}
    for kind in kinds:
        for name, value in block_activation_terms(shape, kind, seq_length, micro_batch_size, o).items():
            terms[name] = terms.get(name, 0.0) + value
    return terms


# ---------------------------------------------------------------------------------------------
# The backward's working set
# ---------------------------------------------------------------------------------------------


def layer_backward_working_pieces(shape: ModelShape, seq_length: int, micro_batch_size: float, moe_layer: bool,
                                  o: ActivationOptions, saved: dict[str, float]) -> tuple[float, ...]:
    """Candidates for the temporaries of one GPT layer's backward on top of what is saved, each affine
    in the micro-batch; the working set is the largest (`layer_backward_working_bytes`).

    First: gradient tensors in flight (of fc1's output and fc2's input, and three on the residual
    stream), the SP all-gather of a GEMM input for its weight gradient and the largest bf16
    weight-gradient tensor (no gradient-accumulation fusion). Second, for unfused attention only:
    the softmax's backward (`softmax_bytes_per_score`'s live bytes: 16 B/score in fp32, 8 B in bf16),
    while the layer's MLP tensors and their gradients are already freed and two gradients remain on
    the residual stream (the s11 memory peaks: 3.125 GiB from the autograd thread at Llama-8B layers'
    peak = three 1 GiB score tensors + two 64 MiB gradients).
    """
    c = _tokens(seq_length, micro_batch_size, o)
    t, h = o.tp, anatomy(shape).hidden_size
    fc1, fc2 = block(shape, "mlp").matrices
    if moe_layer and shape.num_experts:
        moe = block(shape, "moe")
        e1, e2 = moe.experts
        # the gradients of the saved expert tensors: as many tokens and as wide (see _moe_terms)
        n_e = c.tok / t * moe.topk * o.etp * o.moe_token_imbalance
        mlp_grads = 2.0 * n_e * (_out_on_rank(e1, o.etp) + _in_on_rank(e2, o.etp))
    else:
        mlp_grads = 2.0 * c.tok * (_out_on_rank(fc1, t) + _in_on_rank(fc2, t))
    residual_grad = 2.0 * h * c.tok / c.sp_div  # one bf16 gradient on the residual stream
    grads = mlp_grads + 3 * residual_grad
    gather = 2.0 * h * c.tok if c.sp_div > 1 else 0.0
    # Without gradient-accumulation fusion (it needs Apex; TE-on-gpu.md: Megatron runs here with
    # --no-gradient-accumulation-fusion) each weight gradient is a bf16 tensor added to main_grad:
    # the dense MLP's fc1 or an MHA-sized QKV weight (3h x h), whichever is larger, in MoE layers
    # too: a bound that predates the anatomy, kept so the figures stay (an MoE or MLA layer's own
    # largest matrix is smaller; TE's grouped expert wgrad may hold several experts' at once).
    wgrad = 2.0 * max(fc1.weights, 3 * h * h) / t
    pieces: tuple[float, ...] = (grads + gather + wgrad,)
    if o.unfused_attention:
        heads = block(shape, "attention").core.heads // t
        per_saved, live = softmax_bytes_per_score(o, heads, seq_length)
        freed = saved.get("mlp_activations", 0.0) + saved.get("attention_output", 0.0)
        # selective recompute of core_attn saves none of the scores, but its backward reruns the forward first:
        # the softmax output it needs is live again beside the gradients (s10, 4 x H200, GPT 2.7B layers at 2k
        # tokens without TE: 15.95 GiB measured, 13.61 predicted while this piece was left out)
        held = live if "core_attn" in o.recompute_modules else live - per_saved
        pieces += (heads * c.scores_per_head * held - freed + 2 * residual_grad,)
    return pieces


def layer_backward_working_bytes(shape: ModelShape, seq_length: int, micro_batch_size: int, moe_layer: bool,
                                 o: ActivationOptions, saved: dict[str, float]) -> float:
    """Temporaries of one layer's backward on top of what is saved (the largest working piece)."""
    return max(layer_backward_working_pieces(shape, seq_length, micro_batch_size, moe_layer, o, saved))


# ---------------------------------------------------------------------------------------------
# Per layer kind (what physics.memory's per-layout tables sum)
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=65536)
def layer_kinds(shape: ModelShape, seq: int, o: ActivationOptions) -> dict:
    """Per layer kind: (saved bytes per sample, working-set pieces at b = 0, their slopes per sample).
    Saved bytes are linear in the micro-batch, the pieces affine.

    Keys: 'dense' and (MoE models) 'moe', the GPT layers; for a hybrid also each layer's block tuple
    (anatomy.layers[i], saved bytes only: one block and its pre-norm), and the Mamba mixer's working
    set joins the dense layer's pieces."""
    kinds: dict = {}
    for name, moe in (("dense", False), ("moe", True)) if shape.is_moe else (("dense", False),):
        t0, t1 = (layer_activation_terms(shape, seq, b, moe, o) for b in (0, 1))
        w0, w1 = (layer_backward_working_pieces(shape, seq, b, moe, o, t) for b, t in ((0, t0), (1, t1)))
        kinds[name] = (sum(t1.values()), w0, tuple(b - a for a, b in zip(w0, w1, strict=True)))
    if shape.is_hybrid:
        for blocks in set(anatomy(shape).layers):
            kinds[blocks] = (sum(v for k in blocks for v in block_activation_terms(shape, k, seq, 1, o).values()), (), ())
        if shape.num_mamba_layers:
            c = _tokens(seq, 1, o)
            w1 = mamba_backward_working_bytes(shape, c.tok, o.tp, c.sp_div)
            d = kinds["dense"]
            kinds["dense"] = (d[0], (*d[1], 0.0), (*d[2], w1))
    return kinds
