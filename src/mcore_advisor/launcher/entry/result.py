"""result.json of a profile job: one typed structure that entry/profile.py writes and get_job reads.

The entry runs where pydantic is absent, so the contract is TypedDicts (the keys and their JSON types)
with `check(result)`, a small runtime check of a written result against them, and `measured(result,
figure)`: each figure get_job compares with the prediction, by name, from its one key. No torch, no
pydantic, nothing outside the standard library.
"""

# No `from __future__ import annotations`: TypedDict reads NotRequired from evaluated annotations only.
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, NotRequired, TypedDict


class RankIds(TypedDict):
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int
    ep_rank: int
    num_params_local: int | None


class ArgvAdjustment(TypedDict):
    """entry/argv.py Adjustment.as_dict: one change the machine made to the rendered argv."""

    flag: str
    action: str
    values: list[str]
    why: str


class MegatronLines(TypedDict):
    """Megatron's own console lines the figures come from."""

    iteration_lines: list[str]
    memory_lines: list[str]
    timer_lines: list[str]
    theoretical_memory_lines: list[str]


class HostProbe(TypedDict, total=False):
    ms_per_layer: float
    """Host milliseconds to issue the reference layer's forward + backward (the slowest local rank)."""
    statistic: str
    """How ms_per_layer sums the probe's passes ('median' since s7)."""
    mean_ms_per_layer: float
    per_iteration_ms: list[float]
    cpu_ms_per_layer: float
    gpu_ms_per_layer: float
    impl: str
    tokens: int
    iterations: int
    ms_per_layer_per_rank: list[float | None]
    source: str
    error: str
    """Why the probe gave no figure (it never fails the job)."""


class HostReport(TypedDict):
    hostname: NotRequired[str]
    """The node of the measured rank (jobs since s14): as_ran.machine_key pools a machine's probes by it."""
    boot_id: NotRequired[str | None]
    """/proc/sys/kernel/random/boot_id of that node (jobs since s14): with the hostname, one machine since its boot."""
    cpu_count: int | None
    cpus_usable: int | None
    local_processes_of_this_job: int
    cpu_steal_fraction_measured: float | None
    loadavg_1m_measure_start_end: list[float] | None
    steal_source: str
    gc_pause_s_per_iteration: list[float]
    gc_gen2_collections_per_iteration: list[int]
    gc_source: str
    cublaslt_heuristics_cache_capacity: NotRequired[int | None]
    """CUBLASLT_HEURISTICS_CACHE_CAPACITY as the job ran (None: unset, cuBLASLt's default; jobs since s9)."""
    probe: NotRequired[HostProbe | None]
    """The host's measured speed (entry/host_probe.py); None on a CPU run."""


class Versions(TypedDict):
    torch: str
    megatron_core: str
    transformer_engine: str | None
    cuda: str | None
    python: str


class MemoryMb(TypedDict):
    """torch's caching-allocator counters at one point (MB = 2^20 B; RSS on a CPU)."""

    allocated_mb: float
    max_allocated_mb: float
    reserved_mb: float
    max_reserved_mb: float


class RoutingCall(TypedDict):
    """One rank's first recorded router call: tokens it routed to each expert (before any EP sum)."""

    rank: int
    layer: int
    tokens_per_expert: list[int]


