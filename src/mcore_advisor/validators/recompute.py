"""Activation recomputation: the combinations Megatron asserts on, ignores, or mis-steps."""

from __future__ import annotations

from ._core import (
    ATTENTION_BACKEND,
    FP8_RECIPE,
    GROUPED_GEMM,
    PP,
    PRECISION,
    RECOMPUTE_GRANULARITY,
    RECOMPUTE_METHOD,
    RECOMPUTE_MODULES,
    RECOMPUTE_NUM_LAYERS,
    TRANSFORMER_IMPL,
    VP,
    Ctx,
    choices,
    divisors,
    nearest,
    rule,
)

AREA = "recompute"

_MOE_MODULES = ("moe", "moe_act", "shared_experts")


def _full(c: Ctx) -> bool:
    return c.recompute_granularity == "full"


def _selective(c: Ctx) -> bool:
    return c.recompute_granularity == "selective"


def selective_modules(c: Ctx) -> tuple[str, ...]:
    # TransformerConfig.__post_init__: recompute_modules None -> ["core_attn"].
    return c.recompute_modules if c.recompute_modules is not None else ("core_attn",)


def _chunk_phrase(c: Ctx) -> str:
    if c.interleaved:
        return f"the {c.layers_per_chunk} layers of each model chunk ({c.shape.num_layers} / PP {c.pp} / VP {c.vp})"
    return f"the {c.layers_per_chunk} layers of each pipeline stage"


@rule(
    "full_recompute_needs_method",
    "error",
    AREA,
    "full recompute needs uniform or block",
    when=lambda c: _full(c) and c.recompute_method is None,
)
def _full_method(c: Ctx):
    # TransformerConfig.__post_init__ raises this message.
    return (
        [RECOMPUTE_METHOD, RECOMPUTE_GRANULARITY],
        'Using recompute_granularity: full so recompute_method must be "block" or "uniform"',
        "set parallelism.recompute_method to uniform (with recompute_num_layers 1 every layer keeps only its "
        "input) or block (recompute the first recompute_num_layers layers of each stage)",
    )


@rule(
    "full_recompute_needs_num_layers",
    "error",
    AREA,
    "full recompute needs recompute_num_layers",
    when=lambda c: _full(c) and c.recompute_num_layers is None,
)
def _full_layers(c: Ctx):
    # TransformerConfig.__post_init__ raises this message.
    per_rank = c.shape.num_layers // c.pp
    return (
        [RECOMPUTE_NUM_LAYERS, RECOMPUTE_GRANULARITY],
        "When using recompute_granularity: full recompute_num_layers must be between 1 and "
        f"num_layers_per_pipeline_rank: {per_rank}",
        f"set parallelism.recompute_num_layers to 1 (uniform: every layer) or up to {c.layers_per_chunk or per_rank} "
        "(block: that many layers per stage)",
    )


@rule(
    "selective_recompute_with_method",
    "error",
    AREA,
    "recompute_method is for full recompute",
    when=lambda c: _selective(c) and c.recompute_method is not None,
)
def _sel_method(c: Ctx):
    # Megatron-LM validate_args asserts (it is not silently ignored).
    return (
        [RECOMPUTE_METHOD, RECOMPUTE_GRANULARITY],
        "recompute method is not yet supported for selective recomputing granularity "
        f"(recompute_method {c.recompute_method})",
        "unset parallelism.recompute_method, or use recompute_granularity full",
    )


@rule(
    "selective_recompute_with_num_layers",
    "error",
    AREA,
    "recompute_num_layers is for full recompute",
    when=lambda c: _selective(c) and c.recompute_num_layers is not None,
)
def _sel_layers(c: Ctx):
    # TransformerConfig.__post_init__ raises this message.
    return (
        [RECOMPUTE_NUM_LAYERS, RECOMPUTE_GRANULARITY],
        "When using recompute_granularity: selective recompute_num_layers must be None.",
        "unset parallelism.recompute_num_layers, or use recompute_granularity full",
    )


