"""What each tool answers: a compact text summary for the reader and compact numbers for the program.

The core's results are complete (every stage, every assumption, whole plans inside every fix);
sent as they are they overflow an assistant's context. Here each result becomes
- text: the few lines an engineer reads in chat (the CLI prints the same lines), and
- structured content: the key figures under the core's own field names, plans as `plan_id`
  handles (the full plan is the `mcore://plans/{plan_id}` resource), the full result only when
  asked (`detail='full'`).
Non-finite floats never leave: `finite()` turns them into null and names the fields.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Detail = Literal["summary", "full"]
_OUT = ConfigDict(frozen=True)
# Float fields are nullable: finite() turns a non-finite figure into null rather than failing the answer.


# ---- formatting ------------------------------------------------------------------------------


def fmt(v: Any, nd: int = 1) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:,.{nd}f}" if abs(v) >= 100 else f"{v:.3g}"  # small figures keep 3 significant digits
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [[str(c) for c in header]] + [[fmt(c) if not isinstance(c, str) else c for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def finite(obj: Any, path: str = "", bad: list[str] | None = None) -> tuple[Any, list[str]]:
    """`obj` with every NaN/infinity replaced by None, and the dotted paths where that happened."""
    bad = [] if bad is None else bad
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj, bad
        bad.append(path or "result")
        return None, bad
    if isinstance(obj, dict):
        return {k: finite(v, f"{path}.{k}" if path else str(k), bad)[0] for k, v in obj.items()}, bad
    if isinstance(obj, list | tuple):
        return [finite(v, f"{path}[{i}]", bad)[0] for i, v in enumerate(obj)], bad
    return obj, bad


def findings_text(findings: Sequence[Any], limit: int = 8) -> list[str]:
    order = {"error": 0, "warning": 1, "info": 2}
    ranked = sorted(findings, key=lambda f: order.get(f.severity, 3))
    out = [f"[{f.severity}] {', '.join(f.fields)}: {f.message}" + (f" -> fix: {f.fix}" if f.fix else "")
           for f in ranked[:limit]]
    if len(ranked) > limit:
        out.append(f"... {len(ranked) - limit} more findings (detail='full')")
    return out


def model_label(spec: Any) -> str:
    """A plan's model in one phrase: its catalog key, else where its shape came from."""
    return spec.name or ("the hf_config model" if spec.hf_config else "the custom model")


# ---- shared output pieces -----------------------------------------------------------------------


class FindingOut(BaseModel):
    model_config = _OUT
    code: str
    severity: str
    fields: list[str]
    message: str
    fix: str | None = None


def findings_out(findings: Sequence[Any]) -> list[FindingOut]:
    order = {"error": 0, "warning": 1, "info": 2}
    return [FindingOut(**f.model_dump()) for f in sorted(findings, key=lambda f: order.get(f.severity, 3))]


class MemoryOut(BaseModel):
    """Per-GPU memory on the most-loaded rank, GiB."""

    model_config = _OUT
    most_loaded_pipeline_rank: int
    weights_gib: float | None = None
    gradients_gib: float | None = None
    optimizer_gib: float | None = None
    activations_gib: float | None = None
    transient_gib: float | None = None
    buffers_gib: float | None = None
    fragmentation_gib: float | None = None
    non_pytorch_gib: float | None = None
    peak_allocated_gib: float | None = None
    total_gib: float | None = None
    capacity_gib: float | None = None
    headroom_gib: float | None = None
    fits: bool


MEMORY_TERMS = ("weights", "gradients", "optimizer", "activations", "transient", "buffers", "fragmentation", "non_pytorch")


def memory_out(bd: Any) -> MemoryOut:
    return MemoryOut(**bd.model_dump(include=set(MemoryOut.model_fields)))


