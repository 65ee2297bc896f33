"""The plan as a profile job actually ran it, and what to predict for the rank it measured.

The profile job runs Megatron-LM on the rendered argv, adapted where the machine lacks a part
(launcher/entry/argv.py: the local spec without Transformer Engine, no TE attention kernels or
grouped GEMM, ...). result.json records Megatron's parsed arguments (`settings`) and
`transformer_impl`; measured figures are only comparable with a prediction for the plan those
describe, so get_job and the accuracy benchmarks predict for it.

The host speed a job predicts with is its host probe's (entry/host_probe.py), taken with the probes
of the jobs that ran on the same machine before it (`earlier_machine_probes`): one probe reads a
machine's host with a spread of -30/+40% between processes whose steps differ by 5% (s13's H rows:
7.2 and 5.2 ms for one plan), and the median over a machine's jobs tracks their steps better
(benchmarks/results/host_history.txt).

A memory_at_scale job measures one rank of the plan's world (a fake process group); its prediction
is the memory model's figure for that rank's pipeline stage (`rank_memory`).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mcore_advisor.knowledge import megatron_flags
from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics.memory import GIB, MemoryBreakdown, memory_breakdown
from mcore_advisor.physics.moe import CUBLASLT_HEURISTICS_CACHE_KEYS, cache_row_counts
from mcore_advisor.physics.step_time import host_floor_from_probe
from mcore_advisor.schemas import Plan, parallel_dims, with_changes


@dataclass(frozen=True)
class AsRan:
    plan: Plan
    differences: list[str] = field(default_factory=list)


#: how many of a machine's earlier probes join a job's own (the most recent; a VM's host drifts over hours)
MACHINE_PROBES_KEPT = 10


def te_probe_ms(result: Mapping[str, Any] | None) -> float | None:
    """The job's host probe (ms per reference layer) when Transformer Engine timed it, the only probe as_ran reads."""
    probe = ((result or {}).get("host") or {}).get("probe") or {}
    if probe.get("impl") != "transformer_engine" or "ms_per_layer" not in probe:
        return None
    return float(probe["ms_per_layer"])


def machine_key(result: Mapping[str, Any] | None, fallback: Hashable | None = None) -> tuple | None:
    """Which machine's host a result's probe timed: its hostname and boot id (jobs since s14: VMs share names
    like 'vm'; `fallback` names the machine of older rows) and GPU. None without a Transformer Engine probe,
    which is the only one as_ran reads."""
    host = (result or {}).get("host") or {}
    name = host.get("hostname") or fallback
    if name is None or te_probe_ms(result) is None:
        return None
    return (name, host.get("boot_id"), (result or {}).get("device"))


def _cache_off(result: Mapping[str, Any] | None) -> bool:
    """Whether the job ran with cuBLASLt's heuristics cache off (CUBLASLT_HEURISTICS_CACHE_CAPACITY=0)."""
    return ((result or {}).get("host") or {}).get("cublaslt_heuristics_cache_capacity") == 0


def earlier_machine_probes(results: Sequence[Mapping[str, Any] | None],
                           fallbacks: Sequence[Hashable | None]) -> list[list[float]]:
    """For each result, in the order the jobs ran, the probes (ms per layer) of the earlier jobs on its machine
    that ran with cuBLASLt's heuristics cache on: a probe with it off also times every GEMM's heuristic query
    (the Y set's H100 VM: 9.0-9.5 ms against 4.5-5.4 ms with it on), so it joins no pool."""
    seen: dict[tuple, list[float]] = defaultdict(list)
    out = []
    for result, fallback in zip(results, fallbacks, strict=True):
        key = machine_key(result, fallback)
        out.append(seen[key][-MACHINE_PROBES_KEPT:] if key else [])
        if key and not _cache_off(result):
            seen[key].append(te_probe_ms(result))  # type: ignore[arg-type]
    return out


