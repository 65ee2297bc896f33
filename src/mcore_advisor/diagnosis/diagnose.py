"""Diagnosis for check_mfu: where a low MFU's step time goes, why a run ran out of memory, and
which concrete plan changes help most.

Both diagnoses generate candidate plan changes, evaluate each changed plan as a whole with
evaluate_plan (validators + memory model + performance model), drop those the validators reject
(and, for speed fixes, those that do not fit in memory), and rank them by predicted gain. The models' absolute times may be off; their ratio before/after is what a
fix is ranked by, and it is applied to the measured figures.

Pure: no I/O.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from mcore_advisor.diagnosis.logparse import (
    IterationTimeStats,
    MemoryReport,
    OomEvent,
    ParsedLog,
    TheoreticalMemory,
)
from mcore_advisor.knowledge.hardware import gpu
from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics.evaluate import Evaluation, evaluate_plan
from mcore_advisor.physics.flops import flops_per_token_breakdown
from mcore_advisor.physics.step_time import PerfEstimate, pipeline_bubble_fraction
from mcore_advisor.planning.plan_changes import memory_fix_candidates, plan_changes
from mcore_advisor.schemas import Finding, ModelShape, Plan, parallel_dims

_RESULT = ConfigDict(frozen=True)

STALL_CV_THRESHOLD = 0.05
"""Logged iteration times spread more than this (stdev/mean) point at stalls: Megatron averages over
log_interval iterations, so a steady run shows well under 1% spread (the H200 fixtures: 0.03%)."""
UNEXPLAINED_RATIO = 1.15
"""Measured / predicted step time above this is time the model does not explain."""
FRAGMENTATION_MIN_SHARE = 0.02
"""Reserved-but-unallocated memory under 2% of the GPU is normal allocator slack, not the cause."""
MAX_FIXES = 8


class GapComponent(BaseModel):
    """One share of the step time that is not model math at the GPU's peak rate."""

    model_config = _RESULT

    name: str
    time_s: float
    share_of_step_pct: float = Field(description="Of the measured step time (of the predicted one when nothing was measured).")
    explanation: str


class FixSuggestion(BaseModel):
    """A concrete plan change with the models' before/after."""

    model_config = _RESULT

    change: str = Field(description="e.g. 'parallelism.virtual_pipeline_model_parallel_size None -> 4'.")
    fields: list[str] = Field(description="Dotted plan fields changed.")
    plan: Plan = Field(description="The whole changed plan (feed it to evaluate_plan or render_launch_script).")
    predicted_step_time_s_before: float
    predicted_step_time_s_after: float
    predicted_throughput_change_pct: float = Field(description="Tokens/s after / before - 1, % (negative = slower).")
    predicted_mfu_causal_pct_after: float | None = Field(None, description="The measured MFU (causal) scaled by the predicted speed-up; the model's own MFU when nothing was measured.")
    peak_memory_gib_before: float
    peak_memory_gib_after: float = Field(description="Predicted total per-GPU memory (reserved + non-PyTorch) on the most-loaded rank.")
    memory_saved_gib: float
    fits: bool
    caveat: str | None = None


class LowMfuDiagnosis(BaseModel):
    model_config = _RESULT

    predicted_step_time_s: float
    predicted_mfu_causal_pct: float
    measured_step_time_s: float | None
    measured_over_predicted: float | None = Field(None, description="> 1.15: time the model does not explain (data loading, stragglers, slow links, throttling).")
    components: list[GapComponent] = Field(description="Largest first.")
    fixes: list[FixSuggestion] = Field(description="Ranked by predicted throughput gain; only plans that validate and fit.")
    num_candidates_rejected: int = Field(description="Candidate changes dropped: validator errors or not fitting in memory.")
    notes: list[str] = Field(default_factory=list)


class OomDiagnosis(BaseModel):
    model_config = _RESULT

    verdict: Literal["fragmentation", "over_commitment", "other_processes", "outside_pytorch", "no_oom_numbers"]
    message: str
    event: OomEvent | None = Field(None, description="The OOM message the verdict reads (the first; others in `ranks_with_oom`).")
    ranks_with_oom: list[int] = Field(default_factory=list)
    where_memory_went_gib: dict[str, float] = Field(default_factory=dict, description="From the message: allocated by PyTorch, reserved-unallocated (fragmentation), non-PyTorch (context/NCCL), other processes, free, the request.")
    estimate: dict[str, float] = Field(default_factory=dict, description="The memory model's breakdown for the plan's most-loaded rank, GiB.")
    estimate_vs_message: str | None = None
    most_loaded_rank: str | None = Field(None, description="Which pipeline rank the memory model finds most loaded, and the measured reports' maximum.")
    measured_reports: list[MemoryReport] = Field(default_factory=list, description="The log's memory reports (latest per rank), highest first.")
    theoretical_memory: TheoreticalMemory | None = None
    fixes: list[FixSuggestion] = Field(default_factory=list, description="Plans that fit first (fastest first), then the rest by memory saved.")
    findings: list[Finding] = Field(default_factory=list)


