"""Precision against the GPU, and parallel groups against the node (NVLink) boundary."""

from __future__ import annotations

from mcore_advisor.schemas import TrainingSpec

from ._core import (
    CP,
    DIST_OPT,
    EP,
    ETP,
    FP8_FORMAT,
    FP8_PARAM_GATHER,
    FP8_RECIPE,
    GPU,
    GPUS_PER_NODE,
    PRECISION,
    TP,
    TRANSFORMER_IMPL,
    Ctx,
    choices,
    divisors,
    nearest,
    rule,
)

AREA = "hardware"

# the schema's defaults: anything else means the user set an FP8 option
_FP8_RECIPE_DEFAULT = TrainingSpec.model_fields["fp8_recipe"].default
_FP8_FORMAT_DEFAULT = TrainingSpec.model_fields["fp8_format"].default


def _fp8(c: Ctx) -> bool:
    return c.precision == "fp8"


@rule(
    "fp8_needs_hopper",
    "error",
    AREA,
    "FP8 tensor cores: Hopper or newer",
    when=lambda c: _fp8(c) and c.gpu.fp8_dense_tflops is None,
)
def _fp8_arch(c: Ctx):
    # Transformer Engine check_fp8_support: "Device compute capability 8.9 or higher required for
    # FP8 execution."
    return (
        [PRECISION, GPU],
        f"training.precision fp8 needs FP8 tensor cores (Hopper or newer); {c.gpu.name} is {c.gpu.architecture} "
        "(Transformer Engine: 'Device compute capability 8.9 or higher required for FP8 execution')",
        "set training.precision to bf16, or cluster.gpu to h100-sxm or h200",
    )


@rule(
    "mxfp8_needs_blackwell",
    "error",
    AREA,
    "MXFP8 block scaling: Blackwell",
    when=lambda c: (
        _fp8(c)
        and c.fp8_recipe == "mxfp8"
        and c.gpu.fp8_dense_tflops is not None
        and c.gpu.architecture != "blackwell"
    ),
)
def _mxfp8(c: Ctx):
    # Transformer Engine check_mxfp8_support: compute capability 10.0 or higher.
    return (
        [FP8_RECIPE, GPU],
        f"fp8_recipe mxfp8 needs Blackwell (compute capability 10.0) tensor cores; {c.gpu.name} is {c.gpu.architecture}",
        "set training.fp8_recipe to delayed, tensorwise or blockwise, or cluster.gpu to b200/gb200",
    )


@rule(
    "fp8_needs_transformer_engine",
    "error",
    AREA,
    "FP8 GEMMs come from Transformer Engine",
    when=lambda c: _fp8(c) and c.transformer_impl != "transformer_engine",
)
def _fp8_te(c: Ctx):
    # TransformerConfig accepts fp8 with the local spec; the local modules are plain torch linears
    # and the run fails at model build/first step (shared/reference/megatron-core-cpu.md, "gaps").
    return (
        [PRECISION, TRANSFORMER_IMPL],
        "training.precision fp8 needs transformer_impl transformer_engine: FP8 GEMMs are Transformer Engine "
        "modules, the local spec has none",
        "set implementation.transformer_impl to transformer_engine, or training.precision to bf16",
    )


@rule(
    "fp8_param_gather_without_fp8",
    "error",
    AREA,
    "FP8 parameter copies need FP8 mode",
    when=lambda c: c.fp8_param_gather and not _fp8(c),
)
def _fp8pg_mode(c: Ctx):
    # TransformerConfig.__post_init__: "fp8_param must be used together with fp8 mode."
    return (
        [FP8_PARAM_GATHER, PRECISION],
        "fp8_param must be used together with fp8 mode. (training.fp8_param_gather with precision "
        f"{c.precision})",
        "set training.fp8_param_gather false, or training.precision fp8",
    )


@rule(
    "fp8_param_gather_needs_distributed_optimizer",
    "error",
    AREA,
    "FP8 param all-gather is a distributed-optimizer feature",
    when=lambda c: c.fp8_param_gather and not c.use_distributed_optimizer and not c.use_torch_fsdp2 and not c.use_megatron_fsdp,
)
def _fp8pg_distopt(c: Ctx):
    # Megatron-LM validate_args asserts this message.
    return (
        [FP8_PARAM_GATHER, DIST_OPT],
        "--fp8-param-gather only supported with distributed optimizer, torch fsdp2, megatron fsdp, or "
        "inference mode",
        "set parallelism.use_distributed_optimizer true, or training.fp8_param_gather false",
    )


