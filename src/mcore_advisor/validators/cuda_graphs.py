"""CUDA graphs (--cuda-graph-impl, --cuda-graph-modules): what Megatron-LM 0.19 refuses or cannot capture.

The checks are TransformerConfig.__post_init__'s and validate_args' (megatron/core/transformer/transformer_config.py,
megatron/training/arguments.py), plus one Megatron does not make: a whole layer captured on a dropless MoE model,
whose token dispatcher reads the tokens per expert back to the host inside the layer (a sync a graph cannot hold), and
the local implementation's 'attn' on such a model, which captures the whole layer (knowledge.cuda_graphs).
"""

from __future__ import annotations

from mcore_advisor.knowledge.cuda_graphs import captured_parts, listed_modules
from mcore_advisor.schemas import pads_to_capacity

from ._core import (
    CAPACITY_FACTOR,
    CUDA_GRAPH_IMPL,
    CUDA_GRAPH_MODULES,
    DISPATCHER,
    NAN_CHECKS,
    PAD_TO_CAPACITY,
    RECOMPUTE_GRANULARITY,
    RECOMPUTE_MODULES,
    Ctx,
    rule,
)
from .recompute import selective_modules

AREA = "implementation"


def _per_layer(c: Ctx) -> bool:
    return c.cuda_graph_impl in ("local", "transformer_engine")


def _mods(c: Ctx) -> frozenset[str]:
    return listed_modules(c.cuda_graph_impl, c.cuda_graph_modules)


def _drop_pad(c: Ctx) -> bool:
    return pads_to_capacity(c.moe_expert_capacity_factor, c.moe_pad_expert_input_to_capacity)


@rule(
    "cuda_graph_full_iteration_modules",
    "error",
    AREA,
    "full_iteration captures everything: no modules",
    when=lambda c: c.cuda_graph_impl == "full_iteration" and bool(c.cuda_graph_modules),
)
def _full_modules(c: Ctx):
    return ([CUDA_GRAPH_IMPL, CUDA_GRAPH_MODULES], "cuda_graph_modules must be empty with cuda_graph_impl full_iteration",
            "drop cuda_graph_modules, or use cuda_graph_impl local / transformer_engine to capture parts of each layer")


@rule(
    "cuda_graph_full_iteration_nan_checks",
    "error",
    AREA,
    "a captured iteration cannot read the loss back",
    when=lambda c: c.cuda_graph_impl == "full_iteration" and c.check_for_nan_in_loss_and_grad,
)
def _full_nan(c: Ctx):
    return ([CUDA_GRAPH_IMPL, NAN_CHECKS],
            "cuda_graph_impl full_iteration needs --no-check-for-nan-in-loss-and-grad (validate_args asserts it)",
            "set implementation.check_for_nan_in_loss_and_grad false")


@rule(
    "cuda_graph_moe_modules_dense",
    "error",
    AREA,
    "moe / moe_router graphs need an MoE model",
    when=lambda c: _per_layer(c) and not c.is_moe and bool(_mods(c) & {"moe", "moe_router", "moe_preprocess"}),
)
def _moe_on_dense(c: Ctx):
    return ([CUDA_GRAPH_MODULES], "moe, moe_router and moe_preprocess graphs are only supported for MoE models",
            "list attn and/or mlp, or none for the whole layer")


@rule(
    "cuda_graph_mlp_all_moe",
    "error",
    AREA,
    "an mlp graph needs dense layers",
    when=lambda c: _per_layer(c) and c.is_moe and "mlp" in c.cuda_graph_modules and c.num_moe_layers == c.shape.num_layers,
)
def _mlp_all_moe(c: Ctx):
    return ([CUDA_GRAPH_MODULES], "every layer is MoE, so there is no dense MLP for an 'mlp' graph "
            "(TransformerConfig asserts it)", "list moe_router and moe_preprocess (dropless) or moe (drop-and-pad) instead")


@rule(
    "cuda_graph_moe_and_router",
    "error",
    AREA,
    "moe and moe_router graphs exclude each other",
    when=lambda c: _per_layer(c) and c.is_moe and {"moe", "moe_router"} <= _mods(c),
)
def _moe_and_router(c: Ctx):
    return ([CUDA_GRAPH_MODULES], "cuda_graph_modules must not contain both moe and moe_router",
            "keep moe (drop-and-pad: the whole MoE block) or moe_router + moe_preprocess (dropless)")


@rule(
    "cuda_graph_preprocess_needs_router",
    "error",
    AREA,
    "a moe_preprocess graph needs the moe_router graph",
    when=lambda c: _per_layer(c) and c.is_moe and "moe_preprocess" in _mods(c) and "moe_router" not in _mods(c),
)
def _preprocess_router(c: Ctx):
    return ([CUDA_GRAPH_MODULES], "moe_preprocess is only captured together with moe_router",
            "add moe_router to cuda_graph_modules")