def as_ran(plan: Plan, result: Mapping[str, Any] | None, machine_probes: Sequence[float] = ()) -> AsRan:
    """`plan` with the implementation choices the job's result.json says Megatron used, on the host speed its
    probe and `machine_probes` (the earlier probes of its machine: `earlier_machine_probes`) measured."""
    if not result:
        return AsRan(plan)
    im = plan.implementation
    settings = dict(result.get("settings") or {})
    if isinstance(settings.get("gradient_accumulation_fusion"), str):
        # results of the pre-Megatron-loop job named the fused layers ('TE layers', 'all layers')
        settings["gradient_accumulation_fusion"] = True
    shape = resolve_model(plan.model)
    # Megatron's arguments back to plan fields: knowledge/megatron_flags.py, the table the argv was rendered
    # from; the model's facts decide which flags apply (grouped GEMM only for MoE, the bias-activation flag
    # by activation, ...).
    context = {f"model.{k}": getattr(shape, k) for k in
               ("num_experts", "swiglu", "add_bias_linear", "position_embedding_type", "multi_latent_attention")}
    ran = megatron_flags.parse({**settings, "transformer_impl": result.get("transformer_impl")},
                               context=context).sections["implementation"]
    changes = {name: value for name, value in ran.items() if value != getattr(im, name)}
    diffs = [f"{k} {v}" + (" (the plan asked for " + str(getattr(im, k)) + ")" if k == "transformer_impl" else "")
             for k, v in changes.items()]
    plan = with_changes(plan, "implementation", **changes) if changes else plan
    cache = (result.get("host") or {}).get("cublaslt_heuristics_cache_capacity")
    if cache is not None and plan.implementation.cublaslt_heuristics_cache_capacity is None:
        plan = with_changes(plan, "implementation", cublaslt_heuristics_cache_capacity=int(cache))
        diffs = diffs + [f"cublaslt_heuristics_cache_capacity {int(cache)} (the job's environment)"]
    plan, diffs = _with_measured_routing(plan, result, diffs)
    return _on_measured_host(plan, result, diffs, machine_probes)


def _with_measured_routing(plan: Plan, result: Mapping[str, Any], diffs: list[str]) -> tuple[Plan, list[str]]:
    """The plan with the routing the job recorded (entry/moe_routing.py: the busiest EP rank's tokens over
    the mean per MoE layer call, and the experts' load spread), where the plan sets neither itself."""
    rec = dict(result.get("moe_routing") or {})
    if result.get("mode") == "memory_at_scale" and resolve_model(plan.model).is_moe:
        # under the fake process group each all-to-all hands a rank back its own tokens: its experts get
        # exactly the mean load, whatever the router does
        rec["rank_imbalance_mean"] = 1.0
    im = plan.implementation
    changes = {}
    if rec.get("rank_imbalance_mean") is not None and im.moe_routing_imbalance is None:
        changes["moe_routing_imbalance"] = round(max(1.0, float(rec["rank_imbalance_mean"])), 4)
    if rec.get("expert_load_cv_mean") is not None and im.moe_expert_load_cv is None:
        changes["moe_expert_load_cv"] = round(float(rec["expert_load_cv_mean"]), 4)
    if _replayed_at_the_runs_cache(rec, result) and im.moe_heuristic_miss_share is None:
        changes["moe_heuristic_miss_share"] = round(float(rec["expert_gemm_heuristic_miss_share"]), 4)
    if not changes:
        return plan, diffs
    return (with_changes(plan, "implementation", **changes),
            diffs + [f"{k} {v:.3f} (the job's routing record)" for k, v in changes.items()])


def _replayed_at_the_runs_cache(rec: Mapping[str, Any], result: Mapping[str, Any]) -> bool:
    """Whether the routing record's miss share replayed the cache the job ran with: the first s9 jobs replayed
    cuBLASLt's default whatever CUBLASLT_HEURISTICS_CACHE_CAPACITY said (and recorded no size)."""
    if rec.get("expert_gemm_heuristic_miss_share") is None:
        return False
    capacity = (result.get("host") or {}).get("cublaslt_heuristics_cache_capacity")
    replayed = rec.get("heuristic_cache_row_counts")
    if replayed is None:
        return capacity is None or capacity == CUBLASLT_HEURISTICS_CACHE_KEYS
    return replayed == cache_row_counts(capacity)


def measured_host_floor_ms(result: Mapping[str, Any] | None, machine_probes: Sequence[float] = ()) -> float | None:
    """The host speed (ClusterSpec.host_floor_ms_per_layer) the job's Transformer Engine probe and its machine's
    earlier probes measured (_host_reading); None without such a probe."""
    reading = _host_reading(result, machine_probes)
    return reading[0] if reading else None