class MoeRouting(TypedDict):
    """How the router routed in the measured iterations (entry/moe_routing.py summarize)."""

    ep_size: int
    num_experts: int
    ep_groups: int
    """Expert-parallel groups summarised (per pipeline stage)."""
    calls: int
    """Router calls summarised, over all EP groups (a call: one layer's routing of one micro-batch)."""
    rank_imbalance_mean: float
    """Mean over calls of max / mean of the tokens the group's EP ranks receive (the all-to-all waits on the max)."""
    rank_imbalance_max: float
    expert_load_cv_mean: float
    """Mean over calls of the per-expert token counts' population std / mean."""
    expert_max_over_mean_mean: float
    per_layer: dict[str, float]
    """Megatron's layer number -> mean rank imbalance of its calls."""
    tokens_per_ep_rank_mean: list[float]
    """Per EP rank (index in its group): tokens received per call, averaged over calls."""
    first_call_per_rank: list[RoutingCall]
    """The ranks of rank 0's EP group: their first call's counts as routed."""
    expert_rows_distinct: NotRequired[int]
    """Distinct per-expert row counts (expert GEMM shapes) met in the measured iterations (jobs since s8)."""
    expert_rows_new_fraction: NotRequired[float]
    """Share of expert GEMM calls whose row count had not appeared earlier in the window (jobs since s8)."""
    expert_rows_new_per_iteration: NotRequired[dict[str, list[int]]]
    """{iteration: [expert GEMM calls with a row count new to the EP rank's process, its expert GEMM calls]},
    every iteration, the busiest rank of each EP group (jobs since s9)."""
    heuristic_cache_row_counts: NotRequired[int]
    """The LRU's size in row counts the replay used: the job's CUBLASLT_HEURISTICS_CACHE_CAPACITY (or cuBLASLt's
    default 8192) over six problems per count (jobs since s9, after the V set)."""
    expert_gemm_heuristic_miss_share: NotRequired[float]
    """Share of the measured iterations' expert GEMMs that miss a full cuBLASLt heuristics cache (an LRU replay
    of each EP rank's row counts; the rank with the highest share; jobs since s9)."""
    dropped_calls: int
    """Calls not kept (the per-rank cap, entry/moe_routing.py MAX_COUNTS_PER_RANK)."""
    source: str


class PeakGroup(TypedDict):
    where: str
    """'file:line function' of the innermost megatron/ or transformer_engine/ frame of the allocation."""
    bytes: int
    count: int


class MemoryPeak(TypedDict):
    """The blocks live at one rank's replayed peak of iteration 2 (entry/mem_peak.py; MCORE_ADVISOR_MEMORY_PEAK=1)."""

    rank: int
    iteration: int
    peak_bytes_replayed: int
    """Requested bytes live at the peak (the trace's sizes; below max_allocated_bytes by the allocator's rounding)."""
    before_recording_bytes: int
    max_allocated_bytes: int
    """torch.cuda.max_memory_allocated() at the end of the recorded iteration."""
    peak_event: int
    events: int
    trace_full: bool
    """The recorder's ring buffer filled: the iteration's earliest allocations count as 'before iteration 2'."""
    groups: list[PeakGroup]


Mode = Literal["profile", "memory_at_scale"]


class ProfileResult(TypedDict):
    """result.json. Per-rank lists are in rank order (one entry for a memory_at_scale job)."""

    status: Literal["ok"]
    mode: Mode
    measured_rank: int | None
    device: str
    world_size: int
    processes: int
    versions: Versions
    megatron_argv: list[str]
    argv_adjustments: list[ArgvAdjustment]
    notes: list[str]
    iterations: list[str]
    """Kind of each iteration: warmup, profile, measure or extra (entry/profile.py iteration_plan)."""
    ranks: list[RankIds]
    megatron: MegatronLines
    host: HostReport
    spec: dict[str, Any]
    step_times_s: list[float]
    step_times_source: str
    host_step_times_s: list[float]
    losses: list[float | str | None]
    grad_norms: list[float | str | None]
    megatron_tflops_per_gpu: list[float | str | None]
    flops_per_iteration_causal: float
    flops_per_iteration_full: float | None
    flops_source: str
    # The measured window: absent when no iteration was measured.
    measured_step_times_s: NotRequired[list[float]]
    iter_s: NotRequired[float]
    """Median of the measured iterations' step times (Megatron's 'elapsed time per iteration')."""
    iter_s_mean: NotRequired[float]
    iter_s_min: NotRequired[float]
    tokens_per_s_per_gpu: NotRequired[float]
    tflops_per_gpu_causal: NotRequired[float]
    tflops_per_gpu_full: NotRequired[float | None]
    mfu_peak_tflops: NotRequired[float | None]
    mfu_peak_note: NotRequired[str]
    mfu_pct_causal: NotRequired[float | None]
    mfu_pct_full: NotRequired[float | None]
    trace: NotRequired[str | None]
    exposed_comm_s: NotRequired[float | None]
    comm_s: NotRequired[float | None]
    exposed_comm_method: NotRequired[str | None]
    device_busy_s_per_profiled_iteration: NotRequired[float | None]
    device_idle_fraction: NotRequired[float | None]
    peak_allocated_gib: list[float]
    peak_reserved_gib: list[float]
    memory_source: str
    memory_after_setup_mb: list[MemoryMb | None]
    memory_after_iteration_mb: list[dict[str, MemoryMb]]
    """Per rank: iteration number (as text) -> memory right after it."""
    memory_read_after_iteration: NotRequired[int]
    """memory_at_scale: the iteration after which peak_allocated_gib was read."""
    settings: dict[str, Any]
    """Megatron's parsed arguments that decide what a run costs (launcher/as_ran.py reads them)."""
    transformer_impl: str
    moe_routing: NotRequired[MoeRouting]
    """Absent when the model has no MoE layer (or no router call was recorded: see notes)."""
    memory_peak: NotRequired[list[MemoryPeak]]
    """Rank 0's and the most loaded rank's; only with MCORE_ADVISOR_MEMORY_PEAK=1 on CUDA."""


