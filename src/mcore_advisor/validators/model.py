"""Model shape against the parallel layout: heads, groups, widths, layers, experts, sequence."""

from __future__ import annotations

import math

from mcore_advisor.schemas import mamba_in_proj_width

from ._core import (
    ATTENTION_BACKEND,
    CP,
    EP,
    ETP,
    PP,
    PRECISION,
    SEQ,
    SP,
    TP,
    TRANSFORMER_IMPL,
    VP,
    Ctx,
    choices,
    divisors,
    multiples_around,
    nearest,
    prefer,
    rule,
)
from .layout import account_split_error, account_split_fix, split_conflict

AREA = "model"


def tp_candidates(c: Ctx) -> list[int]:
    """TP degrees this model accepts, narrowed (when possible) to ones that also fit the cluster."""
    s = c.shape
    return prefer(
        divisors(s.num_attention_heads),
        lambda t: s.multi_latent_attention or s.num_query_groups % t == 0 or t % s.num_query_groups == 0,
        lambda t: s.num_dense_layers == 0 or s.ffn_hidden_size % t == 0,
        lambda t: t <= c.gpus_per_node,
        lambda t: c.num_gpus % (t * c.pp * c.cp) == 0,
        lambda t: s.multi_latent_attention or t <= s.num_query_groups,
        lambda t: not s.num_mamba_layers or _mamba_tp_ok(s, t, c.cp),
    )