@rule(
    "cuda_graph_moe_needs_drop_pad",
    "error",
    AREA,
    "the MoE block in a graph needs fixed expert shapes",
    when=lambda c: _per_layer(c) and c.is_moe and not _drop_pad(c)
    and "moe" in captured_parts(c.cuda_graph_impl, c.cuda_graph_modules),
)
def _moe_drop_pad(c: Ctx):
    fields = [CUDA_GRAPH_MODULES, CAPACITY_FACTOR, PAD_TO_CAPACITY]
    pad = "or set moe_expert_capacity_factor with moe_pad_expert_input_to_capacity true"
    if c.cuda_graph_impl == "local" and set(c.cuda_graph_modules) & {"attn", "mlp"}:
        return ([CUDA_GRAPH_IMPL, *fields],
                "cuda_graph_impl local gives a layer listed for attn or mlp one graph of its whole forward "
                "(TransformerLayer.create_mcore_cudagraph_manager), MoE block included, whose dropless dispatch reads the "
                "tokens per expert back to the host: the capture fails (measured on one H100, Megatron-Core 0.19.2: "
                "cudaErrorCapturedEvent in the token dispatcher's _maybe_dtoh_and_synchronize)",
                f"use cuda_graph_impl transformer_engine with attn, moe_router and moe_preprocess, {pad}")
    what = "moe in cuda_graph_modules" if c.cuda_graph_modules else "no cuda_graph_modules (the whole layer)"
    return (fields,
            f"{what} captures the MoE block, whose dropless dispatch reads the tokens per expert back to the host "
            "(TransformerConfig: 'moe cuda graph is only supported with drop-padding MoE')",
            f"list attn, moe_router and moe_preprocess instead, {pad}")


@rule(
    "cuda_graph_preprocess_with_sync",
    "error",
    AREA,
    "the alltoall dispatcher's preprocess syncs when tokens may drop",
    when=lambda c: _per_layer(c) and c.is_moe and "moe_preprocess" in _mods(c)
    and c.moe_token_dispatcher_type == "alltoall" and c.moe_expert_capacity_factor is not None and not _drop_pad(c),
)
def _preprocess_sync(c: Ctx):
    return ([CUDA_GRAPH_MODULES, DISPATCHER, CAPACITY_FACTOR],
            "moe_preprocess cannot be captured with the alltoall dispatcher and a capacity factor: its preprocess "
            "copies the dropped counts to the host and syncs", "drop moe_preprocess (keep moe_router), or pad to capacity")


def _whole(c: Ctx) -> bool:
    """TransformerConfig's full_cudagraph: full_iteration, or a per-layer impl with no modules listed."""
    return c.cuda_graph_impl == "full_iteration" or (_per_layer(c) and not c.cuda_graph_modules)


@rule(
    "cuda_graph_full_recompute",
    "error",
    AREA,
    "per-layer CUDA graphs cannot recompute whole layers",
    when=lambda c: _per_layer(c) and c.recompute_granularity == "full",
)
def _full_recompute(c: Ctx):
    return ([CUDA_GRAPH_IMPL, RECOMPUTE_GRANULARITY],
            "full recompute is only supported with full iteration CUDA graph (TransformerConfig asserts it)",
            "use selective recompute, or cuda_graph_impl full_iteration, or no CUDA graphs")


@rule(
    "cuda_graph_moe_recompute_router",
    "error",
    AREA,
    "recomputing the MoE block would cover the router's graph",
    when=lambda c: c.cuda_graph_impl == "transformer_engine" and c.recompute_granularity == "selective"
    and "moe" in selective_modules(c) and "moe_router" in c.cuda_graph_modules,
)
def _moe_recompute_router(c: Ctx):
    return ([RECOMPUTE_MODULES, CUDA_GRAPH_MODULES],
            "moe recompute is not supported with moe_router CUDA graph with --cuda-graph-impl transformer_engine "
            "(TransformerConfig asserts it: a recomputed module must lie inside or outside a graph, not cover one)",
            "recompute moe_act (or shared_experts, layernorm) instead of moe")


def _graphed_recompute_with_dropout(c: Ctx) -> list[str]:
    """The selective modules Megatron refuses to recompute inside a graph with dropout on (graphed recompute cannot draw
    random numbers): core_attn under attention dropout, mlp / moe under hidden dropout."""
    if c.cuda_graph_impl == "none" or c.recompute_granularity != "selective":
        return []
    mods, whole, listed = selective_modules(c), _whole(c), set(c.cuda_graph_modules)
    out = []
    if c.attention_dropout and "core_attn" in mods and (whole or "attn" in listed):
        out.append("core_attn")
    out += [m for m in ("mlp", "moe") if c.hidden_dropout and m in mods and (whole or m in listed)]
    return out


@rule(
    "cuda_graph_recompute_dropout",
    "error",
    AREA,
    "a graphed recompute cannot redraw its dropout",
    when=lambda c: bool(_graphed_recompute_with_dropout(c)),
)
def _recompute_dropout(c: Ctx):
    mods = _graphed_recompute_with_dropout(c)
    return ([RECOMPUTE_MODULES, CUDA_GRAPH_MODULES, "training.attention_dropout", "training.hidden_dropout"],
            f"recomputing {', '.join(mods)} inside a CUDA graph with dropout on: graphed recomputation cannot draw new "
            "random numbers (TransformerConfig: 'dropout is not supported with graphed ... recomputation')",
            f"drop {', '.join(mods)} from recompute_modules, or set the dropout to 0, or leave that part out of the graph")


@rule(
    "cuda_graph_memory_pools",
    "info",
    AREA,
    "the memory estimate has no term for the graphs' pools",
    when=lambda c: c.cuda_graph_impl != "none",
)
def _graph_pools(c: Ctx):
    return ([CUDA_GRAPH_IMPL],
            "the memory estimate leaves out the CUDA graphs' memory pools (static inputs and outputs of every captured "
            "part and micro-batch): on one H100 the graphed runs reserved 0.07-2.86 GiB more than their eager twins "
            "(benchmarks/results/gpu_h100_Z_summary.md), the most with a whole layer or the router graphs of an MoE "
            "model", "keep a few GiB of headroom, or check the peak with run_profile_job")