@rule(
    "recompute_options_ignored",
    "warning",
    AREA,
    "recompute method/layers without a granularity",
    when=lambda c: (
        c.recompute_granularity is None
        and (c.recompute_method is not None or c.recompute_num_layers is not None)
    ),
)
def _rc_ignored(c: Ctx):
    return (
        [RECOMPUTE_METHOD, RECOMPUTE_NUM_LAYERS, RECOMPUTE_GRANULARITY],
        "recompute_method / recompute_num_layers are ignored: recompute_granularity is unset, so nothing is "
        "recomputed",
        "set parallelism.recompute_granularity full to use them, or unset them",
    )


@rule(
    "recompute_modules_ignored",
    "warning",
    AREA,
    "recompute_modules are for selective recompute",
    when=lambda c: c.recompute_modules is not None and not _selective(c),
)
def _mods_ignored(c: Ctx):
    # TransformerConfig reads recompute_modules only with recompute_granularity selective.
    return (
        [RECOMPUTE_MODULES, RECOMPUTE_GRANULARITY],
        f"recompute_modules {list(c.recompute_modules or ())} are ignored with recompute_granularity "
        f"{c.recompute_granularity}: only selective recompute reads them",
        "set parallelism.recompute_granularity selective, or unset recompute_modules",
    )


@rule(
    "uniform_recompute_not_dividing_chunk",
    "error",
    AREA,
    "uniform recompute groups must tile each chunk",
    when=lambda c: (
        _full(c)
        and c.recompute_method == "uniform"
        and c.recompute_num_layers is not None
        and c.layers_per_chunk > 0
        and c.layers_per_chunk % c.recompute_num_layers != 0
    ),
)
def _uniform(c: Ctx):
    # TransformerBlock._checkpointed_forward ('uniform') checkpoints custom(l, l + n) for l = 0, n,
    # 2n, ... < layers; custom() indexes self.layers[l .. l+n-1], past the end when n does not divide
    # the chunk's layer count (IndexError at the first forward).
    n = c.recompute_num_layers
    return (
        [RECOMPUTE_NUM_LAYERS, RECOMPUTE_METHOD, PP, VP],
        f"recompute_num_layers ({n}) does not divide {_chunk_phrase(c)}: uniform recompute steps through the "
        f"chunk in groups of {n} and indexes past its last layer",
        f"set parallelism.recompute_num_layers to {choices(nearest(n, divisors(c.layers_per_chunk)))}",
    )


@rule(
    "block_recompute_exceeds_chunk",
    "warning",
    AREA,
    "block recompute of more layers than a chunk holds",
    when=lambda c: (
        _full(c)
        and c.recompute_method == "block"
        and c.recompute_num_layers is not None
        and c.layers_per_chunk > 0
        and c.recompute_num_layers > c.layers_per_chunk
    ),
)
def _block(c: Ctx):
    # TransformerBlock._checkpointed_forward ('block') recomputes layers l < recompute_num_layers of
    # each chunk, so any value above the chunk size recomputes all of them.
    return (
        [RECOMPUTE_NUM_LAYERS, RECOMPUTE_METHOD],
        f"recompute_num_layers ({c.recompute_num_layers}) exceeds {_chunk_phrase(c)}: block recompute "
        "recomputes every layer, the same as the chunk size",
        f"set parallelism.recompute_num_layers to at most {c.layers_per_chunk}",
    )


@rule(
    "recompute_mla_up_proj_without_mla",
    "error",
    AREA,
    "mla_up_proj recompute needs MLA",
    when=lambda c: _selective(c) and "mla_up_proj" in selective_modules(c) and not c.shape.multi_latent_attention,
)
def _mla_up(c: Ctx):
    # TransformerConfig.__post_init__ raises this message.
    return (
        [RECOMPUTE_MODULES, "model.multi_latent_attention"],
        "mla_up_proj in recompute_modules is only supported with multi_latent_attention.",
        "remove mla_up_proj from parallelism.recompute_modules",
    )


@rule(
    "recompute_moe_act_needs_grouped_gemm",
    "error",
    AREA,
    "moe_act recompute needs grouped GEMM",
    when=lambda c: _selective(c) and "moe_act" in selective_modules(c) and not c.moe_grouped_gemm,
)
def _moe_act(c: Ctx):
    # TransformerConfig.__post_init__ raises this message.
    return (
        [RECOMPUTE_MODULES, GROUPED_GEMM],
        "moe_act in recompute_modules is only supported with moe_grouped_gemm.",
        "set implementation.moe_grouped_gemm true, or remove moe_act from parallelism.recompute_modules",
    )


