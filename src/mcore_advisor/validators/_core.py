"""Machinery shared by the rule modules: the resolved plan every rule reads, the registry, fix helpers.

A rule is a cheap predicate on `Ctx` (plain ints, bools and strings) plus a builder that turns a
violation into a `Finding`. `validate` runs predicate then builder; the recommender's fast path
(`layout_errors`) runs only the predicates of error rules, so both agree by construction.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mcore_advisor.knowledge.hardware import GpuSpec
from mcore_advisor.schemas import Finding, ModelShape, Severity, layers_per_stage

# Dotted plan fields, so every finding names what to change exactly as the Plan spells it.
NUM_GPUS = "cluster.num_gpus"
GPUS_PER_NODE = "cluster.gpus_per_node"
GPU = "cluster.gpu"
SEQ = "training.seq_length"
GBS = "training.global_batch_size"
MBS = "training.micro_batch_size"
PRECISION = "training.precision"
FP8_RECIPE = "training.fp8_recipe"
FP8_FORMAT = "training.fp8_format"
FP8_PARAM_GATHER = "training.fp8_param_gather"
TP = "parallelism.tensor_model_parallel_size"
PP = "parallelism.pipeline_model_parallel_size"
VP = "parallelism.virtual_pipeline_model_parallel_size"
CP = "parallelism.context_parallel_size"
EP = "parallelism.expert_model_parallel_size"
ETP = "parallelism.expert_tensor_parallel_size"
SP = "parallelism.sequence_parallel"
DIST_OPT = "parallelism.use_distributed_optimizer"
RECOMPUTE_GRANULARITY = "parallelism.recompute_granularity"
RECOMPUTE_METHOD = "parallelism.recompute_method"
RECOMPUTE_NUM_LAYERS = "parallelism.recompute_num_layers"
RECOMPUTE_MODULES = "parallelism.recompute_modules"
OVERLAP_GRAD_REDUCE = "parallelism.overlap_grad_reduce"
OVERLAP_PARAM_GATHER = "parallelism.overlap_param_gather"
TP_COMM_OVERLAP = "parallelism.tp_comm_overlap"
TRANSFORMER_IMPL = "implementation.transformer_impl"
ATTENTION_BACKEND = "implementation.attention_backend"
DISPATCHER = "implementation.moe_token_dispatcher_type"
GROUPED_GEMM = "implementation.moe_grouped_gemm"
FSDP2 = "implementation.use_torch_fsdp2"

GIB = 1024**3


@dataclass(slots=True)
class Ctx:
    """One plan, resolved to plain values; derived quantities are filled by `make_ctx`."""

    shape: ModelShape
    gpu: GpuSpec
    num_gpus: int
    gpus_per_node: int
    nvlink_gbps: float | None
    scaleout_gbps: float
    hbm_gib: float
    seq_length: int
    seq_length_max: int | None
    kv_channels_given: bool
    gbs: int
    mbs: int
    precision: str
    fp8_recipe: str
    fp8_format: str
    fp8_param_gather: bool
    tp: int
    pp: int
    vp_raw: int | None
    cp: int
    ep: int
    etp_raw: int | None
    sp: bool
    use_distributed_optimizer: bool
    recompute_granularity: str | None
    recompute_method: str | None
    recompute_num_layers: int | None
    recompute_modules: tuple[str, ...] | None
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    tp_comm_overlap: bool
    transformer_impl: str
    attention_backend: str
    moe_token_dispatcher_type: str
    moe_grouped_gemm: bool
    use_torch_fsdp2: bool
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    cross_entropy_fusion_impl: str = "native"
    # derived
    etp: int = 0
    vp: int = 1  # model chunks per stage actually built (1 unless interleaved)
    interleaved: bool = False
    sp_effective: bool = False  # Megatron turns SP off when TP == 1
    model_parallel: int = 0  # TP * PP * CP
    world_ok: bool = False
    dp: int = 0  # 0 when the world size is not divisible
    expert_model_pipeline: int = 0  # ETP * EP * PP
    expert_world_ok: bool = False
    expert_dp: int = 0
    num_experts: int = 0
    is_moe: bool = False
    num_moe_layers: int = 0
    layers_ok: bool = False
    layers_per_stage: int = 0  # the most-loaded stage's layers
    chunk_ok: bool = False
    layers_per_chunk: int = 0  # 0 when not an integer
    batch_ok: bool = False
    num_microbatches: int = 0  # 0 when the batch does not divide


def make_ctx(
    shape: ModelShape,
    gpu: GpuSpec,
    *,
    num_gpus: int,
    gpus_per_node: int | None,
    nvlink_bandwidth_gbps: float | None,
    scaleout_bandwidth_gbps: float | None,
    gpu_memory_gib: float | None,
    seq_length: int,
    seq_length_max: int | None,
    kv_channels_given: bool,
    global_batch_size: int,
    micro_batch_size: int,
    precision: str,
    fp8_recipe: str,
    fp8_format: str,
    fp8_param_gather: bool,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    virtual_pipeline_model_parallel_size: int | None,
    context_parallel_size: int,
    expert_model_parallel_size: int,
    expert_tensor_parallel_size: int | None,
    sequence_parallel: bool,
    use_distributed_optimizer: bool,
    recompute_granularity: str | None,
    recompute_method: str | None,
    recompute_num_layers: int | None,
    recompute_modules: Iterable[str] | None,
    overlap_grad_reduce: bool,
    overlap_param_gather: bool,
    tp_comm_overlap: bool,
    transformer_impl: str,
    attention_backend: str,
    moe_token_dispatcher_type: str,
    moe_grouped_gemm: bool,
    use_torch_fsdp2: bool,
    decoder_first_pipeline_num_layers: int | None = None,
    decoder_last_pipeline_num_layers: int | None = None,
    cross_entropy_fusion_impl: str = "native",
) -> Ctx:
    tp, pp, cp, ep = (
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
    )
    c = Ctx(
        shape=shape,
        gpu=gpu,
        num_gpus=num_gpus,
        gpus_per_node=gpus_per_node or gpu.gpus_per_node,
        nvlink_gbps=nvlink_bandwidth_gbps or gpu.nvlink_bandwidth_gbps,
        scaleout_gbps=scaleout_bandwidth_gbps or gpu.scaleout_bandwidth_gbps,
        hbm_gib=gpu_memory_gib or gpu.hbm_capacity_gib,
        seq_length=seq_length,
        seq_length_max=seq_length_max,
        kv_channels_given=kv_channels_given,
        gbs=global_batch_size,
        mbs=micro_batch_size,
        precision=precision,
        fp8_recipe=fp8_recipe,
        fp8_format=fp8_format,
        fp8_param_gather=fp8_param_gather,
        tp=tp,
        pp=pp,
        vp_raw=virtual_pipeline_model_parallel_size,
        cp=cp,
        ep=ep,
        etp_raw=expert_tensor_parallel_size,
        sp=sequence_parallel,
        use_distributed_optimizer=use_distributed_optimizer,
        recompute_granularity=recompute_granularity,
        recompute_method=recompute_method,
        recompute_num_layers=recompute_num_layers,
        recompute_modules=tuple(recompute_modules) if recompute_modules is not None else None,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        tp_comm_overlap=tp_comm_overlap,
        transformer_impl=transformer_impl,
        attention_backend=attention_backend,
        moe_token_dispatcher_type=moe_token_dispatcher_type,
        moe_grouped_gemm=moe_grouped_gemm,
        use_torch_fsdp2=use_torch_fsdp2,
        decoder_first_pipeline_num_layers=decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=decoder_last_pipeline_num_layers,
        cross_entropy_fusion_impl=cross_entropy_fusion_impl,
    )
    # Megatron: expert_tensor_parallel_size defaults to TP (validate_args / ModelParallelConfig).
    c.etp = expert_tensor_parallel_size or tp
    vp_raw = virtual_pipeline_model_parallel_size
    # Megatron stores a VP of 1 as None, and only interleaves with PP > 1.
    c.interleaved = pp > 1 and vp_raw is not None and vp_raw > 1
    c.vp = vp_raw if c.interleaved else 1
    c.sp_effective = sequence_parallel and tp > 1
    c.model_parallel = tp * pp * cp
    c.world_ok = num_gpus % c.model_parallel == 0
    c.dp = num_gpus // c.model_parallel if c.world_ok else 0
    c.expert_model_pipeline = c.etp * ep * pp
    c.expert_world_ok = num_gpus % c.expert_model_pipeline == 0
    c.expert_dp = num_gpus // c.expert_model_pipeline if c.expert_world_ok else 0
    c.num_experts = shape.num_experts or 0
    c.num_moe_layers = shape.num_moe_layers if c.num_experts else 0
    c.is_moe = shape.is_moe
    L = shape.num_layers
    uneven = pp > 1 and (decoder_first_pipeline_num_layers is not None or decoder_last_pipeline_num_layers is not None)
    try:
        stages = layers_per_stage(
            L, pp, decoder_first_pipeline_num_layers if pp > 1 else None,
            decoder_last_pipeline_num_layers if pp > 1 else None,
        )
        c.layers_ok = min(stages) > 0 or not uneven
    except ValueError:
        stages = []
        c.layers_ok = False
    c.layers_per_stage = max(stages) if c.layers_ok else 0
    c.chunk_ok = c.layers_ok and all(n % c.vp == 0 for n in stages)
    # With an uneven split the chunk size differs per stage; rules use the most-loaded stage's.
    c.layers_per_chunk = c.layers_per_stage // c.vp if c.chunk_ok else 0
    step = micro_batch_size * c.dp
    c.batch_ok = c.world_ok and global_batch_size % step == 0
    c.num_microbatches = global_batch_size // step if c.batch_ok else 0
    return c


FindingParts = tuple  # (fields, message, fix) or (fields, message, fix, severity)


@dataclass(frozen=True, slots=True)
class Rule:
    """One registered check. `severity` is the worst it emits ('error' rules always emit errors)."""

    code: str
    severity: Severity
    area: str
    summary: str
    applies: Callable[[Ctx], object]
    build: Callable[[Ctx], FindingParts]

    def finding(self, c: Ctx) -> Finding:
        parts = self.build(c)
        fields, message, fix = parts[0], parts[1], parts[2]
        severity = parts[3] if len(parts) > 3 else self.severity
        return Finding(code=self.code, severity=severity, fields=list(fields), message=message, fix=fix)


RULES: list[Rule] = []


def rule(code: str, severity: Severity, area: str, summary: str, *, when: Callable[[Ctx], object]):
    """Register the decorated builder under `code`; `when` is the predicate (truthy = violated)."""

    def deco(build: Callable[[Ctx], FindingParts]) -> Callable[[Ctx], FindingParts]:
        if any(r.code == code for r in RULES):
            raise RuntimeError(f"duplicate validator code {code!r}")
        RULES.append(Rule(code, severity, area, summary, when, build))
        return build

    return deco


# ---- fix helpers -----------------------------------------------------------------------------


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def nearest(target: float, candidates: Iterable[int], k: int = 3) -> list[int]:
    """The k candidates closest to target on a log scale (a factor 2 either way counts the same)."""
    uniq = sorted({c for c in candidates if c > 0})
    ranked = sorted(uniq, key=lambda c: (abs(math.log(c / target)), c))
    return sorted(ranked[:k])


def prefer(candidates: Iterable[int], *filters: Callable[[int], bool]) -> list[int]:
    """Apply filters in turn, skipping any that would leave nothing (so a fix is always offered)."""
    cs = list(candidates)
    for f in filters:
        kept = [x for x in cs if f(x)]
        if kept:
            cs = kept
    return cs


def multiples_around(value: int, step: int) -> list[int]:
    """The nearest positive multiples of step below and above value."""
    lo = (value // step) * step
    hi = lo + step
    return [m for m in (lo, hi) if m > 0 and m != value]


def choices(values: Iterable[object]) -> str:
    """'2, 4 or 8'."""
    v = [str(x) for x in values]
    if not v:
        return "(none)"
    if len(v) == 1:
        return v[0]
    return ", ".join(v[:-1]) + " or " + v[-1]


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.1f} GiB"