class PerformanceOut(BaseModel):
    """Predicted speed. TFLOP/s name their FLOP convention; MFU is against the dense BF16 peak."""

    model_config = _OUT
    iteration_time_s: float | None = None
    tokens_per_s_per_gpu: float | None = None
    tokens_per_s: float | None = None
    model_tflops_per_gpu_causal: float | None = None
    model_tflops_per_gpu_full: float | None = None
    mfu_bf16_causal_pct: float | None = None
    mfu_bf16_full_pct: float | None = None
    hfu_bf16_causal_pct: float | None = None
    mfu_fp8_causal_pct: float | None = None
    pipeline_bubble_fraction: float | None = None
    num_microbatches: int
    step_time_breakdown_s: dict[str, float | None] = Field(description="Terms that sum to iteration_time_s.")


def performance_out(perf: Any) -> PerformanceOut:
    data = perf.model_dump(include=set(PerformanceOut.model_fields) - {"step_time_breakdown_s"})
    terms = {k: v for k, v in perf.breakdown.model_dump().items() if v}
    return PerformanceOut(**data, step_time_breakdown_s=terms)


# ---- recommend_parallelism -------------------------------------------------------------------


class PlanRow(BaseModel):
    """One ranked plan; its full plan is mcore://plans/{plan_id}, accepted by every tool as plan_id."""

    model_config = _OUT
    plan_id: str
    rank: int
    layout: str
    iteration_time_s: float | None = None
    tokens_per_s_per_gpu: float | None = None
    model_tflops_per_gpu_causal: float | None = None
    model_tflops_per_gpu_full: float | None = None
    mfu_bf16_causal_pct: float | None = None
    mfu_fp8_causal_pct: float | None = None
    memory_total_gib: float | None = None
    headroom_gib: float | None = None
    data_parallel_size: int
    num_microbatches: int
    pipeline_bubble_fraction: float | None = None
    relative_throughput: float | None = None


class WhatIfOut(BaseModel):
    model_config = _OUT
    scenario: str
    num_gpus: int
    seq_length: int
    feasible: bool
    layout: str | None
    tokens_per_s_per_gpu: float | None
    change_tokens_per_s_pct: float | None


class NearestRunOut(BaseModel):
    model_config = _OUT
    source: str
    model: str
    num_gpus: int | None
    gpu: str | None
    precision: str | None
    layout: str
    measured_tokens_per_s_per_gpu: float | None
    measured_tflops_per_gpu: float | None
    flop_convention: str
    predicted_tokens_per_s_per_gpu: float | None


class RecommendOut(BaseModel):
    """Ranked layouts (best first) with their key predictions; explanations are in the text."""

    model_config = _OUT
    feasible: bool
    global_batch_size: int
    plans: list[PlanRow]
    nearest_published_run: NearestRunOut | None
    what_if: list[WhatIfOut]
    min_gpus_for_model_state: int
    candidates_evaluated: int
    search_s: float | None
    full: dict[str, Any] | None = Field(None, description="With detail='full': the complete result.")


def recommend_view(rec: Any, add_plan: Callable[[Any], str], detail: Detail) -> tuple[str, dict[str, Any]]:
    rows = [PlanRow(plan_id=add_plan(p.plan), **p.model_dump(include=set(PlanRow.model_fields) - {"plan_id"}))
            for p in rec.plans]
    n = rec.nearest_published_run
    out = RecommendOut(
        feasible=rec.feasible, global_batch_size=rec.global_batch_size, plans=rows,
        nearest_published_run=NearestRunOut(**n.model_dump(include=set(NearestRunOut.model_fields))) if n else None,
        what_if=[WhatIfOut(**w.model_dump(include=set(WhatIfOut.model_fields))) for w in rec.what_if],
        min_gpus_for_model_state=rec.min_gpus_for_model_state,
        candidates_evaluated=rec.stats.candidates_evaluated, search_s=rec.stats.elapsed_s,
        full=rec.model_dump(mode="json") if detail == "full" else None,
    )
    return recommend_text(rec, [r.plan_id for r in rows]), out.model_dump(mode="json")