def _last_resort(f: FixSuggestion) -> bool:
    """bf16 gradient reduction trades numerics for speed/memory: listed after every other fix."""
    return "implementation.grad_reduce_in_fp32" in f.fields


def _evaluate(plan: Plan) -> Evaluation | None:
    """evaluate_plan, or None when the plan breaks a validator rule or cannot be estimated."""
    try:
        ev = evaluate_plan(plan)
    except (KeyError, ValueError, ArithmeticError):
        return None
    if any(f.severity == "error" for f in ev.findings) or ev.performance is None or ev.memory is None:
        return None
    return ev


def _evaluate_candidates(plan: Plan, shape: ModelShape, purpose: Literal["speed", "memory"], measured_mfu: float | None,
                         base: Evaluation) -> tuple[list[FixSuggestion], int]:
    out: list[FixSuggestion] = []
    rejected = 0
    seen: set[str] = set()
    # One generator for every tool (planning/plan_changes): memory fixes are exactly estimate_memory's.
    changes = (plan_changes(plan, "speed") if purpose == "speed"
               else [f.change for f in memory_fix_candidates(plan, base.memory)])
    for ch in changes:
        desc, fields, cand, caveat = ch.description, ch.fields, ch.plan, ch.note
        key = cand.model_dump_json()
        if key in seen:
            continue
        seen.add(key)
        ev = _evaluate(cand)
        if ev is None or (purpose == "speed" and not ev.memory.fits):
            rejected += 1
            continue
        t0, t1 = base.performance.iteration_time_s, ev.performance.iteration_time_s
        # Same tokens per step: the predicted speed-up carries over to the measured MFU.
        mfu_after = measured_mfu * t0 / t1 if measured_mfu is not None else ev.performance.mfu_bf16_causal_pct
        out.append(FixSuggestion(
            change=desc, fields=fields, plan=cand,
            predicted_step_time_s_before=t0, predicted_step_time_s_after=t1, predicted_throughput_change_pct=100 * (t0 / t1 - 1),
            predicted_mfu_causal_pct_after=mfu_after,
            peak_memory_gib_before=base.memory.total_gib, peak_memory_gib_after=ev.memory.total_gib,
            memory_saved_gib=base.memory.total_gib - ev.memory.total_gib, fits=ev.memory.fits, caveat=caveat,
        ))
    return out, rejected


# ---------------------------------------------------------------------------------------------
# Low MFU
# ---------------------------------------------------------------------------------------------