@rule(
    "recompute_moe_modules_on_dense",
    "warning",
    AREA,
    "MoE recompute modules on a dense model",
    when=lambda c: _selective(c) and not c.is_moe and any(m in selective_modules(c) for m in _MOE_MODULES),
)
def _moe_dense(c: Ctx):
    present = [m for m in _MOE_MODULES if m in selective_modules(c)]
    return (
        [RECOMPUTE_MODULES],
        f"recompute_modules {present} do nothing on a dense model (no MoE layers)",
        f"remove {choices(present)} from parallelism.recompute_modules",
    )


@rule(
    "fp8_delayed_recompute_modules",
    "error",
    AREA,
    "delayed-scaling FP8 cannot recompute moe_act/layernorm",
    when=lambda c: (
        _selective(c)
        and c.precision == "fp8"
        and c.fp8_recipe == "delayed"
        and any(m in selective_modules(c) for m in ("moe_act", "layernorm"))
    ),
)
def _fp8_delayed(c: Ctx):
    # TransformerConfig.__post_init__ raises this message.
    return (
        [RECOMPUTE_MODULES, FP8_RECIPE, PRECISION],
        "Delayed scaling does not support moe_act and layernorm recompute for fp8.",
        "set training.fp8_recipe to tensorwise (or blockwise), or remove moe_act/layernorm from recompute_modules",
    )


@rule(
    "core_attn_recompute_with_fused_attention",
    "info",
    AREA,
    "core_attn recompute buys little with fused attention",
    when=lambda c: (
        _selective(c)
        and "core_attn" in selective_modules(c)
        and c.transformer_impl == "transformer_engine"
        and c.attention_backend in ("auto", "flash", "fused")
    ),
)
def _core_attn(c: Ctx):
    # TransformerConfig warns: "For fused attention, you have no need to set 'core_attn' to recompute."
    # Flash/cuDNN attention never materialises the s x s scores that selective recompute was made to
    # drop (Korthikanti et al. 2022, 5*a*s^2*b bytes per layer).
    return (
        [RECOMPUTE_MODULES, ATTENTION_BACKEND, TRANSFORMER_IMPL],
        "selective recompute of core_attn saves little: with Transformer Engine's fused/flash attention the "
        "s x s attention scores are never stored (Megatron: 'For fused attention, you have no need to set "
        "core_attn to recompute')",
        "recompute other modules (e.g. mlp, moe_act, layernorm) or drop selective recompute if memory allows",
    )


@rule(
    "mtp_block_recompute_skipped",
    "warning",
    AREA,
    "block recompute skips MTP layers",
    when=lambda c: _full(c) and c.recompute_method == "block" and c.shape.mtp_num_layers > 0,
)
def _mtp_block(c: Ctx):
    # multi_token_prediction.py warns "recompute_method == 'block' is not supported for MTP yet.
    # Skipping recompute."
    return (
        [RECOMPUTE_METHOD, "model.mtp_num_layers"],
        "recompute_method == 'block' is not supported for MTP yet: Megatron skips recompute for the "
        f"{c.shape.mtp_num_layers} MTP layer(s), which keep their full activations",
        "use recompute_method uniform to recompute MTP layers too",
    )


@rule(
    "recompute_gdn_norm_out_without_gated_delta_net",
    "error",
    AREA,
    "gdn_norm_out recompute needs Gated DeltaNet attention",
    # This tool models no experimental_attention_variant, so no plan has Gated DeltaNet layers.
    when=lambda c: _selective(c) and "gdn_norm_out" in selective_modules(c),
)
def _gdn(c: Ctx):
    # TransformerConfig.__post_init__ raises this message.
    return (
        [RECOMPUTE_MODULES],
        "gdn_norm_out in recompute_modules is only supported with experimental_attention_variant='gated_delta_net' "
        "(Gated DeltaNet layers, which this tool does not model)",
        "remove gdn_norm_out from parallelism.recompute_modules",
    )
