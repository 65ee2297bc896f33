"""What Megatron-LM 0.19's CUDA graphs capture of a layer (--cuda-graph-impl, --cuda-graph-modules): one answer for the
step-time model (physics) and the validators."""

from __future__ import annotations

from collections.abc import Iterable

WHOLE_LAYER = frozenset({"attn", "mlp", "moe"})


def listed_modules(impl: str, modules: Iterable[str] | None) -> frozenset[str]:
    """--cuda-graph-modules as Megatron reads the list: the local implementation captures moe_router and
    moe_preprocess together where either is listed (TransformerConfig.__post_init__ adds the other)."""
    mods = frozenset(modules or ())
    if impl == "local" and mods & {"moe_router", "moe_preprocess"}:
        mods |= {"moe_router", "moe_preprocess"}
    return mods


def captured_parts(impl: str, modules: Iterable[str] | None) -> frozenset[str]:
    """The layer parts a CUDA graph captures: the listed modules under 'local' or 'transformer_engine' (none listed = the
    whole layer: Megatron's default 'full' scope), everything under 'full_iteration', nothing under 'none'. 'attn' and
    'mlp' name a dense layer's halves, 'moe_router' / 'moe_preprocess' / 'moe' an MoE layer's parts
    (physics.moe.host_pieces). The local implementation gives a layer listed for 'attn' or 'mlp' one CudaGraphManager
    for its whole forward (Megatron-Core 0.19.2 TransformerLayer.create_mcore_cudagraph_manager), so it captures the
    whole layer: on one H100 a Llama-style layer with 'attn' ran as fast as with no modules listed (0.490 against
    0.481 s a step, benchmarks/results/gpu_h100_Z_runs.jsonl), where Transformer Engine's graphs of 'attn' alone left
    1.107-1.128 s; a dropless MoE layer so listed failed to capture (its dispatcher's host sync)."""
    if impl == "none":
        return frozenset()
    mods = listed_modules(impl, modules)
    if impl == "full_iteration" or not mods or (impl == "local" and mods & {"attn", "mlp"}):
        return WHOLE_LAYER
    return mods