def _components(plan: Plan, shape: ModelShape, perf: PerfEstimate, step_s: float) -> list[GapComponent]:
    b = perf.breakdown
    dims = parallel_dims(plan)
    g = gpu(plan.cluster.gpu)
    tr = plan.training
    world = plan.cluster.num_gpus
    pt = flops_per_token_breakdown(shape, tr.seq_length, "causal", tensor_model_parallel_size=dims.tp)
    tokens = tr.global_batch_size * tr.seq_length
    gemm_rate = (g.fp8_dense_tflops if tr.precision == "fp8" and g.fp8_dense_tflops else g.bf16_dense_tflops) * 1e12
    ideal_gemm = (pt.total_flops - pt.core_attention_flops) * tokens / world / gemm_rate
    ideal_attn = pt.core_attention_flops * tokens / world / (g.bf16_dense_tflops * 1e12)
    m = perf.num_microbatches
    rows = [
        ("pipeline bubble", b.pipeline_bubble_s,
         f"fill and drain of {dims.pp} stages over {m} micro-batches" + (f", {dims.vp} model chunks each" if dims.vp > 1 else "")
         + f": (pp-1)/(vp*m) = {pipeline_bubble_fraction(dims.pp, dims.vp, m):.1%} of the compute"),
        ("exposed TP/SP communication", b.tp_comm_exposed_s, f"TP={dims.tp} all-gather/reduce-scatter not hidden behind GEMMs"),
        ("exposed CP communication", b.cp_comm_exposed_s, f"CP={dims.cp} K/V ring not hidden behind attention"),
        ("MoE all-to-all", b.ep_comm_s, f"EP={dims.ep} token dispatch and combine"),
        ("pipeline send/receive", b.pp_p2p_s, "activations and gradients between stages on the critical path"),
        ("exposed DP communication", b.dp_comm_exposed_s, f"DP={dims.dp} gradient reduce / parameter gather not overlapped"),
        ("activation recompute", b.recompute_s, f"{plan.parallelism.recompute_granularity} recompute reruns forward work"),
        ("optimizer step", b.optimizer_s, "Adam over the local parameter shard (memory-bound)"),
        ("GEMMs below peak", max(0.0, b.gemm_s - ideal_gemm),
         f"GEMMs at {ideal_gemm / b.gemm_s:.0%} of peak: small or oddly shaped GEMMs (micro-batch {tr.micro_batch_size}, TP {dims.tp}) and wave quantization" if b.gemm_s > 0 else ""),
        ("attention below peak", max(0.0, b.attention_s - ideal_attn),
         f"core attention at {ideal_attn / b.attention_s:.0%} of peak ({plan.implementation.transformer_impl}, attention_backend {plan.implementation.attention_backend})" if b.attention_s > 0 else ""),
        ("element-wise kernels", b.elementwise_s, "norms, activations, residuals, RoPE, cross-entropy: memory-bound work with no counted FLOPs"),
        ("host-bound launches", b.host_bound_s,
         f"layers too small to outrun the host's kernel launches at micro-batch {tr.micro_batch_size}: a larger micro-batch (or fewer, larger layers per GPU) hides them"),
        ("data loader's attention masks", b.dataloader_mask_s,
         "Megatron-LM's default builds, pins and copies a seq x seq mask per sample that causal attention never reads: --no-create-attention-mask-in-dataloader"),
        ("fixed overhead", b.overhead_s, "per-iteration launch and host overhead"),
    ]
    return sorted(
        (GapComponent(name=n, time_s=s, share_of_step_pct=100 * s / step_s, explanation=e) for n, s, e in rows if s > 1e-6 * step_s),
        key=lambda c: -c.time_s,
    )


def low_mfu(plan: Plan, measured_step_s: float | None, parsed: ParsedLog | None = None) -> LowMfuDiagnosis:
    """Decompose the step time and rank speed fixes (see diagnose_low_mfu in diagnosis/mfu.py)."""
    shape = resolve_model(plan.model)
    notes: list[str] = []
    pre = evaluate_plan(plan)
    if pre.performance is None or pre.memory is None:
        raise ValueError("plan: the layout breaks Megatron rules, so its step time cannot be decomposed: " + "; ".join(pre.explanation))
    pred = pre.performance.iteration_time_s
    measured_mfu = pre.performance.mfu_bf16_causal_pct * pred / measured_step_s if measured_step_s else None
    fixes, rejected = _evaluate_candidates(plan, shape, "speed", measured_mfu, pre)
    step = measured_step_s or pred
    comps = _components(plan, shape, pre.performance, step)
    ratio = measured_step_s / pred if measured_step_s else None
    if ratio is not None and ratio > UNEXPLAINED_RATIO:
        comps.insert(0, GapComponent(
            name="unexplained by the model", time_s=measured_step_s - pred, share_of_step_pct=100 * (1 - pred / measured_step_s),
            explanation="measured time beyond the performance model: data loading, stragglers or slow ranks, network slower than "
                        "assumed, clock throttling, or a plan field that differs from the run (check the arguments dump)"))
    stats: IterationTimeStats | None = parsed.iteration_time if parsed else None
    if stats is not None and stats.num_records >= 3 and (stats.coefficient_of_variation > STALL_CV_THRESHOLD or stats.spike_excess_share > 0.02):
        comps.append(GapComponent(
            name="iteration-time spikes", time_s=stats.spike_excess_share * stats.mean_ms / 1000,
            share_of_step_pct=100 * stats.spike_excess_share,
            explanation=f"logged times spread {stats.coefficient_of_variation:.1%} (stdev/mean), {stats.num_spikes} of "
                        f"{stats.num_records} records over 1.3x the median {stats.median_ms:.0f} ms: data-loader stalls, "
                        "checkpoint saves, garbage collection or evaluation inside the interval"))
        notes.append("spiky iteration times: raise --num-workers for the data loader, put the dataset on local or faster "
                     "storage, enable --async-save for checkpoints, and keep evaluation out of the timed interval"
                     + ("" if plan.implementation.manual_gc else
                        "; for Python garbage-collection pauses set implementation.manual_gc (--manual-gc, collections "
                        "every manual_gc_interval steps on all ranks at once)"))
    fixes.sort(key=lambda f: (_last_resort(f), -f.predicted_throughput_change_pct))
    fixes = [f for f in fixes if f.predicted_throughput_change_pct > 1.0][:MAX_FIXES]
    if not fixes:
        notes.append("no single plan change the models evaluate gains more than 1%")
    return LowMfuDiagnosis(
        predicted_step_time_s=pred, predicted_mfu_causal_pct=pre.performance.mfu_bf16_causal_pct, measured_step_time_s=measured_step_s,
        measured_over_predicted=ratio, components=comps, fixes=fixes, num_candidates_rejected=rejected, notes=notes,
    )