def recommend_text(rec: Any, plan_ids: Sequence[str] | None = None) -> str:
    first = rec.plans[0].plan if rec.plans else None
    head = f"global batch {rec.global_batch_size}"
    if first is not None:
        c, t = first.cluster, first.training
        head = f"{model_label(first.model)} on {c.num_gpus} x {c.gpu}, seq {t.seq_length}, " + head
    lines = [head]
    if rec.plans:
        ids = list(plan_ids) if plan_ids else [str(p.rank) for p in rec.plans]
        rows = [[pid, p.layout, p.iteration_time_s, p.tokens_per_s_per_gpu, p.model_tflops_per_gpu_causal,
                 p.mfu_bf16_causal_pct, p.memory_total_gib, p.headroom_gib] for pid, p in zip(ids, rec.plans, strict=True)]
        lines.append(table(rows, ["plan", "layout", "step s", "tok/s/GPU", "TFLOP/s causal", "MFU %", "mem GiB", "free GiB"]))
    lines.extend(f"- {x}" for x in rec.explanation)
    n = rec.nearest_published_run
    if n is not None:
        prec = f" {n.precision.split(' ')[0]}" if n.precision else ""
        lines.append(f"nearest published run: {n.model} on {n.num_gpus} {n.gpu}{prec} ({n.source}), {n.layout}: "
                     f"{fmt(n.measured_tokens_per_s_per_gpu, 0)} tokens/s/GPU, {fmt(n.measured_tflops_per_gpu)} TFLOP/s "
                     f"({n.flop_convention}); predicted for it: {fmt(n.predicted_tokens_per_s_per_gpu, 0)} tokens/s/GPU"
                     + (f"; differs in: {'; '.join(n.differences)}" if n.differences else "; like for like"))
    lines.extend(f"what if {w.scenario}: {w.note}" for w in rec.what_if)
    if not rec.feasible:
        lines.append("no plan fits:")
        lines.extend(f"- {x}" for x in rec.suggestions)
    lines.extend(f"note: {x}" for x in rec.notes)
    st = rec.stats
    rate = f" ({st.candidates_per_s:,.0f}/s)" if st.candidates_per_s and math.isfinite(st.candidates_per_s) else ""
    lines.append(f"searched {st.candidates_evaluated:,} configurations{rate}")
    return "\n".join(lines)


# ---- evaluate_plan / estimate_memory ------------------------------------------------------------


class EvaluateOut(BaseModel):
    """valid=false: Megatron would refuse the plan (error findings first); no speed is quoted for it."""

    model_config = _OUT
    valid: bool
    feasible: bool
    plan_id: str
    findings: list[FindingOut]
    data_parallel_size: int
    num_microbatches: int
    memory: MemoryOut | None
    performance: PerformanceOut | None
    full: dict[str, Any] | None = None


def _valid(findings: Sequence[Any]) -> bool:
    return not any(f.severity == "error" for f in findings)


def evaluate_view(ev: Any, plan_id: str, detail: Detail) -> tuple[str, dict[str, Any]]:
    valid = _valid(ev.findings)
    out = EvaluateOut(
        valid=valid, feasible=ev.feasible, plan_id=plan_id, findings=findings_out(ev.findings),
        data_parallel_size=ev.parallel.data_parallel_size, num_microbatches=ev.parallel.num_microbatches,
        memory=memory_out(ev.memory) if ev.memory is not None else None,
        performance=performance_out(ev.performance) if (ev.performance is not None and valid) else None,
        full=ev.model_dump(mode="json") if detail == "full" else None,
    )
    return evaluate_text(ev, plan_id), out.model_dump(mode="json")


def evaluate_text(ev: Any, plan_id: str | None = None) -> str:
    valid = _valid(ev.findings)
    head = "INVALID: Megatron would refuse this plan" if not valid else ("feasible" if ev.feasible else "valid but does not fit")
    lines = [f"verdict: {head}" + (f" (plan {plan_id})" if plan_id else "")]
    if not valid:
        lines.extend(findings_text([f for f in ev.findings if f.severity == "error"]))
    lines.extend(f"- {x}" for x in ev.explanation if valid or not x.startswith("step "))
    if ev.performance is not None and valid:
        step = ev.performance.iteration_time_s
        terms = [(k, v) for k, v in ev.performance.breakdown.model_dump().items() if isinstance(v, float) and v > 0]
        rows = [[k, f"{v:.3f}", f"{100 * v / step:.1f}"] for k, v in sorted(terms, key=lambda kv: -kv[1])]
        lines.append(table(rows, ["step-time term", "s", "%"]))
    rest = [f for f in ev.findings if valid or f.severity != "error"]
    if rest:
        lines.append("findings:")
        lines.extend(f"  {x}" for x in findings_text(rest))
    return "\n".join(lines)


