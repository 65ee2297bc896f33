"""Machinery shared by the rule modules: the resolved plan every rule reads, the registry, fix helpers.

A rule is a cheap predicate on `Ctx` (plain ints, bools and strings) plus a builder that turns a
violation into a `Finding`. `validate` runs predicate then builder; the layout search's fast path
(`layout_errors(ctx)`) runs only the predicates of error rules, so both agree by construction.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields

from mcore_advisor.knowledge.hardware import GpuSpec
from mcore_advisor.schemas import (
    Finding,
    ImplementationSpec,
    ModelShape,
    ParallelismSpec,
    Severity,
    TrainingSpec,
    layers_per_stage,
)

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
GRAD_ACC_FUSION = "implementation.gradient_accumulation_fusion"
MASKED_SOFTMAX_FUSION = "implementation.masked_softmax_fusion"
FSDP2 = "implementation.use_torch_fsdp2"
MEGATRON_FSDP = "implementation.use_megatron_fsdp"
SHARDING_STRATEGY = "implementation.data_parallel_sharding_strategy"
PRECISION_AWARE = "implementation.use_precision_aware_optimizer"
EXP_AVG_DTYPE = "implementation.exp_avg_dtype"
EXP_AVG_SQ_DTYPE = "implementation.exp_avg_sq_dtype"
GRAD_REDUCE_FP32 = "implementation.grad_reduce_in_fp32"
CAPACITY_FACTOR = "implementation.moe_expert_capacity_factor"
PAD_TO_CAPACITY = "implementation.moe_pad_expert_input_to_capacity"
EP_OVERLAP = "implementation.overlap_moe_expert_parallel_comm"
DELAY_WGRAD = "implementation.delay_wgrad_compute"
CUDA_GRAPH_IMPL = "implementation.cuda_graph_impl"
CUDA_GRAPH_MODULES = "implementation.cuda_graph_modules"
NAN_CHECKS = "implementation.check_for_nan_in_loss_and_grad"

GIB = 1024**3


def _default(section: type, name: str):
    """The Plan's default for a field, so the fast path cannot drift from the schema."""
    return section.model_fields[name].default