# --------------------------------------------------------------------------- the figures get_job compares

Figure = Literal["iteration_time_s", "tokens_per_s_per_gpu", "tflops_per_gpu_causal", "peak_allocated_gib"]

#: figure -> (result key, how the figure is read from it)
MEASURED: dict[str, tuple[str, str]] = {
    "iteration_time_s": ("iter_s", "median step time of the measured iterations"),
    "tokens_per_s_per_gpu": ("tokens_per_s_per_gpu", "global batch x sequence / iter_s / world size"),
    "tflops_per_gpu_causal": ("tflops_per_gpu_causal", "Megatron's num_floating_point_operations / iter_s / world size"),
    "peak_allocated_gib": ("peak_allocated_gib", "the largest of the ranks' peaks (the most-loaded rank)"),
}


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def measured(result: Mapping[str, Any], figure: str) -> float | None:
    """One named figure of a result (None when the job did not measure it); per-rank lists give their maximum."""
    value = result.get(MEASURED[figure][0])
    if isinstance(value, list):
        nums = [n for n in map(_finite, value) if n is not None]
        return max(nums) if nums else None
    return _finite(value)


def measured_on_cpu(result: Mapping[str, Any]) -> bool:
    """The entry reports no MFU peak and RSS-based memory when it ran without CUDA."""
    return result.get("mfu_peak_tflops") is None and "RSS" in str(result.get("memory_source", ""))


# --------------------------------------------------------------------------- checking a written result

def _type_problems(value: Any, annotation: Any, where: str) -> list[str]:
    """Where `value` (JSON) is not of `annotation`; [] when it is."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return []
    if origin in (typing.Union, types.UnionType):
        tries = [_type_problems(value, a, where) for a in args]
        return [] if any(not t for t in tries) else [f"{where}: {value!r:.60} is not {annotation}"]
    if origin is Literal:
        return [] if value in args else [f"{where}: {value!r} is not one of {args}"]
    if origin is list:
        if not isinstance(value, list):
            return [f"{where}: expected a list, got {type(value).__name__}"]
        return [p for i, v in enumerate(value) for p in _type_problems(v, args[0], f"{where}[{i}]")]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{where}: expected an object, got {type(value).__name__}"]
        return [p for k, v in value.items() for p in _type_problems(v, args[1], f"{where}.{k}")]
    if typing.is_typeddict(annotation):
        return _typed_dict_problems(value, annotation, where)
    if annotation is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif annotation is type(None):
        ok = value is None
    else:
        ok = isinstance(value, annotation) and not (annotation is int and isinstance(value, bool))
    return [] if ok else [f"{where}: {value!r:.60} is not {getattr(annotation, '__name__', annotation)}"]


def _typed_dict_problems(value: Any, cls: type, where: str) -> list[str]:
    if not isinstance(value, dict):
        return [f"{where}: expected an object, got {type(value).__name__}"]
    hints = typing.get_type_hints(cls)
    out = [f"{where}.{k}: missing" for k in hints if k in cls.__required_keys__ and k not in value]
    out += [f"{where}.{k}: not in the contract (launcher/entry/result.py)" for k in value if k not in hints]
    for k, v in value.items():
        if k in hints:
            out += _type_problems(v, hints[k], f"{where}.{k}")
    return out


def check(result: Mapping[str, Any]) -> list[str]:
    """Every way `result` differs from ProfileResult (missing, unknown or mistyped keys); [] when it matches."""
    return _typed_dict_problems(dict(result), ProfileResult, "result")