def _mamba_tp_ok(s, tp: int, cp: int = 1) -> bool:
    """MambaMixer / MambaContextParallel: heads and groups split over TP, heads of a TP rank over CP."""
    heads, groups = s.mamba_num_heads, s.mamba_num_groups
    if heads % tp or groups % tp or (heads // tp) % cp:
        return False
    local_groups = groups // tp
    return (cp % local_groups == 0) if local_groups < cp else (local_groups % cp == 0)


def _tp_fix(c: Ctx) -> str:
    return f"set parallelism.tensor_model_parallel_size to {choices(nearest(c.tp, tp_candidates(c)))}"


@rule(
    "heads_not_divisible_by_tp",
    "error",
    AREA,
    "attention heads split evenly over TP",
    when=lambda c: c.shape.num_attention_heads % c.tp != 0,
)
def _heads_tp(c: Ctx):
    # TransformerConfig.__post_init__ raises exactly this message.
    return (
        [TP, "model.num_attention_heads"],
        f"num_attention_heads ({c.shape.num_attention_heads}) must be a multiple of "
        f"tensor_model_parallel_size ({c.tp})",
        _tp_fix(c),
    )


@rule(
    "query_groups_incompatible_with_tp",
    "error",
    AREA,
    "GQA groups must be a multiple or divisor of TP",
    when=lambda c: (
        not c.shape.multi_latent_attention
        and c.shape.num_query_groups % c.tp != 0
        and c.tp % c.shape.num_query_groups != 0
    ),
)
def _groups_tp(c: Ctx):
    # TransformerConfig.__post_init__ raises exactly this message.
    g = c.shape.num_query_groups
    return (
        [TP, "model.num_query_groups"],
        f"num_query_groups ({g}) must be a multiple or divisor of tensor_model_parallel_size ({c.tp})",
        _tp_fix(c),
    )


@rule(
    "query_groups_replicated_over_tp",
    "warning",
    AREA,
    "TP larger than the number of K/V heads replicates them",
    when=lambda c: (
        not c.shape.multi_latent_attention
        and c.tp > c.shape.num_query_groups
        and c.tp % c.shape.num_query_groups == 0
    ),
)
def _groups_replicated(c: Ctx):
    g = c.shape.num_query_groups
    return (
        [TP, "model.num_query_groups"],
        f"tensor_model_parallel_size ({c.tp}) exceeds num_query_groups ({g}): each K/V head is held by "
        f"{c.tp // g} TP ranks. Recent Megatron-Core gathers and re-slices K/V for this (extra K/V projection "
        "work and communication); Megatron-Core 0.16 accepts the config but fails at model build "
        "(shared/reference/megatron-core-cpu.md)",
        f"set parallelism.tensor_model_parallel_size to at most {g} (e.g. {choices(nearest(g, tp_candidates(c)))})",
    )


@rule(
    "heads_not_divisible_by_query_groups",
    "error",
    AREA,
    "each K/V group serves the same number of query heads",
    when=lambda c: (
        not c.shape.multi_latent_attention and c.shape.num_attention_heads % c.shape.num_query_groups != 0
    ),
)
def _heads_groups(c: Ctx):
    # Megatron-Core Attention: divide(num_attention_heads, num_query_groups) asserts
    # "{n} is not divisible by {g}".
    n, g = c.shape.num_attention_heads, c.shape.num_query_groups
    return (
        ["model.num_query_groups", "model.num_attention_heads"],
        f"num_attention_heads ({n}) is not divisible by num_query_groups ({g})",
        f"set model.num_query_groups to {choices(nearest(g, divisors(n)))}",
    )


@rule(
    "hidden_not_divisible_by_heads",
    "error",
    AREA,
    "kv_channels defaults to hidden/heads",
    when=lambda c: not c.kv_channels_given and c.shape.hidden_size % c.shape.num_attention_heads != 0,
)
def _hidden_heads(c: Ctx):
    # Megatron-LM validate_args: when kv_channels is None it asserts hidden_size % num_attention_heads == 0.
    h, n = c.shape.hidden_size, c.shape.num_attention_heads
    return (
        ["model.hidden_size", "model.num_attention_heads"],
        f"hidden_size ({h}) is not divisible by num_attention_heads ({n}) and kv_channels is unset "
        "(Megatron-LM derives kv_channels = hidden_size / num_attention_heads)",
        f"set model.kv_channels explicitly, or num_attention_heads to {choices(nearest(n, divisors(h)))}",
    )


@rule(
    "ffn_not_divisible_by_tp",
    "error",
    AREA,
    "dense MLP width splits over TP",
    when=lambda c: c.shape.num_dense_layers > 0 and c.shape.ffn_hidden_size % c.tp != 0,
)
def _ffn_tp(c: Ctx):
    # ColumnParallelLinear/RowParallelLinear: megatron.core.utils.divide(ffn_hidden_size, tp)
    # asserts "{ffn} is not divisible by {tp}".
    f = c.shape.ffn_hidden_size
    return (
        [TP, "model.ffn_hidden_size"],
        f"ffn_hidden_size ({f}) is not divisible by tensor_model_parallel_size ({c.tp}): "
        "the MLP's column/row-parallel linears split it evenly",
        _tp_fix(c),
    )


@rule(
    "moe_ffn_not_divisible_by_etp",
    "error",
    AREA,
    "expert MLP width splits over ETP",
    when=lambda c: c.is_moe and c.shape.moe_ffn_hidden_size % c.etp != 0,
)
def _moe_ffn_etp(c: Ctx):
    f = c.shape.moe_ffn_hidden_size
    ok = [d for d in divisors(f) if d <= c.gpus_per_node]
    return (
        [ETP, "model.moe_ffn_hidden_size"],
        f"moe_ffn_hidden_size ({f}) is not divisible by expert_tensor_parallel_size ({c.etp}): "
        "each expert's linears split it evenly",
        f"set parallelism.expert_tensor_parallel_size to {choices(nearest(c.etp, ok))}",
    )


@rule(
    "shared_expert_ffn_not_divisible_by_tp",
    "error",
    AREA,
    "shared-expert MLP width splits over TP",
    when=lambda c: (
        c.is_moe
        and c.shape.moe_shared_expert_intermediate_size > 0
        and c.shape.moe_shared_expert_intermediate_size % c.tp != 0
    ),
)
def _shared_tp(c: Ctx):
    f = c.shape.moe_shared_expert_intermediate_size
    return (
        [TP, "model.moe_shared_expert_intermediate_size"],
        f"moe_shared_expert_intermediate_size ({f}) is not divisible by tensor_model_parallel_size ({c.tp}): "
        "the shared experts are tensor-parallel like a dense MLP",
        _tp_fix(c),
    )


def pp_candidates(c: Ctx) -> list[int]:
    L = c.shape.num_layers
    return prefer(divisors(L), lambda p: c.num_gpus % (c.tp * p * c.cp) == 0)


@rule(
    "layers_not_divisible_by_pp",
    "error",
    AREA,
    "even pipeline stages",
    # A first/last split together with an embedding/loss-aware one is its own error (layout.py).
    when=lambda c: not c.layers_ok and not split_conflict(c),
)
def _layers_pp(c: Ctx):
    # get_num_layers_to_build: "num_layers should be divisible by pipeline_model_parallel_size";
    # with decoder_first/last_pipeline_num_layers the middle stages must share the rest evenly.
    L = c.shape.num_layers
    first, last = c.decoder_first_pipeline_num_layers, c.decoder_last_pipeline_num_layers
    if c.account_for_embedding_in_pipeline_split or c.account_for_loss_in_pipeline_split:
        return account_split_error(c)
    if first is not None or last is not None:
        return (
            [PP, FIRST_STAGE, LAST_STAGE, "model.num_layers"],
            f"num_layers ({L}) minus the first ({first}) and last ({last}) stage layers cannot be split "
            f"evenly over the other stages of pipeline_model_parallel_size {c.pp}",
            _uneven_fix(L, c.pp) or f"set parallelism.pipeline_model_parallel_size to {choices(nearest(c.pp, pp_candidates(c)))}",
        )
    uneven = " or ".join(f for f in (_uneven_fix(L, c.pp), account_split_fix(L, c.pp)) if f)
    fix = f"set parallelism.pipeline_model_parallel_size to {choices(nearest(c.pp, pp_candidates(c)))}"
    return (
        [PP, "model.num_layers"],
        f"num_layers ({L}) should be divisible by pipeline_model_parallel_size ({c.pp})",
        fix + (f", or keep it and {uneven}" if uneven else ""),
    )


FIRST_STAGE = "parallelism.decoder_first_pipeline_num_layers"
LAST_STAGE = "parallelism.decoder_last_pipeline_num_layers"


def uneven_split(num_layers: int, pp: int) -> tuple[int, int] | None:
    """(first, last) stage layers closest to an even split that leave the middle stages equal.

    Lighter first/last stages are what Megatron-LM users pick: they hold the embedding and the loss.
    """
    if pp < 3:
        return None
    per = -(-num_layers // pp)
    for x in range(per, 0, -1):
        rest = num_layers - 2 * x
        if rest > 0 and rest % (pp - 2) == 0 and rest // (pp - 2) >= x:
            return x, x
    return None


def _uneven_fix(num_layers: int, pp: int) -> str | None:
    split = uneven_split(num_layers, pp)
    if split is None:
        return None
    return (f"set parallelism.decoder_first_pipeline_num_layers {split[0]} and "
            f"decoder_last_pipeline_num_layers {split[1]} (middle stages "
            f"{(num_layers - sum(split)) // (pp - 2)} layers each)")


@rule(
    "stage_layers_not_divisible_by_vp",
    "error",
    AREA,
    "even model chunks per stage",
    when=lambda c: c.interleaved and c.layers_ok and not c.chunk_ok,
)
def _stage_vp(c: Ctx):
    # get_num_layers_to_build: "num_layers_per_pipeline_rank {n} should be divisible by vp_size {vp}".
    n = c.layers_per_stage
    ok = [v for v in divisors(n) if v >= 2]
    fix = (
        f"set parallelism.virtual_pipeline_model_parallel_size to {choices(nearest(c.vp, ok))}"
        if ok
        else "unset parallelism.virtual_pipeline_model_parallel_size (one layer per stage cannot be interleaved)"
    )
    return (
        [VP, PP, "model.num_layers"],
        f"num_layers_per_pipeline_rank {n} should be divisible by vp_size {c.vp} "
        f"({c.shape.num_layers} layers / pipeline_model_parallel_size {c.pp})",
        fix,
    )


@rule(
    "expert_parallel_without_experts",
    "error",
    AREA,
    "EP needs an MoE model",
    when=lambda c: c.ep > 1 and not c.num_experts,
)
def _ep_dense(c: Ctx):
    # Megatron-LM validate_args / TransformerConfig: "num_experts must be non None to use expert
    # model parallelism".
    return (
        [EP, "model.num_experts"],
        f"num_experts must be non None to use expert model parallelism (expert_model_parallel_size {c.ep} "
        "on a dense model)",
        "set parallelism.expert_model_parallel_size to 1",
    )


@rule(
    "experts_not_divisible_by_ep",
    "error",
    AREA,
    "experts split evenly over EP",
    when=lambda c: c.num_experts > 0 and c.num_experts % c.ep != 0,
)
def _experts_ep(c: Ctx):
    # Megatron-LM validate_args: "Number of experts should be a multiple of expert model parallel_size."
    E = c.num_experts
    cands = prefer(
        divisors(E),
        lambda e: c.num_gpus % (c.etp * e * c.pp) == 0,
    )
    return (
        [EP, "model.num_experts"],
        f"num_experts ({E}) should be a multiple of expert_model_parallel_size ({c.ep})"
        + (" (EP cannot exceed the number of experts)" if c.ep > E else ""),
        f"set parallelism.expert_model_parallel_size to {choices(nearest(c.ep, cands))}",
    )


@rule(
    "router_topk_exceeds_experts",
    "error",
    AREA,
    "top-k routing needs k experts",
    when=lambda c: c.num_experts > 0 and c.shape.moe_router_topk > c.num_experts,
)
def _topk(c: Ctx):
    return (
        ["model.moe_router_topk", "model.num_experts"],
        f"moe_router_topk ({c.shape.moe_router_topk}) exceeds num_experts ({c.num_experts}): "
        "each token cannot be routed to more experts than exist",
        f"set model.moe_router_topk to at most {c.num_experts}",
    )


def _top1_softmax_after_topk(c: Ctx) -> bool:
    # TransformerConfig.__post_init__'s condition, on the values the script passes: None is Megatron's
    # default (softmax scores, aux_loss balancing, pre-softmax off). A softmax over the one chosen logit
    # is always 1, so the router would get no gradient.
    s = c.shape
    return (
        c.num_experts > 0
        and s.moe_router_topk == 1
        and (s.moe_router_score_function or "softmax") == "softmax"
        and not s.moe_router_pre_softmax
        and (s.moe_router_load_balancing_type or "aux_loss") != "sinkhorn"
    )


@rule(
    "router_top1_needs_pre_softmax",
    "error",
    AREA,
    "top-1 softmax routing needs the softmax before the top-k",
    when=_top1_softmax_after_topk,
)
def _top1_pre_softmax(c: Ctx):
    # Megatron-Core TransformerConfig.__post_init__: "Please use --moe-router-pre-softmax when topk is 1."
    return (
        ["model.moe_router_topk", "model.moe_router_pre_softmax"],
        "Please use --moe-router-pre-softmax when topk is 1: with moe_router_topk 1 and softmax scores, "
        "Megatron-Core's TransformerConfig rejects a softmax taken after the top-k (over one logit it is "
        "always 1 and gives the router no gradient)",
        "set model.moe_router_pre_softmax=true (--moe-router-pre-softmax), or model.moe_router_topk to 2 or more",
    )


@rule(
    "seq_not_divisible_by_2cp",
    "error",
    AREA,
    "load-balanced causal CP splits the sequence in 2*CP chunks",
    when=lambda c: c.cp > 1 and c.seq_length % (2 * c.cp) != 0,
)
def _seq_cp(c: Ctx):
    # Megatron-LM validate_args: "seq-length should be a multiple of 2 * context-parallel-size if
    # context-parallel-size > 1." (each CP rank takes chunks i and 2*CP-1-i to balance causal work).
    step = 2 * c.cp * (c.tp if c.sp_effective else 1)
    cps = prefer(
        [d for d in divisors(c.seq_length // 2) if d >= 2] if c.seq_length % 2 == 0 else [],
        lambda d: c.num_gpus % (c.tp * c.pp * d) == 0,
    )
    fix = f"set training.seq_length to {choices(multiples_around(c.seq_length, step))}"
    if cps:
        fix += f", or context_parallel_size to {choices(nearest(c.cp, cps))}"
    return (
        [SEQ, CP],
        f"seq-length should be a multiple of 2 * context-parallel-size if context-parallel-size > 1 "
        f"(seq_length {c.seq_length}, 2*CP = {2 * c.cp})",
        fix,
    )


@rule(
    "seq_not_divisible_for_sequence_parallel",
    "error",
    AREA,
    "SP splits each CP rank's sequence over TP",
    when=lambda c: (
        c.sp_effective
        and not (c.cp > 1 and c.seq_length % (2 * c.cp) != 0)
        and c.seq_length % (c.cp * c.tp) != 0
    ),
)
def _seq_sp(c: Ctx):
    # tensor_parallel.mappings._split_along_first_dim (scatter_to_sequence_parallel_region) asserts
    # "First dimension of the tensor should be divisible by tensor parallel size".
    step = math.lcm(2 * c.cp if c.cp > 1 else 1, c.cp * c.tp)
    return (
        [SEQ, SP, TP, CP],
        f"with sequence_parallel, seq_length / context_parallel_size ({c.seq_length}/{c.cp}) must be divisible "
        f"by tensor_model_parallel_size ({c.tp}): 'First dimension of the tensor should be divisible by "
        "tensor parallel size'",
        f"set training.seq_length to {choices(multiples_around(c.seq_length, step))}",
    )


@rule(
    "mtp_on_last_stage",
    "info",
    AREA,
    "MTP layers load the last pipeline stage",
    when=lambda c: c.shape.mtp_num_layers > 0 and c.pp > 1,
)
def _mtp_pp(c: Ctx):
    # GPTModel builds the MTP block only where post_process is true (the last pipeline stage, last
    # virtual chunk), next to the output layer.
    n = c.shape.mtp_num_layers
    per = c.layers_per_stage or c.shape.num_layers / c.pp
    return (
        ["model.mtp_num_layers", PP],
        f"the {n} multi-token-prediction layer(s) run on the last pipeline stage, beside its {per:g} decoder "
        f"layers and the output layer: that stage does about {(per + n) / per:.2f}x the transformer work of "
        "the others, which sets the pipeline's pace",
        None,
    )


@rule(
    "mtp_needs_rope",
    "error",
    AREA,
    "MTP supports rope/none position embeddings",
    when=lambda c: c.shape.mtp_num_layers > 0 and c.shape.position_embedding_type not in ("rope", "none"),
)
def _mtp_rope(c: Ctx):
    # Megatron-LM validate_args asserts this for mtp_num_layers.
    return (
        ["model.mtp_num_layers", "model.position_embedding_type"],
        f"Multi-Token Prediction (MTP) is not supported with {c.shape.position_embedding_type} position "
        "embedding type. The supported position embedding types are rope and none.",
        "set model.position_embedding_type to rope, or model.mtp_num_layers to 0",
    )


@rule(
    "mla_needs_transformer_engine",
    "error",
    AREA,
    "MLA's core attention is Transformer Engine's",
    when=lambda c: c.shape.multi_latent_attention and c.transformer_impl == "local",
)
def _mla_local(c: Ctx):
    # megatron-core 0.19.2: MLASelfAttention builds its core attention with k_channels / v_channels (Q/K and V head
    # dims differ), which only TEDotProductAttention takes; the local spec's DotProductAttention raises TypeError at
    # model build (4 x H200, s10: "DotProductAttention.__init__() got an unexpected keyword argument 'k_channels'")
    return (
        ["model.multi_latent_attention", TRANSFORMER_IMPL],
        "multi-latent attention needs Transformer Engine's DotProductAttention: with transformer_impl local "
        "Megatron-Core 0.19 fails at model build (DotProductAttention.__init__() got an unexpected keyword argument "
        "'k_channels')",
        "set implementation.transformer_impl transformer_engine (and install Transformer Engine where the job runs)",
    )


@rule(
    "mla_head_dims_with_flash",
    "warning",
    AREA,
    "MLA's Q/K and V head dims differ",
    when=lambda c: (
        c.shape.multi_latent_attention
        and c.attention_backend == "flash"
        and c.shape.qk_head_dim + c.shape.qk_pos_emb_head_dim != c.shape.v_head_dim
    ),
)
def _mla_flash(c: Ctx):
    s = c.shape
    qk = s.qk_head_dim + s.qk_pos_emb_head_dim
    return (
        [ATTENTION_BACKEND, "model.multi_latent_attention"],
        f"multi-latent attention has Q/K head dim {qk} but V head dim {s.v_head_dim}; FlashAttention-2 needs "
        "equal head dims, so the flash backend may be unavailable (cuDNN fused attention handles it)",
        "set implementation.attention_backend to auto or fused",
    )


@rule(
    "vocab_padded",
    "info",
    AREA,
    "Megatron pads the vocabulary",
    when=lambda c: c.shape.padded_vocab_size(c.tp) != c.shape.vocab_size,
)
def _vocab(c: Ctx):
    # Megatron-LM training/tokenizer _vocab_size_with_padding: round up to make_vocab_size_divisible_by * TP.
    s = c.shape
    m = s.make_vocab_size_divisible_by * c.tp
    padded = s.padded_vocab_size(c.tp)
    return (
        ["model.vocab_size", "model.make_vocab_size_divisible_by", TP],
        f"vocab_size {s.vocab_size} is padded to {padded} (next multiple of make_vocab_size_divisible_by x "
        f"TP = {s.make_vocab_size_divisible_by} x {c.tp} = {m}): {padded - s.vocab_size} extra rows in the "
        "embedding and output layer",
        None,
    )


@rule(
    "seq_length_exceeds_model",
    "warning",
    AREA,
    "training beyond the model's context",
    when=lambda c: c.seq_length_max is not None and c.seq_length > c.seq_length_max,
)
def _seq_max(c: Ctx):
    return (
        [SEQ, "model.seq_length_max"],
        f"seq_length ({c.seq_length}) exceeds the model's trained context ({c.seq_length_max}): "
        "positions past it are out of distribution unless RoPE is rescaled for long-context training",
        f"set training.seq_length to at most {c.seq_length_max}, or extend the context deliberately "
        "(RoPE scaling, long-context data)",
    )


@rule(
    "mamba_heads_not_divisible_by_groups",
    "error",
    AREA,
    "each Mamba B/C group serves the same number of heads",
    when=lambda c: c.shape.num_mamba_layers > 0 and c.shape.mamba_num_heads % c.shape.mamba_num_groups != 0,
)
def _mamba_heads_groups(c: Ctx):
    # MambaMixer asserts "nheads must be evenly divisible by ngroups".
    s = c.shape
    return (
        ["model.mamba_num_heads", "model.mamba_num_groups"],
        f"mamba_num_heads ({s.mamba_num_heads}) must be evenly divisible by mamba_num_groups ({s.mamba_num_groups})",
        f"set model.mamba_num_groups to {choices(nearest(s.mamba_num_groups, divisors(s.mamba_num_heads)))}",
    )


@rule(
    "mamba_heads_not_divisible_by_tp",
    "error",
    AREA,
    "Mamba heads and groups split evenly over TP",
    when=lambda c: c.shape.num_mamba_layers > 0 and (c.shape.mamba_num_heads % c.tp or c.shape.mamba_num_groups % c.tp),
)
def _mamba_tp(c: Ctx):
    # MambaMixer asserts "nheads must be evenly divisble by tp_size" and "ngroups must be evenly
    # divisible by tp_size" (each TP rank holds whole heads and whole B/C groups).
    s = c.shape
    return (
        [TP, "model.mamba_num_heads", "model.mamba_num_groups"],
        f"mamba_num_heads ({s.mamba_num_heads}) and mamba_num_groups ({s.mamba_num_groups}) must both be divisible "
        f"by tensor_model_parallel_size ({c.tp}): each TP rank holds whole Mamba heads and B/C groups",
        _tp_fix(c),
    )


@rule(
    "mamba_heads_not_divisible_by_tp_cp",
    "error",
    AREA,
    "Mamba heads of a TP rank split evenly over CP",
    when=lambda c: (
        c.shape.num_mamba_layers > 0 and c.cp > 1 and c.shape.mamba_num_heads % c.tp == 0
        and c.shape.mamba_num_groups % c.tp == 0 and not _mamba_tp_ok(c.shape, c.tp, c.cp)
    ),
)
def _mamba_cp(c: Ctx):
    # MambaContextParallel (all-to-all CP for Mamba): "nheads must be evenly divisible by tp_size *
    # cp_size", and each CP rank needs whole groups ("ngroups must be evenly divisible by tp_size *
    # cp_size") or a whole share of one ("cp_size must be evenly divisible by ngroups/tp_size").
    s = c.shape
    ok = [d for d in divisors(s.mamba_num_heads // c.tp) if _mamba_tp_ok(s, c.tp, d) and c.num_gpus % (c.tp * c.pp * d) == 0]
    return (
        [CP, TP, "model.mamba_num_heads", "model.mamba_num_groups"],
        f"context_parallel_size ({c.cp}) does not split the {s.mamba_num_heads // c.tp} Mamba heads and "
        f"{s.mamba_num_groups // c.tp} B/C group(s) of each TP rank evenly (Megatron's MambaContextParallel)",
        f"set parallelism.context_parallel_size to {choices(nearest(c.cp, ok or [1]))}",
    )


@rule(
    "hybrid_interleaved_pipeline",
    "error",
    AREA,
    "hybrid models interleave only through '|' pattern segments",
    when=lambda c: c.shape.is_hybrid and c.interleaved,
)
def _hybrid_vp(c: Ctx):
    # select_pipeline_segment (models/hybrid/hybrid_layer_allocation.py): "Virtual pipeline
    # parallelism (vp_stage != None) is not supported when hybrid_layer_pattern has no pipe ('|')
    # separators"; validate_args sets virtual_pipeline_model_parallel_size to None for such patterns.
    return (
        [VP, "model.hybrid_layer_pattern"],
        f"virtual_pipeline_model_parallel_size {c.vp} on a hybrid model: Megatron-LM interleaves hybrid models only "
        "through '|' segments of --hybrid-layer-pattern, which are not modelled here",
        "unset parallelism.virtual_pipeline_model_parallel_size",
    )


@rule(
    "mamba_fp8_in_proj_width",
    "error",
    AREA,
    "FP8 needs the Mamba in_proj width to be a multiple of 16",
    when=lambda c: c.shape.num_mamba_layers > 0 and c.precision == "fp8" and mamba_in_proj_width(c.shape) % 16 != 0,
)
def _mamba_fp8(c: Ctx):
    # MambaMixer asserts this under config.fp8 (FP8 GEMMs need 16-aligned dimensions).
    return (
        [PRECISION, "model.mamba_num_heads", "model.mamba_state_dim", "model.mamba_num_groups"],
        f"For FP8, the innermost dimension of the Mamba layer input projection output tensor must be a multiple of "
        f"16 (2*d_inner + 2*groups*state + heads = {mamba_in_proj_width(c.shape)})",
        "set training.precision to bf16, or Mamba dims whose in_proj width is a multiple of 16",
    )