class MemoryChangeOut(BaseModel):
    model_config = _OUT
    field: str
    current: str | int | float | bool | list[str] | None = None
    proposed: str | int | float | bool | list[str] | None = None
    saves_gib: float | None = None
    total_gib_after: float | None = None
    fits_after: bool


class MemoryReportOut(BaseModel):
    """Per-GPU memory of the most-loaded rank, whether it fits, and single-field fixes."""

    model_config = _OUT
    valid: bool
    fits: bool
    plan_id: str
    memory: MemoryOut
    imbalance_gib: float | None = None
    stages_peak_allocated_gib: dict[str, float | None] = Field(description="Pipeline rank -> peak allocated GiB.")
    suggestions: list[MemoryChangeOut]
    findings: list[FindingOut]
    full: dict[str, Any] | None = None


def memory_view(rep: Any, plan_id: str, detail: Detail) -> tuple[str, dict[str, Any]]:
    bd = rep.breakdown
    out = MemoryReportOut(
        valid=_valid([f for f in rep.findings if f.code != "does_not_fit"]), fits=rep.fits, plan_id=plan_id,
        memory=memory_out(bd), imbalance_gib=rep.imbalance_gib,
        stages_peak_allocated_gib={str(s.pipeline_rank): s.peak_allocated_bytes / 2**30 for s in bd.stages},
        suggestions=[MemoryChangeOut(**c.model_dump(include=set(MemoryChangeOut.model_fields))) for c in rep.suggestions],
        findings=findings_out(rep.findings), full=rep.model_dump(mode="json") if detail == "full" else None,
    )
    return memory_text(rep, plan_id), out.model_dump(mode="json")


def memory_text(rep: Any, plan_id: str | None = None) -> str:
    b = rep.breakdown
    rows = [[n.replace("_", "-"), f"{getattr(b, f'{n}_gib'):.2f}"] for n in MEMORY_TERMS]
    lines = [f"most-loaded GPU: pipeline rank {rep.most_loaded_pipeline_rank} ({rep.most_loaded_role} stage), "
             f"{rep.imbalance_gib:.1f} GiB above the least-loaded" + (f" (plan {plan_id})" if plan_id else ""),
             table(rows, ["term", "GiB"]),
             f"peak allocated {b.peak_allocated_gib:.2f} GiB, reserved {b.peak_reserved_gib:.2f} GiB, "
             f"total {b.total_gib:.2f} of {b.capacity_gib:.2f} GiB -> {'fits' if rep.fits else 'DOES NOT FIT'} "
             f"(headroom {rep.headroom_gib:.2f} GiB)"]
    for ch in rep.suggestions[:6]:
        lines.append(f"- {ch.summary}{' (then fits)' if ch.fits_after else ''}: {ch.note}")
    if rep.findings:
        lines.append("findings:")
        lines.extend(f"  {x}" for x in findings_text(rep.findings))
    return "\n".join(lines)


# ---- check_mfu -----------------------------------------------------------------------------------


class FixOut(BaseModel):
    model_config = _OUT
    change: str
    plan_id: str
    predicted_throughput_change_pct: float | None = None
    memory_saved_gib: float | None = None
    fits: bool | None = None


class MfuOut(BaseModel):
    """MFU/HFU in both FLOP conventions against the named dense peak, and ranked fixes as plan handles."""

    model_config = _OUT
    plan_id: str | None
    plan_source: str
    iteration_time_s: float | None
    tokens_per_s_per_gpu: float | None
    model_tflops_per_gpu_causal: float | None
    model_tflops_per_gpu_full: float | None
    mfu_causal_pct: float | None
    mfu_full_pct: float | None
    hfu_causal_pct: float | None
    peak_tflops_per_gpu: float | None
    log_convention: str | None
    oom_verdict: str | None
    fixes: list[FixOut]
    findings: list[FindingOut]
    full: dict[str, Any] | None = None