def _host_reading(result: Mapping[str, Any] | None, machine_probes: Sequence[float]) -> tuple[float, str] | None:
    """(the host floor, how it was read) or None: the median of the job's probe and its machine's earlier ones; a
    job run with the heuristics cache off reads its machine's probes with the cache on where there are any, its own
    probe less the queries' estimate only where there are none."""
    own = te_probe_ms(result)
    if own is None:
        return None
    how = f"the job's host probe: {own:.2f} ms per TE layer"
    n = len(machine_probes)
    if _cache_off(result) and machine_probes:
        ms = statistics.median(machine_probes)
        return host_floor_from_probe(ms), f"{how}, the cache off; the median of this machine's {n} earlier probes with it on: {ms:.2f} ms"
    ms = statistics.median([own, *machine_probes])
    how += f"; the median with this machine's {n} earlier probes: {ms:.2f} ms" if machine_probes else ""
    if _cache_off(result):
        return host_floor_from_probe(ms, heuristics_cache_off=True), how + ", less its GEMMs heuristic queries: the cache was off"
    return host_floor_from_probe(ms), how


def _on_measured_host(plan: Plan, result: Mapping[str, Any], diffs: list[str], machine_probes: Sequence[float]) -> AsRan:
    """The plan on the host speed the job measured (entry/host_probe.py) with its machine's earlier probes,
    unless the plan sets its own."""
    reading = _host_reading(result, machine_probes)
    if plan.cluster.host_floor_ms_per_layer is not None or reading is None:
        return AsRan(plan, diffs)
    floor, how = reading
    diffs = diffs + [f"host_floor_ms_per_layer {floor:.2f} ({how})"]
    return AsRan(with_changes(plan, "cluster", host_floor_ms_per_layer=round(floor, 4)), diffs)


def rank_memory(plan: Plan, result: Mapping[str, Any]) -> tuple[MemoryBreakdown, dict[str, Any] | None]:
    """The memory model's breakdown for the plan as run and its stage entry for the measured rank
    (None when the breakdown does not list that pipeline stage: it evaluates first, second,
    second-to-last and last)."""
    ran = as_ran(plan, result).plan
    mem = memory_breakdown(ran)
    rank = int(result.get("measured_rank") or 0)
    pp_rank = rank // (plan.cluster.num_gpus // parallel_dims(plan).pp)
    stage = next((s for s in mem.stages if s.pipeline_rank == pp_rank), None)
    return mem, stage.model_dump() if stage is not None else None


def rank_terms(plan: Plan, result: Mapping[str, Any]) -> tuple[float | None, list[dict[str, Any]], str]:
    """(predicted peak allocated GiB of the measured rank, measured-vs-predicted rows per term, note).

    Terms the job can measure without a memory snapshot: the parameters the rank holds; the
    allocated memory after iteration 1 (weights, gradient buffers and optimizer state: the
    activations are freed by then) against the model's weights + gradients + optimizer; and the
    peak above it (activations and the largest temporary) against activations + transient +
    buffers, or the optimizer step's temporaries when that is the predicted peak phase.
    """
    mem, stage = rank_memory(plan, result)
    if stage is None:
        return None, [], "the memory model evaluates pipeline stages first, second, second-to-last and last only"
    ranks = result.get("ranks") or [{}]
    after = (result.get("memory_after_iteration_mb") or [{}])[0].get("1") or {}
    peak_gib = _first(result.get("peak_allocated_gib"))
    static_pred = (stage["weights_bytes"] + stage["gradients_bytes"] + stage["optimizer_bytes"]) / GIB
    dynamic_pred = max(stage["activations_bytes"] + stage["transient_bytes"],
                       stage["optimizer_step_transient_bytes"]) / GIB + stage["buffers_bytes"] / GIB
    static_meas = after.get("allocated_mb") / 1024.0 if after.get("allocated_mb") else None
    rows = [
        _row("num_params", ranks[0].get("num_params_local"), stage["num_params"]),
        _row("weights_gradients_optimizer_gib", static_meas, static_pred),
        _row("activations_transient_buffers_gib", peak_gib - static_meas if (peak_gib and static_meas) else None, dynamic_pred),
        _row("peak_allocated_gib", peak_gib, stage["peak_allocated_bytes"] / GIB),
    ]
    note = (f"memory_at_scale: rank {result.get('measured_rank')} (pipeline stage {stage['pipeline_rank']}, {stage['role']}) "
            f"of {plan.cluster.num_gpus}, measured on one GPU with Megatron's --fake-process-group after iteration "
            f"{result.get('memory_read_after_iteration')}")
    return stage["peak_allocated_bytes"] / GIB, rows, note


def _first(value: Any) -> float | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return float(value) if isinstance(value, int | float) else None


def _row(term: str, measured: float | None, predicted: float | None) -> dict[str, Any]:
    err = None
    if measured and predicted is not None:
        err = round((predicted - measured) / measured * 100.0, 2)
    return {"term": term, "measured": measured, "predicted": predicted, "error_pct": err}
