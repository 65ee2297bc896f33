"""Per-GPU memory of a Megatron-Core training plan, term by term, on its most-loaded rank.

What is modelled, and the definition each figure follows:

- `peak_allocated`: what `torch.cuda.max_memory_allocated()` reports in steady state (after the
  first optimizer step has created the Adam state): model state (weights, gradient buffer,
  optimizer state) + the activations saved by the in-flight microbatches + the largest transient
  live at that moment (logits and loss on the last stage, a layer's backward working set, the
  recompute working set) + persistent Megatron buffers. The optimizer step is a second candidate
  peak (model state + the optimizer's temporaries); the larger one is reported.
- `peak_reserved`: peak_allocated + the caching allocator's fragmentation margin (an empirical
  allowance, see `fragmentation_fraction`).
- `total`: peak_reserved + memory outside PyTorch's allocator (CUDA context, NCCL buffers), which
  max_memory_allocated never includes. `fits` compares total with the GPU's capacity.

Activations are derived from what each forward op saves for backward (Megatron-Core
`transformer_layer.py`, `attention.py`, `dot_product_attention.py`, `mlp.py`, the TE modules), not
from a fitted constant. For GPT-3 shapes (MHA, GeLU 4h, no RoPE, dropout 0.1, bf16 softmax) the
terms reduce exactly to Korthikanti et al. 2022 (arXiv 2205.05198) Table 2: 34*s*b*h + 5*a*s^2*b
per layer, 10 + 24/t with TP, 34/t with TP+SP, 2*s*b*h with full recompute. What changes with
modern models, term by term:

- GQA: the QKV output is (n + 2g)*d wide instead of 3h; RoPE writes new q and k tensors.
- SwiGLU: the fused activation saves its 2f-wide input, fc2 saves the f-wide product (unfused:
  also silu's output).
- Flash/fused attention saves q, k, v, the output and fp32 softmax statistics (b*n*s), never the
  s x s matrix. Megatron's local (unfused) DotProductAttention saves the fp32 softmax output and its
  bf16 copy (`attention_softmax_in_fp32`, TransformerConfig's default True) = 6 bytes per score.
- TE's DotProductAttention makes v contiguous (`get_qkv_layout`), so the QKV GEMM output is freed;
  the local spec keeps it alive through the v view that the attention matmul saves. Selective
  core_attn recompute under TE brings it back: Megatron's CheckpointFunction saves the v view, so
  with flash attention selective recompute needs more memory than none.
- Loss: the last stage holds 6 B per logit (unfused), 10 B (Megatron's torch.compile'd 'native'
  fused cross entropy: Inductor materialises in-place updates out of place) or 2 B (TE's).
- FP8 (TE): GEMM inputs kept for the weight gradient are stored as 1-byte FP8 copies.
- CP divides s; SP divides the h-wide tensors outside the TP regions by t.

Pipeline schedule (Megatron `pipeline_parallel/schedules.py`): 1F1B rank r holds
min(PP - r, M) microbatches at its peak (PP - r - 1 warmup forwards, +1 in steady state); the
interleaved schedule holds min(2*(PP - r - 1) + (VP - 1)*PP + 1, M*VP) model chunks on rank r
(warmup = (PP - r - 1)*2 + (VP - 1)*microbatch_group_size_per_vp_stage, group size = PP by
default). On rank 0 that is L*(1 + (PP - 1)/(PP*VP)) layer-microbatches, Megatron's
"interleaved schedule memory penalty".

Buffers that add nothing: the distributed optimizer all-gathers parameters in place into DDP's
param buffer (the bf16 weights already counted) and reduce-scatters in place in the grad buffer;
gradient clipping works tensor by tensor. Not modelled: CUDA-graph pools, TE userbuffers for
tp_comm_overlap, CPU offloading, MoE capacity-factor padding beyond `moe_token_imbalance`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from mcore_advisor.knowledge.hardware import gpu
from mcore_advisor.knowledge.models import (
    attention_params_per_layer,
    linear_weights,
    mlp_params,
    norm_params,
    resolve_model,
)
from mcore_advisor.schemas import ModelShape, Plan, layers_per_stage, parallel_dims

GIB = 1024**3

# ---------------------------------------------------------------------------------------------
# Named assumptions (not fitted to any measurement; each states where it comes from)
# ---------------------------------------------------------------------------------------------

# CUDA context of a torch process on Hopper with lazy module loading (CUDA >= 11.7 default),
# incl. cuBLAS/cuDNN handles: typically 0.5-0.6 GiB as nvidia-smi minus torch's reserved shows.
# Not measured in this project; outside max_memory_allocated/max_memory_reserved.
CUDA_CONTEXT_GIB = 0.55
# NCCL buffers per communicator the rank belongs to with >= 2 ranks: NCCL_BUFFSIZE 4 MiB x
# channels (up to 32 on NVLink) x send/recv, plus proxy state. Order-of-magnitude allowance.
NCCL_PER_COMMUNICATOR_GIB = 0.25
# cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG default on Hopper 32 MiB per handle; torch allocates
# it through the caching allocator, so it is inside max_memory_allocated) and small misc tensors.
MISC_ALLOCATED_BYTES = 64 * 2**20


def cross_entropy_peak_bytes_per_logit(fused: bool, impl: Literal["native", "te"] = "native") -> float:
    """Bytes per logit (per token x local vocab entry) live at the loss's peak on the last stage.

    - Unfused (`tensor_parallel/cross_entropy.py` vocab_parallel_cross_entropy): `.float()` makes
      an fp32 copy while the bf16 logits are still referenced by the model's forward; subtract and
      exp then run in place on the copy, which is saved as the softmax and turned into the
      gradient in place: 2 + 4 = 6 B.
    - Fused 'native' (`fusions/fused_cross_entropy.py`): the same steps inside torch.compile'd
      graphs (`jit_fuser`). Inductor keeps an input mutation in place only when pointwise ops
      alone consume it; calculate_predicted_logits also reduces over the mutated logits (max
      subtraction, exp, sum) and calculate_gradients scatters into the softmax, so each graph
      writes the new value into a fresh fp32 [s, b, v] buffer and copies it back (the NOTE in
      later versions of that file, which split the graphs to avoid it): 2 + 4 + 4 = 10 B.
      megatron-core 0.19.2 as our profile job runs it shows exactly that: +4 B/logit on every
      fused row against the unfused probe rows (e.g. 2.00 GiB at 16384 tokens x 32768 vocab).
    - Fused 'te' (Transformer Engine's parallel_cross_entropy): writes the gradient into the bf16
      logits in place: 2 B (TE builds around the 2026 numerics fix may hold more; not measured).
    """
    if not fused:
        return 6.0
    return 2.0 if impl == "te" else 10.0


def fragmentation_fraction(*, expandable_segments: bool, pipelined_or_full_recompute: bool) -> float:
    """Reserved-minus-allocated margin as a fraction of peak allocated.

    Grounding: the H200 probe rows (shared/data/device-measurements-h200.jsonl, PP=1, no
    expandable segments) show reserved/allocated - 1 of 0.3-4.0% without recompute (median 1.6%)
    and 18.9% with full recompute; Megatron-Bridge's memory-tuning skill reports a Llama3-70B
    PP4 VP5 run at 58.8 GB allocated that OOMs on an 80 GB H100 from fragmentation alone and fits
    with expandable_segments. With expandable segments the allocator maps pages on demand and the
    margin is near zero.
    Our H200 sweep (benchmarks/results/gpu_*.jsonl, 31 rows) agrees without changing the
    numbers: no/selective recompute 0.3-8.9% (median 2.1%; reserved predicted within 4.6%, +1.2%
    on average), full recompute or PP2 1.7-12.0% (median 4.3%; reserved over-predicted by 4.2% on
    average, max 8.3% on the one PP2 row). The spread within each group is wider than the gap
    between the groups' medians and the probe's 18.9% full-recompute row exceeds 10%, so these
    stay an upper-side planning margin rather than a fit (benchmarks/results/memory_accuracy.txt).
    """
    if expandable_segments:
        return 0.01
    return 0.10 if pipelined_or_full_recompute else 0.04


# ---------------------------------------------------------------------------------------------
# Result types
# ---------------------------------------------------------------------------------------------


class StageMemory(BaseModel):
    """One pipeline rank's memory (bytes), as `MemoryBreakdown` reports it for the whole plan."""

    model_config = ConfigDict(frozen=True)

    pipeline_rank: int
    role: Literal["only", "first", "middle", "last"]
    num_layers: int = Field(description="Decoder layers on this rank (all its model chunks).")
    in_flight_microbatches: float = Field(description="Microbatches whose activations are held at the peak (model chunks / VP when interleaved).")
    num_params: int = Field(description="Parameters held by this rank after TP/PP/EP sharding.")
    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float = Field(description="Saved activations of all in-flight microbatches.")
    transient_bytes: float = Field(description="Largest temporary live at the forward/backward peak (logits/loss, layer working set, recompute).")
    buffers_bytes: float = Field(description="Persistent Megatron buffers (global memory buffer) and cuBLAS workspace.")
    optimizer_step_transient_bytes: float = Field(description="Temporaries of the optimizer step (a separate candidate peak).")
    peak_allocated_bytes: float

    @property
    def peak_allocated_gib(self) -> float:
        return self.peak_allocated_bytes / GIB


class MemoryBreakdown(BaseModel):
    """Per-GPU memory of a plan on its most-loaded rank (bytes and GiB = 2^30 B)."""

    model_config = ConfigDict(frozen=True)

    most_loaded_pipeline_rank: int
    most_loaded_role: Literal["only", "first", "middle", "last"]
    weights_gib: float = Field(description="bf16 parameters (+ FP8 copies/transposes TE keeps) on the most-loaded rank.")
    gradients_gib: float = Field(description="DDP gradient buffer: 4 B/param with grad_reduce_in_fp32 else 2.")
    optimizer_gib: float = Field(description="fp32 main params + Adam m, v: 12 B/param, sharded over DP*CP (experts over expert-DP) with the distributed optimizer.")
    activations_gib: float = Field(description="Activations saved by all in-flight microbatches at the peak.")
    transient_gib: float = Field(description="Largest temporary at the peak: logits/cross-entropy, backward working set, recompute working set.")
    buffers_gib: float = Field(description="Persistent buffers inside PyTorch's allocator (Megatron global memory buffer, cuBLAS workspace).")
    optimizer_step_transient_gib: float = Field(description="Optimizer-step temporaries (torch Adam foreach, fp32 grad copies).")
    peak_phase: Literal["forward_backward", "optimizer_step"]
    peak_allocated_gib: float = Field(description="Predicted torch.cuda.max_memory_allocated() on the most-loaded rank.")
    fragmentation_gib: float = Field(description="Allocator margin: reserved - allocated (empirical allowance).")
    peak_reserved_gib: float = Field(description="Predicted torch.cuda.max_memory_reserved().")
    non_pytorch_gib: float = Field(description="CUDA context + NCCL buffers, outside PyTorch's allocator statistics.")
    total_gib: float = Field(description="peak_reserved + non_pytorch: what must fit in the GPU.")
    capacity_gib: float = Field(description="Usable GPU memory (cluster.gpu_memory_gib or the catalog's total capacity).")
    fits: bool
    headroom_gib: float = Field(description="capacity - total; negative when it does not fit.")
    stages: list[StageMemory] = Field(description="The distinct pipeline ranks evaluated: first, rank 1 (most-loaded middle), rank PP-2 (least-loaded middle), last.")
    assumptions: list[str] = Field(description="Choices the plan does not pin down, stated so a user can check them.")

    @property
    def least_loaded_peak_gib(self) -> float:
        return min(s.peak_allocated_bytes for s in self.stages) / GIB


# ---------------------------------------------------------------------------------------------
# Activations per layer (plain numbers; the fast path the recommender can call in loops)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ActivationOptions:
    """Implementation facts that decide which tensors a layer's forward keeps for backward."""

    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    transformer_impl: Literal["transformer_engine", "local"] = "transformer_engine"
    unfused_attention: bool = False
    fp8: bool = False
    fused_activation: bool = True
    attention_softmax_in_fp32: bool = True
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    recompute_modules: frozenset[str] = frozenset()
    ep: int = 1
    etp: int = 1
    moe_token_imbalance: float = 1.0


def layer_activation_terms(shape: ModelShape, seq_length: int, micro_batch_size: int, moe_layer: bool,
                           o: ActivationOptions) -> dict[str, float]:
    """Bytes one decoder layer saves for backward, per microbatch, on one rank, by tensor group.

    Derivation (Megatron-Core forward, which tensors autograd keeps):
    - norm inputs: each pre-norm saves its input (2 B/elem, h wide) + fp32 stats; with SP /t.
    - GEMM inputs: the QKV and fc1 linears save their input (the norm output); with SP only the
      local shard is kept and re-gathered in backward (Megatron `LinearWithGradAccumulation...`,
      TE `_LayerNormLinear`); FP8 keeps a 1-byte copy.
    - attention: see module docstring (QKV output, RoPE q/k, flash output or s x s scores).
    - proj input = attention output (flash: the same tensor; unfused: a contiguous copy).
    - dropout masks: 1 B/elem bool per dropout with p > 0.
    - MLP: activation input (2f-wide for SwiGLU) + fc2 input (f wide, FP8 1 byte) (+ silu output
      when the SwiGLU is not fused).
    - MoE: router logits/probs (E per token), dispatched tokens (k per token) as fc1 input,
      expert activations, and the expert outputs the unpermute keeps for the prob gradient.
    """
    h, n = shape.hidden_size, shape.num_attention_heads
    t, cp = o.tp, o.cp
    s_local = seq_length / cp
    tok = s_local * micro_batch_size  # tokens of one microbatch on this rank
    sp_div = t if o.sequence_parallel and t > 1 else 1
    gemm_in = 1.0 if o.fp8 else 2.0
    rec = o.recompute_modules
    terms: dict[str, float] = {}

    norm_stats = (8.0 if shape.normalization == "LayerNorm" else 4.0) * tok / sp_div
    terms["norm_inputs"] = 2 * (2.0 * h * tok / sp_div + norm_stats)
    # 'layernorm' recompute drops the norm outputs (recomputed from the saved norm inputs).
    terms["norm_outputs"] = 0.0 if "layernorm" in rec else 2 * gemm_in * h * tok / sp_div

    a_local = n / t
    if shape.multi_latent_attention:
        d_qk, d_r, d_v = shape.qk_head_dim, shape.qk_pos_emb_head_dim, shape.v_head_dim
        r_q, r_kv = shape.q_lora_rank or 0, shape.kv_lora_rank
        # Down projections and their norms are replicated over TP (not SP-sharded once gathered);
        # up projections are column-parallel. q/k get RoPE'd copies; v is made contiguous.
        down = 2.0 * tok * (2 * r_q + (r_kv + d_r) + r_kv)
        up = 0.0 if "mla_up_proj" in rec else 2.0 * tok * n * ((d_qk + d_r) + (d_qk + d_v)) / t
        qkv_final = 2.0 * tok * n * (2 * (d_qk + d_r) + d_v) / t
        terms["qkv"] = down + up + qkv_final
        v_width = n * d_v
    else:
        d, g = shape.kv_channels, shape.num_query_groups
        q, kv = n * d, g * d
        rope = shape.position_embedding_type == "rope"
        if o.transformer_impl == "local" or not rope:
            # Local spec: the attention matmul saves v, a view of the QKV GEMM output, which keeps
            # the whole (q + 2kv)-wide tensor alive; RoPE adds new q and k tensors.
            terms["qkv"] = 2.0 * tok * (q + 2 * kv) / t + (2.0 * tok * (q + kv) / t if rope else 0.0)
        elif "core_attn" in rec:
            # TE + selective core_attn: Megatron's CheckpointFunction (tensor_parallel/random.py,
            # `ctx.save_for_backward(*args)`) keeps q, k, v exactly as attention.py's
            # _checkpointed_attention_forward passes them: the RoPE'd q and k, and v, a view of the
            # QKV GEMM output, which so stays alive whole. TE's contiguous v copy (get_qkv_layout)
            # is made under no_grad and dropped. So selective costs 2*(q + kv) B/token more here
            # than the TE branch below, minus the fp32 softmax statistics it no longer saves:
            # measured 54.74 vs 51.76 GiB for GPT 1.3B mbs 8 (benchmarks/results).
            terms["qkv"] = 2.0 * tok * (q + kv) / t + 2.0 * tok * (q + 2 * kv) / t
        else:
            # TE: RoPE writes q, k; TE's get_qkv_layout finds the strided v 'not_supported' and
            # makes q, k, v contiguous (a copy of v only); FusedAttention saves those, so the QKV
            # GEMM output is freed.
            terms["qkv"] = 2.0 * tok * (q + 2 * kv) / t
        v_width = q

    core_recomputed = "core_attn" in rec
    if o.unfused_attention and not core_recomputed:
        scores = a_local * micro_batch_size * s_local * seq_length
        probs = (4.0 + 2.0) if o.attention_softmax_in_fp32 else 2.0
        if o.attention_dropout > 0:
            # Dropout keeps its bool mask and output; the pre-dropout bf16 copy is then not saved.
            probs = (4.0 if o.attention_softmax_in_fp32 else 2.0) + 1.0 + 2.0
        terms["attention_scores"] = probs * scores
        terms["attention_output"] = 2.0 * tok * v_width / t  # contiguous context = proj input
    elif o.unfused_attention or core_recomputed:
        terms["attention_scores"] = 0.0
        terms["attention_output"] = gemm_in * tok * v_width / t
    else:
        # Flash/fused: the output is saved by the attention and is the proj input (FP8 adds the
        # 1-byte copy TE's Linear keeps); fp32 log-sum-exp per head and token.
        terms["attention_scores"] = 4.0 * a_local * tok
        terms["attention_output"] = 2.0 * tok * v_width / t + (1.0 * tok * v_width / t if o.fp8 else 0.0)

    masks = 0.0
    if o.hidden_dropout > 0:
        masks += 2 * 1.0 * h * tok / sp_div  # after attention and after MLP (bias-dropout-add)
    terms["dropout_masks"] = masks

    f_mult = 2 if shape.swiglu else 1
    if moe_layer and shape.num_experts:
        E, k, f_e = shape.num_experts, shape.moe_router_topk, shape.moe_ffn_hidden_size
        etp = o.etp
        # MoE needs SP with TP > 1: the router sees the local tokens.
        tok_moe = tok / t
        terms["moe_router"] = (2.0 + 4.0 + 4.0 + 1.0) * E * tok_moe  # bf16 logits, fp32 scores+probs, routing map
        # Tokens this rank's experts process: k copies of each local token on average (EP
        # exchanges them evenly), gathered over ETP ranks; x imbalance for skewed routing.
        n_e = tok_moe * k * etp * o.moe_token_imbalance
        terms["moe_dispatched_tokens"] = gemm_in * h * n_e
        if "moe" in rec:
            act = 0.0
        else:
            # 'moe_act' recompute reruns the activation: its output (the fc2 input) is not kept.
            act_in = 2.0 * f_mult * f_e * n_e / etp
            fc2_in = 0.0 if "moe_act" in rec else gemm_in * f_e * n_e / etp
            silu = 0.0 if o.fused_activation or not shape.swiglu else 2.0 * f_e * n_e / etp
            act = act_in + fc2_in + silu
        terms["moe_expert_activations"] = act
        # moe_unpermute keeps the expert outputs to form the gradient of the routing probs.
        terms["moe_combine"] = 2.0 * h * tok_moe * k * o.moe_token_imbalance
        f_sh = shape.moe_shared_expert_intermediate_size
        if f_sh and "shared_experts" not in rec:
            terms["mlp_activations"] = _mlp_bytes(f_sh, f_mult, tok, t, gemm_in, o.fused_activation)
        else:
            terms["mlp_activations"] = 0.0
    else:
        terms["mlp_activations"] = 0.0 if "mlp" in rec else _mlp_bytes(shape.ffn_hidden_size, f_mult, tok, t, gemm_in, o.fused_activation)
    return terms


def _mlp_bytes(f: int, f_mult: int, tok: float, t: int, gemm_in: float, fused: bool) -> float:
    # Activation input (fc1 output, f_mult*f wide) + fc2 input (f wide) + unfused silu output.
    act_in = 2.0 * f_mult * f * tok / t
    fc2_in = gemm_in * f * tok / t
    silu = 2.0 * f * tok / t if (f_mult == 2 and not fused) else 0.0
    return act_in + fc2_in + silu


def layer_backward_working_bytes(shape: ModelShape, seq_length: int, micro_batch_size: int, moe_layer: bool,
                                 o: ActivationOptions, saved: dict[str, float]) -> float:
    """Temporaries of one layer's backward on top of what is saved: gradient tensors in flight,
    the SP all-gather of a GEMM input for its weight gradient, the largest bf16 weight-gradient
    tensor (no gradient-accumulation fusion), and for unfused attention the fp32
    softmax backward (grad in, grad out and the saved output live together: 12 B/score at the
    softmax backward vs 6 saved, while the layer's MLP tensors are already freed).
    """
    h = shape.hidden_size
    t = o.tp
    tok = seq_length / o.cp * micro_batch_size
    sp_div = t if o.sequence_parallel and t > 1 else 1
    f_mult = 2 if shape.swiglu else 1
    if moe_layer and shape.num_experts:
        f_w = shape.moe_ffn_hidden_size * shape.moe_router_topk * o.etp / t
    else:
        f_w = shape.ffn_hidden_size
    grads = 2.0 * tok * (f_mult * f_w + f_w) / t + 3 * 2.0 * h * tok / sp_div
    gather = 2.0 * h * tok if sp_div > 1 else 0.0
    # Without gradient-accumulation fusion (it needs Apex; TE-on-gpu.md: Megatron runs here with
    # --no-gradient-accumulation-fusion) each weight gradient is a bf16 tensor added to main_grad.
    wgrad = 2.0 * h * max(f_mult * shape.ffn_hidden_size, 3 * h) / t
    extra = grads + gather + wgrad
    if o.unfused_attention and "core_attn" not in o.recompute_modules:
        scores = saved.get("attention_scores", 0.0)
        coef = (12.0 / 6.0) if o.attention_softmax_in_fp32 else 2.0
        freed = saved.get("mlp_activations", 0.0) + saved.get("attention_output", 0.0)
        extra = max(extra, scores * (coef - 1.0) - freed + grads)
    return extra


# ---------------------------------------------------------------------------------------------
# Parameters per pipeline rank
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankParams:
    dense: float  # non-expert params held by this rank (after TP)
    expert: float  # routed-expert params held by this rank (after EP x ETP)
    fp8_eligible: float  # linear weights inside transformer layers (TE casts these to FP8)


def rank_params(shape: ModelShape, layers: list[int], *, first: bool, last: bool, tp: int, ep: int, etp: int,
                seq_length: int) -> RankParams:
    """Parameters on one pipeline rank holding decoder `layers` (global indices).

    TP shards attention, dense MLP, shared experts, the embedding and the output layer (vocab
    padded to make_vocab_size_divisible_by * TP); norms and the router are replicated; routed
    experts are split over EP and each expert over ETP. With tied embeddings and PP > 1 the last
    stage holds its own copy of the word embedding for the output layer (Megatron
    `setup_embeddings_and_output_layer`), which the optimizer also updates.
    """
    h = shape.hidden_size
    V = shape.padded_vocab_size(tp)
    attn = attention_params_per_layer(shape)
    dense_mlp = mlp_params(shape, shape.ffn_hidden_size)
    norms = 2 * norm_params(shape, shape.hidden_size)
    E = shape.num_experts or 0
    expert = mlp_params(shape, shape.moe_ffn_hidden_size) if E else 0
    shared = mlp_params(shape, shape.moe_shared_expert_intermediate_size) if E and shape.moe_shared_expert_intermediate_size else 0
    router = h * E if E else 0
    n_moe = sum(shape.moe_layer_pattern[i] for i in layers) if E else 0
    n_dense = len(layers) - n_moe
    dense = (attn * len(layers) + dense_mlp * n_dense + shared * n_moe) / tp + norms * len(layers) + router * n_moe
    fp8_eligible = (attn * len(layers) + dense_mlp * n_dense + shared * n_moe) / tp
    experts = E * expert * n_moe / (ep * etp)
    fp8_eligible += experts
    if first:
        dense += V * h / tp
        if shape.position_embedding_type == "learned_absolute":
            dense += seq_length * h
    if last:
        dense += norm_params(shape, shape.hidden_size)
        single_stage = first
        if shape.untie_embeddings_and_output_weights or not single_stage:
            dense += V * h / tp
        if shape.mtp_num_layers:
            last_moe = bool(E) and shape.moe_layer_pattern[-1] == 1
            mtp_layer = attn / tp + norms + ((shared / tp + router) if last_moe else dense_mlp / tp)
            mtp_extra = 2 * h * h / tp + 3 * norm_params(shape, shape.hidden_size)
            dense += shape.mtp_num_layers * (mtp_layer + mtp_extra)
            if last_moe:
                experts += shape.mtp_num_layers * E * expert / (ep * etp)
    return RankParams(dense=dense, expert=experts, fp8_eligible=fp8_eligible)


def _stage_layers(num_layers: int, pp: int, vp: int, rank: int,
                  first: int | None = None, last: int | None = None) -> list[int]:
    """Global layer indices on a pipeline rank (interleaved chunks: chunk v of rank r is model chunk v*pp + r).

    Even split unless decoder_first/last_pipeline_num_layers are set (schemas.layers_per_stage);
    each stage's layers divide evenly over its vp chunks. With a remainder (a split the
    validators reject) the extra layers go to the first chunks.
    """
    chunks = pp * vp
    try:
        per_stage = layers_per_stage(num_layers, pp, first, last) if pp > 1 else [num_layers]
    except ValueError:
        per_stage = None
    if per_stage is not None and (first is not None or last is not None):
        sizes = [0] * chunks
        for r, n in enumerate(per_stage):
            base, rem = divmod(n, vp)
            for v in range(vp):
                sizes[v * pp + r] = base + (1 if v < rem else 0)
    else:
        base, rem = divmod(num_layers, chunks)
        sizes = [base + (1 if c < rem else 0) for c in range(chunks)]
    starts = [0]
    for sz in sizes[:-1]:
        starts.append(starts[-1] + sz)
    out: list[int] = []
    for v in range(vp):
        c = v * pp + rank
        out.extend(range(starts[c], starts[c] + sizes[c]))
    return out


def in_flight_microbatches(pp: int, vp: int, rank: int, num_microbatches: int) -> float:
    """Microbatches of activations a rank holds at its peak, in units of its whole layer set.

    1F1B: min(PP - rank, M). Interleaved: min(2*(PP - rank - 1) + (VP - 1)*PP + 1, M*VP) model
    chunks, i.e. that many / VP microbatches of the rank's layers (Megatron
    `forward_backward_pipelining_with_interleaving`, microbatch_group_size_per_vp_stage = PP).
    """
    if pp == 1:
        return 1.0
    if vp > 1:
        chunks = min(2 * (pp - rank - 1) + (vp - 1) * pp + 1, num_microbatches * vp)
        return chunks / vp
    return float(min(pp - rank, num_microbatches))


# ---------------------------------------------------------------------------------------------
# The breakdown
# ---------------------------------------------------------------------------------------------


def _is_unfused(attention_backend: str) -> bool:
    """Only Megatron's own DotProductAttention ('local') and TE's unfused path store the s x s scores.

    'auto'/'flash'/'fused' use a flash-type kernel: TE's with the TE spec, torch SDPA swapped into
    the local spec by the profile job (launcher/entry/sdpa.py), as the schema documents.
    """
    return attention_backend in ("unfused", "local")


def te_dummy_wgrad_bytes(shape: ModelShape, tp: int, etp: int, *, has_dense: bool, has_moe: bool,
                         output_vocab: int | None = None) -> float:
    """With gradient-accumulation fusion TE returns a cached bf16 dummy weight gradient per distinct
    local weight shape (get_dummy_wgrad); Megatron's output layer (fused with Apex) takes one too,
    [output_vocab / tp, h], when the rank holds it. Measured on H200: +96 MiB on GPT 1.3B (qkv, proj,
    fc1, fc2 at TP1) and +75 MiB on GPT 2.7B at TP2, exactly."""
    lw = linear_weights(shape)
    blocks = [(lw["attention"], tp)]
    if has_dense:
        blocks.append((lw["mlp"], tp))
    if has_moe:
        blocks += [(lw["expert"], etp), (lw["shared_expert"], tp)]
    shapes = {(r // t if split == 0 else r, c // t if split == 1 else c) for weights, t in blocks for r, c, split in weights}
    if output_vocab:
        shapes.add((output_vocab // tp, shape.hidden_size))
    return 2.0 * sum(r * c for r, c in shapes)


def memory_breakdown(plan: Plan, *, cross_entropy_fusion_impl: Literal["native", "te"] | None = None,
                     output_layer_wgrad_fusion: bool | None = None) -> MemoryBreakdown:
    """Per-GPU memory on the most-loaded rank of `plan` (see the module docstring for definitions).

    `output_layer_wgrad_fusion` None follows the plan's gradient_accumulation_fusion, as Megatron-LM
    does (its own output layer then needs Apex); False = only the TE layers fuse (this project's profile
    job on a machine without Apex).

    `cross_entropy_fusion_impl` overrides the plan's implementation.cross_entropy_fusion_impl
    (Megatron's --cross-entropy-fusion-impl); it matters only with cross_entropy_loss_fusion. See
    `cross_entropy_peak_bytes_per_logit` for what each implementation holds at the loss.
    Raises KeyError/ValueError (naming the plan field) for an unknown model or GPU.
    """
    shape = resolve_model(plan.model)
    dims = parallel_dims(plan)
    tr, par, im = plan.training, plan.parallelism, plan.implementation
    g = gpu(plan.cluster.gpu)
    capacity = plan.cluster.gpu_memory_gib or g.hbm_capacity_gib
    tp, pp, vp, cp = dims.tp, dims.pp, dims.vp, dims.cp
    s, b = tr.seq_length, tr.micro_batch_size
    M = max(1, tr.global_batch_size // (b * dims.dp))
    fp8 = tr.precision == "fp8"
    sp = par.sequence_parallel and tp > 1
    unfused = _is_unfused(im.attention_backend)
    if cross_entropy_fusion_impl is None:
        cross_entropy_fusion_impl = im.cross_entropy_fusion_impl
    assumptions: list[str] = [
        "dropout 0 (hidden and attention), as modern LLM recipes use",
        "fused bias-activation (Megatron-LM default); local spec: torch softmax and torch AdamW (foreach); "
        "TE spec: TE FusedAdam",
        ("gradient-accumulation fusion (Megatron's default; Apex for the output layer): TE keeps one bf16 dummy "
         "weight gradient per distinct weight shape" if im.gradient_accumulation_fusion and im.transformer_impl == "transformer_engine"
         else "no gradient-accumulation fusion: each bf16 weight gradient is a transient before main_grad.add_"),
        "cross entropy: "
        + (f"fused, {cross_entropy_fusion_impl} implementation" if im.cross_entropy_loss_fusion else "unfused (vocab_parallel_cross_entropy)")
        + f" ({cross_entropy_peak_bytes_per_logit(im.cross_entropy_loss_fusion, cross_entropy_fusion_impl):g} B/logit at the loss)",
    ]

    rec_modules: set[str] = set()
    full = par.recompute_granularity == "full"
    if par.recompute_granularity == "selective":
        rec_modules = set(par.recompute_modules or ["core_attn"])
    opts = ActivationOptions(
        tp=tp, cp=cp, sequence_parallel=sp, transformer_impl=im.transformer_impl, unfused_attention=unfused,
        fp8=fp8, fused_activation=True,
        recompute_modules=frozenset(rec_modules), ep=dims.ep, etp=dims.etp,
    )
    if unfused:
        assumptions.append("attention_softmax_in_fp32 = True (TransformerConfig default): 6 B per attention score saved")

    dense_terms = layer_activation_terms(shape, s, b, False, opts)
    dense_layer = sum(dense_terms.values())
    dense_work = layer_backward_working_bytes(shape, s, b, False, opts, dense_terms)
    if shape.is_moe:
        moe_terms = layer_activation_terms(shape, s, b, True, opts)
        moe_layer = sum(moe_terms.values())
        moe_work = layer_backward_working_bytes(shape, s, b, True, opts, moe_terms)
    else:
        moe_layer, moe_work = dense_layer, dense_work

    tok = s / cp * b
    sp_div = tp if sp else 1
    h = shape.hidden_size
    V = shape.padded_vocab_size(tp)
    ckpt_input = 2.0 * h * tok / sp_div  # a checkpointed layer input (full recompute)

    grad_bytes = 4.0 if im.grad_reduce_in_fp32 else 2.0
    dp_opt = dims.dp * cp
    fsdp = im.use_torch_fsdp2
    fused_dummies = im.gradient_accumulation_fusion and im.transformer_impl == "transformer_engine" and not fsdp
    out_fused = fused_dummies and output_layer_wgrad_fusion is not False
    if fsdp:
        assumptions.append("FSDP: params, grads and optimizer state sharded over DP*CP; 2 layers unsharded in flight (coarse)")
    # Ranks to evaluate: first; rank 1, the middle rank holding the most in flight (the most-loaded
    # middle); rank PP-2, holding the fewest (the least-loaded middle, for the imbalance); last.
    ranks = sorted({0, min(1, pp - 1), max(0, pp - 2), pp - 1})
    stages: list[StageMemory] = []
    for r in ranks:
        layers = _stage_layers(shape.num_layers, pp, vp, r, par.decoder_first_pipeline_num_layers,
                               par.decoder_last_pipeline_num_layers)
        first, last = r == 0, r == pp - 1
        rp = rank_params(shape, layers, first=first, last=last, tp=tp, ep=dims.ep, etp=dims.etp, seq_length=s)
        n_params = rp.dense + rp.expert
        # --- model state
        weights = 2.0 * n_params
        if fp8 and not tr.fp8_param_gather:
            # TE caches the FP8 weight and its transpose for all microbatches of a step (with
            # --fp8-param-gather the FP8 param (1 B) and its transpose (1 B) replace the bf16 copy).
            weights += 2.0 * rp.fp8_eligible * (1.0 + (1 / 16 if tr.fp8_recipe == "mxfp8" else 0.0))
        grads = grad_bytes * n_params
        if par.use_distributed_optimizer and not fsdp:
            optim = 12.0 * rp.dense / dp_opt + 12.0 * rp.expert / max(1, dims.expert_dp)
        else:
            optim = 12.0 * n_params
        if fsdp:
            weights, grads, optim = weights / dp_opt, grads / dp_opt, 12.0 * n_params / dp_opt
            layer_params = n_params / max(1, len(layers))
            weights += 2 * 2.0 * layer_params
            grads += 2 * grad_bytes * layer_params
        # --- optimizer step temporaries
        opt_held = (rp.dense / dp_opt + rp.expert / max(1, dims.expert_dp)) if (par.use_distributed_optimizer or fsdp) else n_params
        step_tmp = 0.0
        if im.transformer_impl == "local":
            step_tmp += 4.0 * opt_held  # torch _multi_tensor_adam: sqrt(v) temporary per param group
        if not im.grad_reduce_in_fp32:
            step_tmp += 4.0 * opt_held  # fp32 copies of bf16 grads for the main params
        # --- activations
        n_moe = sum(shape.moe_layer_pattern[i] for i in layers) if shape.is_moe else 0
        n_dense = len(layers) - n_moe
        per_mb_full = n_dense * dense_layer + n_moe * moe_layer
        work = max(dense_work if n_dense else 0.0, moe_work if n_moe else 0.0)
        if full:
            per_chunk = max(1, len(layers) // vp)
            R = par.recompute_num_layers or 1
            if par.recompute_method == "block":
                rec_per_chunk = min(R, per_chunk)
                saved = vp * (rec_per_chunk * ckpt_input + (per_chunk - rec_per_chunk) * per_mb_full / max(1, len(layers)))
                recompute_ws = per_mb_full / max(1, len(layers)) * 1 + work
            else:
                groups = math.ceil(per_chunk / R)
                saved = vp * groups * ckpt_input
                recompute_ws = per_mb_full / max(1, len(layers)) * min(R, per_chunk) + work
            per_mb = saved
            work = recompute_ws
        else:
            per_mb = per_mb_full
        if first:
            per_mb += 16.0 * tok  # token and position ids kept for the embedding backward
        infl = in_flight_microbatches(pp, vp, r, M)
        acts = infl * per_mb
        transient = work
        if last:
            acts += 2.0 * h * tok / sp_div * 2 + 12.0 * tok  # final norm input + output-layer input; labels, mask
            logits = 2.0 * V * tok / tp
            te_ce = im.cross_entropy_loss_fusion and cross_entropy_fusion_impl == "te"
            ce_peak = cross_entropy_peak_bytes_per_logit(im.cross_entropy_loss_fusion, cross_entropy_fusion_impl) / 2.0 * logits
            # bf16 output-layer weight gradient before main_grad.add_ (a cached dummy when fused)
            out_wgrad = 0.0 if out_fused else 2.0 * V * h / tp
            bwd_peak = logits + out_wgrad + 2.0 * h * tok
            n_heads_out = 1 + shape.mtp_num_layers
            transient = max(transient, ce_peak * 1.0 + (n_heads_out - 1) * (logits if te_ce else 2.0 * logits), bwd_peak)
            if shape.mtp_num_layers:
                acts += shape.mtp_num_layers * (moe_layer if shape.is_moe and shape.moe_layer_pattern[-1] else dense_layer)
        buffers = float(MISC_ALLOCATED_BYTES)
        if fused_dummies:
            buffers += te_dummy_wgrad_bytes(shape, tp, dims.etp, has_dense=n_dense > 0, has_moe=n_moe > 0,
                                            output_vocab=V if last and out_fused else None)
        if im.transformer_impl == "local":
            # Megatron's global memory buffer ("mpu"): the unfused attention's baddbmm input
            # [b*n/t, s, s] bf16 and the SP all-gather buffer share one name, sized by the larger.
            gbuf = 0.0
            if unfused:
                gbuf = 2.0 * (shape.num_attention_heads / tp) * b * (s / cp) * s
            if sp:
                gbuf = max(gbuf, 2.0 * h * tok)
            buffers += gbuf
        static = weights + grads + optim + buffers
        fb_peak = static + acts + transient
        step_peak = static + step_tmp
        stages.append(StageMemory(
            pipeline_rank=r,
            role="only" if pp == 1 else ("first" if first else ("last" if last else "middle")),
            num_layers=len(layers),
            in_flight_microbatches=infl,
            num_params=int(round(n_params)),
            weights_bytes=weights, gradients_bytes=grads, optimizer_bytes=optim,
            activations_bytes=acts, transient_bytes=transient, buffers_bytes=buffers,
            optimizer_step_transient_bytes=step_tmp,
            peak_allocated_bytes=max(fb_peak, step_peak),
        ))

    top = max(stages, key=lambda st: st.peak_allocated_bytes)
    peak = top.peak_allocated_bytes
    phase: Literal["forward_backward", "optimizer_step"] = (
        "optimizer_step"
        if top.weights_bytes + top.gradients_bytes + top.optimizer_bytes + top.buffers_bytes + top.optimizer_step_transient_bytes >= peak
        else "forward_backward"
    )
    frag_frac = fragmentation_fraction(expandable_segments=im.expandable_segments, pipelined_or_full_recompute=pp > 1 or full)
    frag = frag_frac * peak
    comms = sum(1 for size in (tp, pp, cp, dims.dp, dims.ep, dims.etp if shape.is_moe else 1) if size > 1)
    if pp > 1:
        comms += 1  # embedding group (first + last stage)
    non_pt = CUDA_CONTEXT_GIB + NCCL_PER_COMMUNICATOR_GIB * comms
    reserved_gib = (peak + frag) / GIB
    total = reserved_gib + non_pt
    return MemoryBreakdown(
        most_loaded_pipeline_rank=top.pipeline_rank,
        most_loaded_role=top.role,
        weights_gib=top.weights_bytes / GIB,
        gradients_gib=top.gradients_bytes / GIB,
        optimizer_gib=top.optimizer_bytes / GIB,
        activations_gib=top.activations_bytes / GIB,
        transient_gib=top.transient_bytes / GIB,
        buffers_gib=top.buffers_bytes / GIB,
        optimizer_step_transient_gib=top.optimizer_step_transient_bytes / GIB,
        peak_phase=phase,
        peak_allocated_gib=peak / GIB,
        fragmentation_gib=frag / GIB,
        peak_reserved_gib=reserved_gib,
        non_pytorch_gib=non_pt,
        total_gib=total,
        capacity_gib=capacity,
        fits=total <= capacity,
        headroom_gib=capacity - total,
        stages=stages,
        assumptions=assumptions,
    )