def mfu_view(rep: Any, add_plan: Callable[[Any], str], detail: Detail) -> tuple[str, dict[str, Any]]:
    fixes: list[FixOut] = []
    if rep.diagnosis is not None:
        fixes += [FixOut(change=f.change, plan_id=add_plan(f.plan), predicted_throughput_change_pct=f.predicted_throughput_change_pct,
                         memory_saved_gib=f.memory_saved_gib) for f in rep.diagnosis.fixes[:5]]
    if rep.oom_diagnosis is not None:
        fixes += [FixOut(change=f.change, plan_id=add_plan(f.plan), predicted_throughput_change_pct=f.predicted_throughput_change_pct,
                         memory_saved_gib=f.memory_saved_gib, fits=getattr(f, "fits", None)) for f in rep.oom_diagnosis.fixes[:5]]
    lc = rep.log_convention
    out = MfuOut(
        plan_id=add_plan(rep.plan) if rep.plan is not None else None, plan_source=rep.plan_source,
        **rep.model_dump(include={"iteration_time_s", "tokens_per_s_per_gpu", "model_tflops_per_gpu_causal",
                                  "model_tflops_per_gpu_full", "mfu_causal_pct", "mfu_full_pct", "hfu_causal_pct"}),
        peak_tflops_per_gpu=rep.peak.tflops_per_gpu if rep.peak else None,
        log_convention=getattr(lc, "convention", None) if lc is not None else None,
        oom_verdict=rep.oom_diagnosis.verdict if rep.oom_diagnosis is not None else None,
        fixes=fixes, findings=findings_out(rep.findings),
        full=rep.model_dump(mode="json") if detail == "full" else None,
    )
    text = rep.summary_text() or "nothing to report: give log_text, or a plan with iteration_time_s / tokens_per_s_per_gpu"
    if fixes:
        text += "\nfix plans: " + ", ".join(f"{f.plan_id} ({f.change})" for f in fixes)
    return text, out.model_dump(mode="json")


# ---- render_launch_script ---------------------------------------------------------------------


class RenderOut(BaseModel):
    """The script is the text content; here what runs it."""

    model_config = _OUT
    plan_id: str
    target: str
    launcher: str
    script_name: str
    command: str
    megatron_args: list[str]
    notes: list[str]
    full: dict[str, Any] | None = None


def render_view(art: Any, plan_id: str, detail: Detail) -> tuple[str, dict[str, Any]]:
    out = RenderOut(plan_id=plan_id, **art.model_dump(include={"target", "launcher", "script_name", "command",
                                                                "megatron_args", "notes"}),
                    full=art.model_dump(mode="json") if detail == "full" else None)
    text = f"save as {art.script_name}, run: {art.command}\n\n{art.script.rstrip()}"
    return text, out.model_dump(mode="json")


# ---- jobs -----------------------------------------------------------------------------------------


class SubmissionOut(BaseModel):
    model_config = _OUT
    job_id: str | None
    dry_run: bool
    backend: str
    state: str | None
    phase: str | None = None
    job_dir: str
    command_line: str
    plan_id: str
    predicted: dict[str, Any] | None
    warnings: list[FindingOut]


class JobOut(BaseModel):
    """A profile job: state, phase and ETA while it runs, measured vs predicted when done."""

    model_config = _OUT
    job_id: str
    name: str
    backend: str
    state: str
    phase: str
    steps_done: int | None
    steps_total: int | None
    eta_s: float | None
    elapsed_s: float | None
    error: str | None
    comparison: list[dict[str, Any]]
    comparison_note: str | None
    host_floor_ms_per_layer: float | None = Field(None, description="This machine's measured host speed (its jobs' probes): pass it as cluster.host_floor_ms_per_layer to plan more runs on it.")
    log_tail: str | None
    full: dict[str, Any] | None = None


class JobsOut(BaseModel):
    model_config = _OUT
    jobs: list[dict[str, Any]]