# ---------------------------------------------------------------------------------------------
# OOM
# ---------------------------------------------------------------------------------------------


def _outside_pytorch_gib(ev: OomEvent) -> float:
    """Memory neither in this process's caching allocator nor free nor (when NVML listed them) in
    other processes: the CUDA context, NCCL/userbuffers, cuDNN/cuBLAS workspaces, other libraries,
    or unlisted processes. The pre-2.1 message has no process list, so everything lands here."""
    cap = ev.total_capacity_gib or 0.0
    reserved = ev.allocated_by_pytorch_gib + ev.reserved_unallocated_gib + ev.private_pools_gib
    if ev.this_process_in_use_gib is not None:
        return max(0.0, ev.this_process_in_use_gib - reserved)
    return max(0.0, cap - (ev.free_gib or 0.0) - reserved - ev.other_processes_in_use_gib)


def _verdict(ev: OomEvent) -> tuple[str, str]:
    cap = ev.total_capacity_gib or 0.0
    free = ev.free_gib or 0.0
    frag = ev.reserved_unallocated_gib
    outside = _outside_pytorch_gib(ev)
    if ev.other_processes_in_use_gib > max(1.0, 0.05 * cap):
        return "other_processes", (
            f"other processes hold {ev.other_processes_in_use_gib:.2f} GiB of this GPU: a stale job or a second process per GPU. "
            "Kill them (nvidia-smi) or give each rank its own GPU before changing the plan")
    if outside > max(1.0, 0.10 * cap):
        return "outside_pytorch", (
            f"{outside:.2f} GiB of the {cap:.2f} GiB GPU is held outside this process's PyTorch allocator"
            + (" (this process's non-PyTorch memory: NCCL buffers, TE userbuffers for tp_comm_overlap, CUDA graphs, cuDNN/cuBLAS workspaces)"
               if ev.this_process_in_use_gib is not None else
               " (the pre-2.1 message does not say by whom: another process on the GPU, or this process's CUDA context, NCCL and library workspaces)")
            + f"; PyTorch itself held only {ev.allocated_by_pytorch_gib + frag:.2f} GiB. Check nvidia-smi for other processes, "
            "then NCCL_BUFFSIZE / the number of communicators and CUDA-graph pools")
    if frag > FRAGMENTATION_MIN_SHARE * cap and ev.tried_to_allocate_gib <= free + frag:
        return "fragmentation", (
            f"fragmentation: {frag:.2f} GiB was reserved by PyTorch but unallocated, and {free:.2f} GiB free + that would have held "
            f"the {ev.tried_to_allocate_gib:.2f} GiB request; the cached blocks were not contiguous. "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets the allocator map pages on demand and usually removes this OOM without other changes")
    return "over_commitment", (
        f"real over-commitment: {ev.allocated_by_pytorch_gib:.2f} GiB live in tensors + {ev.tried_to_allocate_gib:.2f} GiB asked for "
        f"exceed what the GPU has left ({cap:.2f} GiB total, {frag:.2f} GiB cached-but-free); the plan needs less memory per GPU")


def oom(parsed: ParsedLog, plan: Plan | None) -> OomDiagnosis:
    """Read the OOM against capacity and the plan's estimate; rank memory fixes."""
    reports = sorted(parsed.memory_reports, key=lambda m: -(m.max_reserved_gib or m.max_allocated_gib or 0.0))
    findings: list[Finding] = []
    if not parsed.oom_events:
        msg = "an out-of-memory error was seen but its numbers could not be read: " + (
            parsed.error_lines.get("out_of_memory_unparsed") or parsed.error_lines.get("out_of_memory") or "")
        base = OomDiagnosis(verdict="no_oom_numbers", message=msg, measured_reports=reports, theoretical_memory=parsed.theoretical_memory)
        return _with_plan(base, plan, None) if plan is not None else base
    ev = max(parsed.oom_events, key=lambda e: e.allocated_by_pytorch_gib + e.reserved_unallocated_gib)
    verdict, msg = _verdict(ev)
    where = {
        "total_capacity": ev.total_capacity_gib or 0.0,
        "allocated_by_pytorch": ev.allocated_by_pytorch_gib,
        "reserved_unallocated": ev.reserved_unallocated_gib,
        "private_pools": ev.private_pools_gib,
        "outside_pytorch": _outside_pytorch_gib(ev),
        "other_processes": ev.other_processes_in_use_gib,
        "free": ev.free_gib or 0.0,
        "requested": ev.tried_to_allocate_gib,
    }
    base = OomDiagnosis(
        verdict=verdict, message=msg, event=ev,  # type: ignore[arg-type]
        ranks_with_oom=sorted({e.rank for e in parsed.oom_events if e.rank is not None}),
        where_memory_went_gib=where, measured_reports=reports, theoretical_memory=parsed.theoretical_memory, findings=findings,
    )
    return _with_plan(base, plan, ev) if plan is not None else base


def _with_plan(base: OomDiagnosis, plan: Plan, ev: OomEvent | None) -> OomDiagnosis:
    shape = resolve_model(plan.model)
    base_ev = evaluate_plan(plan)
    mem = base_ev.memory
    if mem is None:
        return base.model_copy(update={"estimate_vs_message": "no memory estimate: " + "; ".join(base_ev.explanation)})
    est = {
        "weights": mem.weights_gib, "gradients": mem.gradients_gib, "optimizer": mem.optimizer_gib,
        "activations": mem.activations_gib, "transient": mem.transient_gib, "buffers": mem.buffers_gib,
        "peak_allocated": mem.peak_allocated_gib, "fragmentation_allowance": mem.fragmentation_gib,
        "non_pytorch": mem.non_pytorch_gib, "total": mem.total_gib, "capacity": mem.capacity_gib,
    }
    cmp = None
    if ev is not None:
        seen = ev.allocated_by_pytorch_gib + ev.tried_to_allocate_gib
        cmp = (f"the memory model predicts a {mem.peak_allocated_gib:.1f} GiB allocated peak ({mem.peak_phase.replace('_', '/')}) on "
               f"pipeline rank {mem.most_loaded_pipeline_rank} ({mem.most_loaded_role}) and {mem.total_gib:.1f} GiB in total against "
               f"{mem.capacity_gib:.1f} GiB; the failing rank had {ev.allocated_by_pytorch_gib:.1f} GiB live and asked for "
               f"{ev.tried_to_allocate_gib:.2f} GiB more ({seen:.1f} GiB)")
        if mem.fits and base.verdict == "over_commitment":
            cmp += ("; the model says the plan fits, so the run used more than the plan describes "
                    "(another micro-batch size, recompute off, unfused attention, MoE routing imbalance, a memory leak)")
        elif not mem.fits:
            cmp += f"; the model also finds it {-mem.headroom_gib:.1f} GiB over"
    rank_txt = f"pipeline rank {mem.most_loaded_pipeline_rank} ({mem.most_loaded_role} stage)"
    if base.measured_reports:
        top = base.measured_reports[0]
        rank_txt += f"; in the log rank {top.rank} reported the highest peak ({(top.max_reserved_gib or top.max_allocated_gib or 0):.1f} GiB)"
    fixes, _ = _evaluate_candidates(plan, shape, "memory", None, base_ev) if base_ev.performance is not None else ([], 0)
    frag_first = base.verdict == "fragmentation"

    def key(f: FixSuggestion) -> tuple:
        expandable = f.fields == ["implementation.expandable_segments"]
        return (not (frag_first and expandable), _last_resort(f), not f.fits,
                -f.predicted_throughput_change_pct if f.fits else -f.memory_saved_gib)

    fixes = sorted((f for f in fixes if f.memory_saved_gib > 0.05), key=key)[:MAX_FIXES]
    return base.model_copy(update={"estimate": est, "estimate_vs_message": cmp, "most_loaded_rank": rank_txt, "fixes": fixes})


__all__ = ["GapComponent", "FixSuggestion", "LowMfuDiagnosis", "OomDiagnosis", "low_mfu", "oom"]