@dataclass(slots=True)
class Ctx:
    """One plan resolved to plain values: what every rule reads, and the validators' fast path.

    Build it from a Plan (`validators.validate` does) or directly from plain values for a search
    loop (`validators.layout_errors(Ctx(...))`); fields left out take the Plan's defaults, and
    `ctx.with_layout(tp=..., ...)` (or dataclasses.replace) gives a neighbouring layout. `__post_init__` resolves
    the cluster defaults from the GPU (gpus_per_node, bandwidths, memory None = the catalog's) and
    fills the derived fields.
    """

    shape: ModelShape
    gpu: GpuSpec
    num_gpus: int
    seq_length: int
    gbs: int
    mbs: int = 1
    gpus_per_node: int | None = None
    nvlink_gbps: float | None = None
    scaleout_gbps: float | None = None
    hbm_gib: float | None = None
    seq_length_max: int | None = None
    kv_channels_given: bool | None = None  # None = inferred from the shape
    precision: str = _default(TrainingSpec, "precision")
    fp8_recipe: str = _default(TrainingSpec, "fp8_recipe")
    fp8_format: str = _default(TrainingSpec, "fp8_format")
    fp8_param_gather: bool = _default(TrainingSpec, "fp8_param_gather")
    tp: int = 1
    pp: int = 1
    vp_raw: int | None = None
    cp: int = 1
    ep: int = 1
    etp_raw: int | None = None
    sp: bool = False
    use_distributed_optimizer: bool = _default(ParallelismSpec, "use_distributed_optimizer")
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: tuple[str, ...] | None = None
    overlap_grad_reduce: bool = _default(ParallelismSpec, "overlap_grad_reduce")
    overlap_param_gather: bool = _default(ParallelismSpec, "overlap_param_gather")
    tp_comm_overlap: bool = _default(ParallelismSpec, "tp_comm_overlap")
    transformer_impl: str = _default(ImplementationSpec, "transformer_impl")
    attention_backend: str = _default(ImplementationSpec, "attention_backend")
    moe_token_dispatcher_type: str = _default(ImplementationSpec, "moe_token_dispatcher_type")
    moe_grouped_gemm: bool = _default(ImplementationSpec, "moe_grouped_gemm")
    use_torch_fsdp2: bool = _default(ImplementationSpec, "use_torch_fsdp2")
    use_megatron_fsdp: bool = _default(ImplementationSpec, "use_megatron_fsdp")
    data_parallel_sharding_strategy: str = _default(ImplementationSpec, "data_parallel_sharding_strategy")
    use_precision_aware_optimizer: bool = _default(ImplementationSpec, "use_precision_aware_optimizer")
    exp_avg_dtype: str = _default(ImplementationSpec, "exp_avg_dtype")
    exp_avg_sq_dtype: str = _default(ImplementationSpec, "exp_avg_sq_dtype")
    grad_reduce_in_fp32: bool = _default(ImplementationSpec, "grad_reduce_in_fp32")
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    cross_entropy_fusion_impl: str = _default(ImplementationSpec, "cross_entropy_fusion_impl")
    cross_entropy_loss_fusion: bool = _default(ImplementationSpec, "cross_entropy_loss_fusion")
    gradient_accumulation_fusion: bool = _default(ImplementationSpec, "gradient_accumulation_fusion")
    masked_softmax_fusion: bool = _default(ImplementationSpec, "masked_softmax_fusion")
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False
    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False
    cuda_graph_impl: str = "none"
    cuda_graph_modules: tuple[str, ...] = ()
    check_for_nan_in_loss_and_grad: bool = True
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    # derived
    etp: int = field(default=0, init=False)
    vp: int = field(default=1, init=False)  # model chunks per stage actually built (1 unless interleaved)
    interleaved: bool = field(default=False, init=False)
    sp_effective: bool = field(default=False, init=False)  # Megatron turns SP off when TP == 1
    model_parallel: int = field(default=0, init=False)  # TP * PP * CP
    world_ok: bool = field(default=False, init=False)
    dp: int = field(default=0, init=False)  # 0 when the world size is not divisible
    expert_model_pipeline: int = field(default=0, init=False)  # ETP * EP * PP
    expert_world_ok: bool = field(default=False, init=False)
    expert_dp: int = field(default=0, init=False)
    num_experts: int = field(default=0, init=False)
    is_moe: bool = field(default=False, init=False)
    num_moe_layers: int = field(default=0, init=False)
    layers_ok: bool = field(default=False, init=False)
    layers_per_stage: int = field(default=0, init=False)  # the most-loaded stage's layers
    chunk_ok: bool = field(default=False, init=False)
    layers_per_chunk: int = field(default=0, init=False)  # 0 when not an integer
    batch_ok: bool = field(default=False, init=False)
    num_microbatches: int = field(default=0, init=False)  # 0 when the batch does not divide

    def __post_init__(self) -> None:
        g, shape = self.gpu, self.shape
        self.gpus_per_node = self.gpus_per_node or g.gpus_per_node
        self.nvlink_gbps = self.nvlink_gbps or g.nvlink_bandwidth_gbps
        self.scaleout_gbps = self.scaleout_gbps or g.scaleout_bandwidth_gbps
        self.hbm_gib = self.hbm_gib or g.hbm_capacity_gib
        if self.kv_channels_given is None:
            h, n = shape.hidden_size, shape.num_attention_heads
            self.kv_channels_given = h % n == 0 or shape.kv_channels != h // n
        if self.recompute_modules is not None:
            self.recompute_modules = tuple(self.recompute_modules)
        self.cuda_graph_modules = tuple(self.cuda_graph_modules or ())
        self._derive_layout()
        self._derive_stages()

    def with_layout(self, **changes: object) -> Ctx:
        """A copy with these input fields changed and every derived field recomputed: what
        dataclasses.replace does, at a fraction of its cost in a search loop."""
        c = object.__new__(Ctx)
        for name in _INPUT_FIELDS:
            setattr(c, name, changes.pop(name) if name in changes else getattr(self, name))
        if changes:
            raise TypeError(f"Ctx.with_layout got unknown fields {sorted(changes)}")
        c.__post_init__()
        return c

    def relayout(self, **changes: object) -> Ctx:
        """Set these input fields in place and recompute the derived ones, for loops that look at one
        layout at a time (a copy per layout, even with_layout's, was half the search's time)."""
        for name, value in changes.items():
            if name not in _INPUT_SET:
                raise TypeError(f"Ctx.relayout got unknown field {name!r}")
            setattr(self, name, value)
        self._derive_layout()
        self._derive_stages()
        return self

    def _derive_layout(self) -> None:
        tp, pp, cp, ep = self.tp, self.pp, self.cp, self.ep
        # Megatron: expert_tensor_parallel_size defaults to TP (validate_args / ModelParallelConfig).
        self.etp = self.etp_raw or tp
        # Megatron stores a VP of 1 as None, and only interleaves with PP > 1.
        self.interleaved = pp > 1 and self.vp_raw is not None and self.vp_raw > 1
        self.vp = self.vp_raw if self.interleaved else 1
        self.sp_effective = self.sp and tp > 1
        self.model_parallel = tp * pp * cp
        self.world_ok = self.num_gpus % self.model_parallel == 0
        self.dp = self.num_gpus // self.model_parallel if self.world_ok else 0
        self.expert_model_pipeline = self.etp * ep * pp
        self.expert_world_ok = self.num_gpus % self.expert_model_pipeline == 0
        self.expert_dp = self.num_gpus // self.expert_model_pipeline if self.expert_world_ok else 0
        self.num_experts = self.shape.num_experts or 0
        self.num_moe_layers = self.shape.num_moe_layers if self.num_experts else 0
        self.is_moe = self.shape.is_moe
        step = self.mbs * self.dp
        self.batch_ok = self.world_ok and self.gbs % step == 0
        self.num_microbatches = self.gbs // step if self.batch_ok else 0

    def _derive_stages(self) -> None:
        pp, first, last = self.pp, self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers
        uneven = pp > 1 and (first is not None or last is not None)
        emb, loss = self.account_for_embedding_in_pipeline_split, self.account_for_loss_in_pipeline_split
        try:
            stages = layers_per_stage(self.shape.num_layers, pp, first if pp > 1 else None, last if pp > 1 else None,
                                      embedding=emb, loss=loss)
            self.layers_ok = min(stages) > 0 or not uneven
        except ValueError:
            stages = []
            self.layers_ok = False
        self.layers_per_stage = max(stages) if self.layers_ok else 0
        # get_num_layers_to_build: with the embedding/loss counted as layers, each rank's slots (its layers
        # plus the embedding or loss it holds) divide over its VP chunks, not the layers it builds.
        slots = [n + (emb and r == 0) + (loss and r == len(stages) - 1) for r, n in enumerate(stages)]
        self.chunk_ok = self.layers_ok and all(n % self.vp == 0 for n in slots)
        # With an uneven split the chunk size differs per stage; rules use the most-loaded stage's.
        self.layers_per_chunk = self.layers_per_stage // self.vp if self.chunk_ok else 0


_INPUT_FIELDS = tuple(f.name for f in fields(Ctx) if f.init)
_INPUT_SET = frozenset(_INPUT_FIELDS)

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