@rule(
    "fp8_options_ignored",
    "info",
    AREA,
    "FP8 recipe/format set on a bf16 run",
    when=lambda c: (
        not _fp8(c) and (c.fp8_recipe != _FP8_RECIPE_DEFAULT or c.fp8_format != _FP8_FORMAT_DEFAULT)
    ),
)
def _fp8_ignored(c: Ctx):
    return (
        [FP8_RECIPE, FP8_FORMAT, PRECISION],
        f"fp8_recipe ({c.fp8_recipe}) / fp8_format ({c.fp8_format}) are ignored: training.precision is {c.precision}",
        "set training.precision fp8 to use them, or leave them at their defaults",
    )


def _fp8_widths(c: Ctx) -> list[tuple[str, int]]:
    """GEMM input widths (the K dimension) per TP rank that Transformer Engine runs in FP8."""
    s = c.shape
    widths = [("hidden_size", s.hidden_size)]
    if s.num_attention_heads % c.tp == 0:
        widths.append(
            ("num_attention_heads x kv_channels / TP", s.num_attention_heads * s.kv_channels // c.tp)
        )
    if s.num_dense_layers and s.ffn_hidden_size % c.tp == 0:
        widths.append(("ffn_hidden_size / TP", s.ffn_hidden_size // c.tp))
    return widths


@rule(
    "fp8_dims_not_aligned",
    "error",
    AREA,
    "FP8 GEMM inputs need widths divisible by 16",
    when=lambda c: _fp8(c) and any(w % 16 for _, w in _fp8_widths(c)),
)
def _fp8_dims(c: Ctx):
    # Transformer Engine assert_dim_for_fp8_exec: "FP8 execution requires 2D input matrices with
    # height divisible by 8 and width divisible by 16".
    bad = [f"{name} = {w}" for name, w in _fp8_widths(c) if w % 16]
    return (
        [PRECISION, TP, "model.hidden_size", "model.ffn_hidden_size"],
        f"FP8 execution requires GEMM input widths divisible by 16 (Transformer Engine); here {', '.join(bad)}",
        "set training.precision to bf16, or a tensor_model_parallel_size / model width that keeps these multiples of 16",
    )


def _net(c: Ctx, n_bytes: float) -> str:
    """Seconds for n_bytes at the network rate versus NVLink."""
    t_net = n_bytes / (c.scaleout_gbps * 1e9)
    if c.nvlink_gbps:
        t_nvl = n_bytes / (c.nvlink_gbps * 1e9)
        return (
            f"~{t_net:.2f} s at {c.scaleout_gbps:g} GB/s over the network instead of ~{t_nvl:.2f} s at "
            f"{c.nvlink_gbps:g} GB/s NVLink ({c.nvlink_gbps / c.scaleout_gbps:.0f}x slower)"
        )
    return f"~{t_net:.2f} s at {c.scaleout_gbps:g} GB/s over the network"


def _tp_bytes_per_step(c: Ctx) -> tuple[float, str]:
    # Korthikanti et al. 2022 sec. 4.2.2: per layer and micro-batch TP(+SP) runs 4 all-gathers and
    # 4 reduce-scatters (or 4 all-reduces of twice the traffic without SP) of an s*b*h activation;
    # a ring moves (t-1)/t of the tensor per GPU. bf16 = 2 bytes.
    t = c.tp
    per_layer = 8 * (t - 1) / t * (c.seq_length / c.cp) * c.mbs * c.shape.hidden_size * 2
    layers = c.layers_per_stage or c.shape.num_layers / c.pp
    if c.num_microbatches:
        return per_layer * layers * c.num_microbatches, "per step"
    return per_layer * layers, "per micro-batch"


@rule(
    "tp_spans_nodes",
    "warning",
    AREA,
    "TP collectives over the network",
    when=lambda c: c.tp > c.gpus_per_node,
)
def _tp_nodes(c: Ctx):
    n_bytes, unit = _tp_bytes_per_step(c)
    ok = [t for t in divisors(c.shape.num_attention_heads) if t <= c.gpus_per_node]
    return (
        [TP, GPUS_PER_NODE],
        f"tensor_model_parallel_size ({c.tp}) is larger than a node ({c.gpus_per_node} GPUs): TP collectives "
        f"on the critical path of every layer (~{n_bytes / 1e9:.1f} GB per GPU {unit}) take {_net(c, n_bytes)}",
        f"set parallelism.tensor_model_parallel_size to {choices(nearest(c.gpus_per_node, ok, 2))} and use "
        "pipeline or context parallelism across nodes",
    )


@rule(
    "tp_group_straddles_nodes",
    "warning",
    AREA,
    "TP groups cut by the node boundary",
    when=lambda c: c.tp <= c.gpus_per_node and c.gpus_per_node % c.tp != 0 and c.num_gpus > c.gpus_per_node,
)
def _tp_straddle(c: Ctx):
    # Megatron's default rank order 'tp-cp-ep-dp-pp' puts TP on consecutive ranks; with
    # gpus_per_node % TP != 0 some TP groups span two nodes.
    ok = [t for t in divisors(c.gpus_per_node) if c.shape.num_attention_heads % t == 0]
    n_bytes, unit = _tp_bytes_per_step(c)
    return (
        [TP, GPUS_PER_NODE],
        f"gpus_per_node ({c.gpus_per_node}) is not a multiple of tensor_model_parallel_size ({c.tp}): TP groups "
        f"on consecutive ranks straddle node boundaries, and those groups move ~{n_bytes / 1e9:.1f} GB per GPU "
        f"{unit} at network speed ({_net(c, n_bytes)})",
        f"set parallelism.tensor_model_parallel_size to {choices(nearest(c.tp, ok))}",
    )


@rule(
    "expert_group_spans_nodes",
    "warning",
    AREA,
    "MoE all-to-all over the network",
    when=lambda c: c.is_moe and c.ep * c.etp > c.gpus_per_node,
)
def _ep_nodes(c: Ctx):
    # Tokens per rank entering the dispatcher: s/CP per sample, further split over TP with SP.
    # Each token goes to k experts; dispatch + combine, forward + backward = 4 all-to-alls of
    # tokens*k*h bf16 values. With uniform routing a share 1 - gpn/(EP*ETP) leaves the node.
    s = c.shape
    tokens = c.mbs * c.seq_length / c.cp / (c.tp if c.sp_effective else 1)
    per_layer = 4 * tokens * s.moe_router_topk * s.hidden_size * 2
    remote = 1 - c.gpus_per_node / (c.ep * c.etp)
    layers = c.num_moe_layers / c.pp
    n_bytes = per_layer * layers * remote * (c.num_microbatches or 1)
    unit = "per step" if c.num_microbatches else "per micro-batch"
    return (
        [EP, ETP, GPUS_PER_NODE],
        f"expert_model_parallel_size x expert_tensor_parallel_size ({c.ep} x {c.etp} = {c.ep * c.etp}) spans "
        f"more than a node ({c.gpus_per_node} GPUs): about {remote:.0%} of the MoE token all-to-all leaves the "
        f"node, ~{n_bytes / 1e9:.1f} GB per GPU {unit}, {_net(c, n_bytes)}",
        f"keep EP x ETP within {c.gpus_per_node} GPUs where the experts fit, or overlap the all-to-all "
        "(flex dispatcher / --overlap-moe-expert-parallel-comm)",
    )


@rule(
    "cp_spans_nodes",
    "info",
    AREA,
    "CP ring over the network",
    when=lambda c: c.cp > 1 and c.tp * c.cp > c.gpus_per_node,
)
def _cp_nodes(c: Ctx):
    # Rank order 'tp-cp-...': a CP group is CP ranks TP apart, so it leaves the node once TP*CP > gpn.
    # Ring attention (p2p) passes each rank's K/V block CP-1 times per layer in forward; backward
    # moves K/V and their gradients, about twice that.
    s = c.shape
    kv_heads = s.num_attention_heads if s.multi_latent_attention else s.num_query_groups
    kv = 2 * (c.seq_length / c.cp) * c.mbs * max(1, kv_heads // c.tp) * s.kv_channels * 2
    per_layer = 3 * (c.cp - 1) * kv
    return (
        [CP, TP, GPUS_PER_NODE],
        f"context parallel groups (CP {c.cp}, TP {c.tp}) cross the node boundary: ring attention exchanges "
        f"~{per_layer / 1e6:.0f} MB of K/V per layer and micro-batch per GPU over the network; it overlaps "
        "with attention compute while that lasts longer (long sequences)",
        None,
    )
