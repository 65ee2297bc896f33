"""check_mfu: MFU and HFU of a run in both FLOP conventions, the log's own convention, claim checks,
the published band for comparable runs, and a diagnosis of low MFU or an OOM.

Arithmetic (Megatron `training.py::training_log`): TFLOP/s/GPU = F / (t_iter * 1e12 * world),
F = `num_floating_point_operations(args, global_batch_size)` (physics/flops.py). MFU = that / the GPU's
dense BF16 peak (never the 2:4-sparse figure: Megatron-LM #1276, maintainer: "the denominator ... is
989 TFLOPS" for H100); HFU counts the recomputed forward work too. Every figure exists in both
conventions: 'causal' (Megatron since 2025-03 halves the core-attention term) and 'full' (earlier
Megatron, NeMo 24.x, the 2021/2022 papers).

Pure: the log arrives as text (diagnosis/logparse.py); no I/O.
"""

from __future__ import annotations

import statistics
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from mcore_advisor.diagnosis.config_dump import plan_from_config_dump
from mcore_advisor.diagnosis.diagnose import (
    FixSuggestion,
    GapComponent,
    LowMfuDiagnosis,
    OomDiagnosis,
    low_mfu,
    oom,
)
from mcore_advisor.diagnosis.failures import FailureDiagnosis, crash, nccl_timeout
from mcore_advisor.diagnosis.logparse import ParsedLog, parse_log, plan_from_megatron_args
from mcore_advisor.knowledge.hardware import GpuSpec, gpu
from mcore_advisor.knowledge.models import catalog_model, resolve_model
from mcore_advisor.physics.flops import (
    Convention,
    flops_per_token_breakdown,
    hardware_flops_per_iteration,
)
from mcore_advisor.planning.recommend import row_is_moe
from mcore_advisor.schemas import Finding, ModelShape, Plan

_INPUT = ConfigDict(extra="forbid", frozen=True)
_RESULT = ConfigDict(frozen=True)

CONVENTION_MATCH_TOLERANCE = 0.02
"""A reported TFLOP/s matches a convention when within 2%: Megatron prints TFLOP/s to 0.1 and the
time to 0.1 ms from the same interval, NeMo to 4 significant digits, so an exact plan lands within
0.1%; 2% leaves room for a vocab padded differently or a rounded published table."""
CLAIM_TOLERANCE_PCT_POINTS = 0.5
"""A claimed MFU is consistent when within half a percentage point of the computed one (MFUs are
published to 0.1-1 point)."""


class MfuRequest(BaseModel):
    """What check_mfu needs: a plan (or a log whose arguments dump supplies it) and a measurement."""

    model_config = _INPUT

    plan: Plan | None = Field(None, description="The run's plan. Optional when log_text holds Megatron's arguments dump.")
    gpu: str | None = Field(None, description="GPU catalog key (e.g. 'h100-sxm', 'h200') when the plan comes from the log's arguments dump, which does not name the GPU; default h100-sxm. Ignored when `plan` is given.")
    model: str | None = Field(None, description="Catalog model name (e.g. 'llama3-8b') for a log without Megatron's arguments dump (NeMo, Megatron-Bridge): with num_gpus it is all a plan needs; the log's config dump supplies the rest where it has one. Ignored when `plan` is given.")
    num_gpus: int | None = Field(None, ge=1, le=1_048_576, description="The job's GPU count, for a log that does not print it. Ignored when `plan` is given.")
    seq_length: int | None = Field(None, ge=1, le=4_194_304, description="Tokens per sample, for a log that does not print it (default: the model's context, with a note). Ignored when `plan` is given.")
    log_text: str | None = Field(None, description="Pasted training log (Megatron-LM, Megatron-Bridge or NeMo 2 stdout, or a PyTorch OOM / NCCL error). Very large logs are read head and tail only.")
    # Bounds keep every derived figure finite (5e-324 tokens/s would make the step time infinite):
    # no step is shorter than a CUDA kernel launch (~5 us) and no GPU does an EFLOP/s.
    iteration_time_s: float | None = Field(None, ge=1e-6, le=1e7, description="Measured time per iteration (global batch), seconds.")
    tokens_per_s: float | None = Field(None, ge=1e-3, le=1e12, description="Measured throughput of the whole job, tokens/s.")
    tokens_per_s_per_gpu: float | None = Field(None, ge=1e-3, le=1e9, description="Measured throughput per GPU, tokens/s.")
    reported_tflops_per_gpu: float | None = Field(None, ge=1e-6, le=1e6, description="TFLOP/s/GPU as a log or paper reports it (its FLOP convention is inferred).")
    reported_tflops_convention: Literal["causal", "full"] | None = Field(None, description="Convention of reported_tflops_per_gpu when known; used only when no time or tokens/s is given to infer it.")
    claimed_mfu_pct: float | None = Field(None, ge=1e-3, le=1000, description="An MFU (%) someone claims for this run: checked against the arithmetic.")
    peak_tflops_per_gpu: float | None = Field(None, ge=1e-3, le=1e6, description="Override the MFU denominator (default: the GPU's dense BF16 peak from the hardware catalog).")
    diagnose: bool = Field(True, description="Decompose a low MFU / an OOM and rank fixes (needs the performance and memory models).")


class PeakUsed(BaseModel):
    model_config = _RESULT

    tflops_per_gpu: float
    name: str = Field(description="e.g. 'NVIDIA H100 SXM5 80GB dense BF16'.")
    source: str


class ConventionInference(BaseModel):
    """Which FLOP count a reported TFLOP/s/GPU used: the ratio of the reported figure to what each
    convention gives for the measured time."""

    model_config = _RESULT

    reported_tflops_per_gpu: float
    causal_tflops_per_gpu: float = Field(description="Model FLOPs, causal-half attention (Megatron >= 2025-03), / time.")
    full_tflops_per_gpu: float = Field(description="Model FLOPs, full s^2 attention (Megatron < 2025-03, NeMo 24.x), / time.")
    hardware_causal_tflops_per_gpu: float = Field(description="With recomputed forward work (HFU-style counting), causal.")
    hardware_full_tflops_per_gpu: float
    convention: Literal["causal", "full", "hardware_causal", "hardware_full", "ambiguous", "none"]
    relative_error_pct: float | None = Field(description="Reported vs the matching count, %.")
    message: str


class ClaimCheck(BaseModel):
    model_config = _RESULT

    claim: str
    consistent: bool
    message: str


class BandRun(BaseModel):
    model_config = _RESULT

    source: str
    model: str
    num_gpus: int | None
    mfu_causal_pct: float | None
    mfu_full_pct: float | None
    mfu_published_pct: float | None = Field(description="As published, in the source's own convention.")
    source_convention: str


class ExpectedBand(BaseModel):
    """MFU that published runs reached on this GPU family at this precision and a similar size."""

    model_config = _RESULT

    mfu_causal_pct_range: tuple[float, float] | None
    mfu_full_pct_range: tuple[float, float] | None
    runs: list[BandRun]
    selection: str = Field(description="How the comparable runs were chosen.")
    verdict: str | None = Field(None, description="Where this run falls in the band.")


class MfuReport(BaseModel):
    """check_mfu's answer. Every FLOP figure names its convention; the peak is named with its source."""

    model_config = _RESULT

    plan: Plan | None
    plan_source: Literal["request", "log_arguments", "log_config", "none"] = Field(description="'log_config': the log's Bridge/NeMo config dump and the request's model / num_gpus / seq_length.")
    measurement_source: str | None = Field(description="Where the step time came from.")
    iteration_time_s: float | None
    tokens_per_s_per_gpu: float | None
    flops_per_token_causal: float | None = None
    flops_per_token_full: float | None = None
    model_flops_per_iteration_causal: float | None = None
    model_flops_per_iteration_full: float | None = None
    hardware_flops_per_iteration_causal: float | None = None
    hardware_flops_per_iteration_full: float | None = None
    model_tflops_per_gpu_causal: float | None = None
    model_tflops_per_gpu_full: float | None = None
    mfu_causal_pct: float | None = None
    mfu_full_pct: float | None = None
    hfu_causal_pct: float | None = None
    hfu_full_pct: float | None = None
    mfu_vs_fp8_peak_causal_pct: float | None = Field(None, description="FP8 runs: MFU against the dense FP8 peak (the BF16-peak MFU stays the headline, as published tables quote it).")
    peak: PeakUsed | None
    log_convention: ConventionInference | None = None
    claim_checks: list[ClaimCheck] = Field(default_factory=list)
    expected_band: ExpectedBand | None = None
    diagnosis: LowMfuDiagnosis | None = None
    oom_diagnosis: OomDiagnosis | None = None
    failure: FailureDiagnosis | None = Field(None, description="A failed run: NCCL timeout, or a crash (import error, rejected argument, CUDA/NCCL error, killed process) with its likely causes, checks and fix.")
    log: ParsedLog | None = Field(None, description="What the log held (the last 20 iteration records).")
    findings: list[Finding] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)

    def summary_text(self) -> str:
        """A few lines for a terminal (the CLI prints this; JSON has everything)."""
        out: list[str] = []
        if self.mfu_causal_pct is not None and self.peak is not None:
            out.append(
                f"MFU {self.mfu_causal_pct:.1f}% causal / {self.mfu_full_pct:.1f}% full, HFU {self.hfu_causal_pct:.1f}% causal "
                f"({self.model_tflops_per_gpu_causal:.1f} / {self.model_tflops_per_gpu_full:.1f} TFLOP/s/GPU, "
                f"{self.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, step {self.iteration_time_s:.3f} s from {self.measurement_source}); "
                f"peak {self.peak.tflops_per_gpu:g} TFLOP/s = {self.peak.name}")
        if self.log_convention is not None:
            out.append("log convention: " + self.log_convention.message)
        out += [("ok: " if c.consistent else "claim does not hold: ") + c.message for c in self.claim_checks]
        if self.expected_band is not None and self.expected_band.verdict:
            out.append("published band: " + self.expected_band.verdict)
        if self.diagnosis is not None:
            d = self.diagnosis
            out.append("where the step goes: " + ", ".join(f"{c.name} {c.share_of_step_pct:.0f}%" for c in d.components[:4]))
            out += [f"  fix: {f.change}: {f.predicted_throughput_change_pct:+.0f}% tokens/s" + (f" ({f.caveat})" if f.caveat else "")
                    for f in d.fixes[:5]]
        if self.failure is not None:
            f = self.failure
            out.append(f"FAILED ({f.kind}): {f.summary}")
            out += [f"  {d}" for d in f.details]
            out += [f"  likely: {c}" for c in f.likely_causes]
            out += [f"  check: {c}" for c in f.checks]
            if f.fix:
                out.append(f"  fix: {f.fix}")
        if self.oom_diagnosis is not None:
            o = self.oom_diagnosis
            out.append(f"OOM ({o.verdict}): {o.message}")
            if o.estimate_vs_message:
                out.append("  " + o.estimate_vs_message)
            out += [f"  fix: {f.change}: saves {f.memory_saved_gib:.1f} GiB, {'fits' if f.fits else 'still over'}, "
                    f"{f.predicted_throughput_change_pct:+.0f}% tokens/s" for f in o.fixes[:5]]
        out += [f"{f.severity}: {f.message}" + (f" -> {f.fix}" if f.fix else "") for f in self.findings]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Arithmetic
# ---------------------------------------------------------------------------------------------


def peak_for(spec: GpuSpec, override_tflops: float | None = None) -> PeakUsed:
    if override_tflops is not None:
        return PeakUsed(tflops_per_gpu=override_tflops, name=f"{spec.name}, peak given in the request", source="request.peak_tflops_per_gpu")
    return PeakUsed(tflops_per_gpu=spec.bf16_dense_tflops, name=f"{spec.name} dense BF16", source=spec.source)


class _Flops:
    """FLOPs of one iteration of a plan, both conventions, model and hardware."""

    def __init__(self, plan: Plan, shape: ModelShape) -> None:
        t, p = plan.training, plan.parallelism
        tp = p.tensor_model_parallel_size
        self.per_token = {c: flops_per_token_breakdown(shape, t.seq_length, c, tensor_model_parallel_size=tp) for c in ("causal", "full")}
        self.model = {c: self.per_token[c].total_flops * t.global_batch_size * t.seq_length for c in ("causal", "full")}
        self.hardware = {
            c: hardware_flops_per_iteration(shape, t.seq_length, t.global_batch_size, c, p)
            for c in ("causal", "full")
        }
        self.tokens_per_iteration = t.global_batch_size * t.seq_length
        self.world = plan.cluster.num_gpus

    def tflops_per_gpu(self, kind: Literal["model", "hardware"], convention: Convention, iteration_time_s: float, gbs_scale: float = 1.0) -> float:
        f = (self.model if kind == "model" else self.hardware)[convention] * gbs_scale
        return f / (iteration_time_s * 1e12 * self.world)


def infer_convention(reported_tflops: float, fl: _Flops, iteration_time_s: float, gbs_scale: float = 1.0) -> ConventionInference:
    """Match a reported TFLOP/s/GPU against each way of counting for the measured time."""
    exp = {
        "causal": fl.tflops_per_gpu("model", "causal", iteration_time_s, gbs_scale),
        "full": fl.tflops_per_gpu("model", "full", iteration_time_s, gbs_scale),
        "hardware_causal": fl.tflops_per_gpu("hardware", "causal", iteration_time_s, gbs_scale),
        "hardware_full": fl.tflops_per_gpu("hardware", "full", iteration_time_s, gbs_scale),
    }
    err = {k: reported_tflops / v - 1.0 for k, v in exp.items()}
    # Hardware counts equal model counts without recompute: prefer the model name then.
    order = ["causal", "full"] + [k for k in ("hardware_causal", "hardware_full") if abs(exp[k] / exp[k.split("_")[1]] - 1) > 1e-9]
    within = sorted((k for k in order if abs(err[k]) <= CONVENTION_MATCH_TOLERANCE), key=lambda k: abs(err[k]))
    gap = abs(exp["full"] / exp["causal"] - 1.0)
    words = {"causal": "the 'causal' convention (Megatron >= 2025-03: half the s^2 attention)",
             "full": "the 'full' convention (full s^2 attention: Megatron < 2025-03, NeMo 24.x, the 2021/2022 papers)",
             "hardware_causal": "hardware FLOPs incl. the recomputed forward, causal attention (an HFU-style count)",
             "hardware_full": "hardware FLOPs incl. the recomputed forward, full attention (an HFU-style count, as Narayanan 2021)"}
    if not within:
        best = min(order, key=lambda k: abs(err[k]))
        msg = (f"reported {reported_tflops:.1f} TFLOP/s/GPU matches no FLOP count of this plan within "
               f"{CONVENTION_MATCH_TOLERANCE:.0%} (causal {exp['causal']:.1f}, full {exp['full']:.1f}; nearest: {best}, "
               f"{err[best]:+.1%}): the log's model, batch or GPU count differs from the plan, or it counts FLOPs its own way")
        return ConventionInference(reported_tflops_per_gpu=reported_tflops, causal_tflops_per_gpu=exp["causal"], full_tflops_per_gpu=exp["full"],
                                   hardware_causal_tflops_per_gpu=exp["hardware_causal"], hardware_full_tflops_per_gpu=exp["hardware_full"],
                                   convention="none", relative_error_pct=100 * err[best], message=msg)
    best = within[0]
    if gap < CONVENTION_MATCH_TOLERANCE and {"causal", "full"} <= set(within):
        msg = (f"reported {reported_tflops:.1f} TFLOP/s/GPU fits both conventions (causal {exp['causal']:.1f}, full "
               f"{exp['full']:.1f}): attention is only {gap:.1%} of the count at this sequence length, too little to tell them apart")
        conv: str = "ambiguous"
    else:
        others = ", ".join(f"{k} {exp[k]:.1f} ({err[k]:+.1%})" for k in order if k != best)
        msg = f"reported {reported_tflops:.1f} TFLOP/s/GPU matches {words[best]} to {abs(err[best]):.1%}; the other counts would give {others}"
        conv = best
    return ConventionInference(reported_tflops_per_gpu=reported_tflops, causal_tflops_per_gpu=exp["causal"], full_tflops_per_gpu=exp["full"],
                               hardware_causal_tflops_per_gpu=exp["hardware_causal"], hardware_full_tflops_per_gpu=exp["hardware_full"],
                               convention=conv, relative_error_pct=100 * err[best], message=msg)  # type: ignore[arg-type]


def _six_nd_flops_per_token(fl: _Flops, shape: ModelShape) -> tuple[float, str]:
    """The '6 N D' estimate people use for claims: 6 x parameters per token.

    N = the published total parameter count when the catalog has one (what a claim usually quotes,
    even for MoE), else the GEMM parameters a token passes through (Megatron's count minus core
    attention, divided by 6)."""
    if shape.name:
        try:
            cm = catalog_model(shape.name)
        except KeyError:
            cm = None
        if cm is not None and cm.total_params_b:
            return 6 * cm.total_params_b * 1e9, f"N = {cm.total_params_b:g}B published parameters"
    pt = fl.per_token["causal"]
    n = (pt.total_flops - pt.core_attention_flops) / 6
    return 6 * n, f"N = {n / 1e9:.2f}B GEMM parameters per token"


def _matching_peak(gspec: GpuSpec, implied: float) -> str | None:
    """Name the peak a claim divided by, when it is a known figure other than dense BF16."""
    candidates = {
        f"the 2:4-sparse BF16 peak ({2 * gspec.bf16_dense_tflops:.0f})": 2 * gspec.bf16_dense_tflops,
    }
    if gspec.fp8_dense_tflops:
        candidates[f"the dense FP8 peak ({gspec.fp8_dense_tflops:.0f})"] = gspec.fp8_dense_tflops
        candidates[f"the 2:4-sparse FP8 peak ({2 * gspec.fp8_dense_tflops:.0f})"] = 2 * gspec.fp8_dense_tflops
    for name, v in candidates.items():
        if abs(implied / v - 1) < 0.03:
            return name
    return None


# ---------------------------------------------------------------------------------------------
# Published band
# ---------------------------------------------------------------------------------------------


def expected_band(plan: Plan, shape: ModelShape, fl: _Flops) -> ExpectedBand | None:
    """MFU of published runs on the same GPU architecture and precision class, similar size.

    Each run's MFU is recomputed in both conventions from its tokens/s where the row has them
    (tokens/s x this tool's FLOPs/token for the row's own plan); otherwise only its published MFU
    (in the source's convention) is given."""
    from mcore_advisor.knowledge.runs import plan_for_run, published_runs

    g = gpu(plan.cluster.gpu)
    fp8 = plan.training.precision == "fp8"
    our_n = (fl.per_token["causal"].total_flops - fl.per_token["causal"].core_attention_flops) / 6 / 1e9
    rows = []
    for r in published_runs():
        if r.gpu is None:
            continue
        try:
            rg = gpu(r.gpu)
        except KeyError:
            continue
        if rg.architecture != g.architecture or (r.precision == "fp8") != fp8:
            continue
        if "sft" in r.model.lower():
            continue  # fine-tuning packs short sequences: a different FLOP accounting
        rows.append((r, rg))
    if not rows:
        return ExpectedBand(mfu_causal_pct_range=None, mfu_full_pct_range=None, runs=[],
                            selection=f"no published {g.architecture} {'FP8' if fp8 else 'BF16/FP16'} pretraining runs in the knowledge base")
    # MoE and dense runs reach different MFU (all-to-all, small expert GEMMs): compare like with like.
    rows = [(r, rg) for r, rg in rows if row_is_moe(r) == shape.is_moe] or rows
    similar = [(r, rg) for r, rg in rows if r.params_b and 1 / 3 <= r.params_b / max(our_n, 1e-3) <= 3]
    if shape.is_moe:
        similar = rows
    if len(similar) < 3:
        similar = []  # too few to call a band: show every size
    chosen = similar or rows
    selection = (
        f"published {g.architecture} {'FP8' if fp8 else 'BF16/FP16'} pretraining runs"
        + (" of MoE models" if shape.is_moe else " of dense models")
        + (f" within 3x of this model's ~{our_n:.1f}B GEMM parameters" if similar and not shape.is_moe else "")
        + ("" if similar else " (none of similar size: all sizes shown)")
    )
    out: list[BandRun] = []
    for r, rg in chosen:
        mc = mf = None
        rp = plan_for_run(r)
        rfl = None
        if rp is not None:
            try:
                rfl = _Flops(rp.plan, resolve_model(rp.plan.model))
            except (KeyError, ValueError):
                rfl = None
        tok = r.measured_tokens_per_sec_per_gpu
        if tok is None and rfl is not None and r.measured_tflops_per_gpu and r.flop_convention in ("causal", "full"):
            # A TFLOP/s in a known convention is tokens/s x that convention's FLOPs/token.
            tok = r.measured_tflops_per_gpu * 1e12 / rfl.per_token[r.flop_convention].total_flops
        if tok and rfl is not None:
            mc = 100 * tok * rfl.per_token["causal"].total_flops / 1e12 / rg.bf16_dense_tflops
            mf = 100 * tok * rfl.per_token["full"].total_flops / 1e12 / rg.bf16_dense_tflops
        pub = r.measured_mfu_pct
        if pub is None and r.measured_tflops_per_gpu:
            pub = 100 * r.measured_tflops_per_gpu / rg.bf16_dense_tflops
        if mc is None and mf is None and pub is None:
            continue
        if r.flop_convention == "causal" and mc is None:
            mc = pub
        if r.flop_convention == "full" and mf is None:
            mf = pub
        out.append(BandRun(source=r.source, model=r.model, num_gpus=r.num_gpus, mfu_causal_pct=mc, mfu_full_pct=mf,
                           mfu_published_pct=pub, source_convention=r.flop_convention))
    cs = [b.mfu_causal_pct for b in out if b.mfu_causal_pct is not None]
    fs = [b.mfu_full_pct for b in out if b.mfu_full_pct is not None]
    return ExpectedBand(
        mfu_causal_pct_range=(min(cs), max(cs)) if cs else None,
        mfu_full_pct_range=(min(fs), max(fs)) if fs else None,
        runs=out[:12],
        selection=selection,
    )


def _band_verdict(band: ExpectedBand, mfu_causal: float | None, mfu_full: float | None) -> str | None:
    for name, mfu, rng in (("causal", mfu_causal, band.mfu_causal_pct_range), ("full", mfu_full, band.mfu_full_pct_range)):
        if mfu is None or rng is None:
            continue
        lo, hi = rng
        if mfu < lo:
            return f"{mfu:.1f}% ({name}) is below the published range {lo:.1f}-{hi:.1f}% for comparable runs: worth diagnosing"
        if mfu > hi * 1.05:
            return (f"{mfu:.1f}% ({name}) is above the published range {lo:.1f}-{hi:.1f}%: either the measurement is off (time per "
                    "global batch? GPU count?) or the run is simpler than the published ones (fewer GPUs, no pipeline or cross-node traffic)")
        return f"{mfu:.1f}% ({name}) is within the published range {lo:.1f}-{hi:.1f}% for comparable runs"
    return None


# ---------------------------------------------------------------------------------------------
# check_mfu
# ---------------------------------------------------------------------------------------------


def _finding(code: str, severity: str, fields: list[str], message: str, fix: str | None = None) -> Finding:
    return Finding(code=code, severity=severity, fields=fields, message=message, fix=fix)  # type: ignore[arg-type]


def _resolve_plan(req: MfuRequest, parsed: ParsedLog | None, notes: list[str], findings: list[Finding], *,
                  required: bool) -> tuple[Plan | None, str]:
    """The plan: the request's, else the log's arguments dump, else its config dump with the request's model /
    num_gpus / seq_length. `required`: raise (naming what is missing) instead of returning none."""
    if req.plan is not None:
        if parsed is not None and parsed.megatron_args:
            try:
                lp, _ = plan_from_megatron_args(parsed.megatron_args, gpu=req.plan.cluster.gpu, vocab_size=parsed.vocab_size)
            except ValueError:
                lp = None
            if lp is not None:
                diffs = []
                for sect in ("parallelism", "training"):
                    a, b = getattr(req.plan, sect), getattr(lp, sect)
                    for f in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                              "expert_model_parallel_size", "seq_length", "global_batch_size", "micro_batch_size"):
                        if hasattr(a, f) and getattr(a, f) != getattr(b, f):
                            diffs.append(f"{sect}.{f}: plan {getattr(a, f)} vs log {getattr(b, f)}")
                if req.plan.cluster.num_gpus != lp.cluster.num_gpus:
                    diffs.append(f"cluster.num_gpus: plan {req.plan.cluster.num_gpus} vs log {lp.cluster.num_gpus}")
                if diffs:
                    findings.append(_finding("plan_differs_from_log", "warning", [d.split(":")[0] for d in diffs],
                                             "the plan differs from the log's arguments dump: " + "; ".join(diffs),
                                             "omit `plan` to use the log's own layout, or fix the plan"))
        return req.plan, "request"
    if parsed is not None and parsed.megatron_args:
        try:
            p, n = plan_from_megatron_args(parsed.megatron_args, gpu=req.gpu, vocab_size=parsed.vocab_size)
        except ValueError as e:
            raise ValueError(f"plan: {e}") from None
        notes.extend(n)
        return p, "log_arguments"
    has_config = parsed is not None and bool(parsed.config_values or parsed.config_model_names)
    if not (has_config or req.model or req.num_gpus):
        if required and parsed is not None:
            raise ValueError(
                "log_text has iteration lines but neither Megatron's arguments dump nor a Megatron-Bridge/NeMo config dump: "
                "give model (a catalog name, e.g. 'llama3-8b') and num_gpus with it (or a full plan)")
        return None, "none"
    gbs = [r.global_batch_size for r in parsed.iterations if r.global_batch_size] if parsed is not None else []
    try:
        p, n = plan_from_config_dump(parsed.config_values if parsed else {}, parsed.config_model_names if parsed else [],
                                     gpu=req.gpu, num_gpus=req.num_gpus, model=req.model, seq_length=req.seq_length,
                                     world_size=parsed.world_size if parsed else None,
                                     global_batch_size=int(statistics.median(gbs)) if gbs else None)
    except ValueError as e:
        if required:
            raise ValueError(f"log_text: {e}") from None
        notes.append(f"no plan: {e}")
        return None, "none"
    notes.extend(n)
    return p, "log_config"


def _failure(parsed: ParsedLog | None, plan: Plan | None) -> FailureDiagnosis | None:
    """A failed run's diagnosis: an NCCL timeout first (its crash lines are its consequences), else a crash."""
    if parsed is None:
        return None
    if parsed.num_nccl_timeouts:
        return nccl_timeout(parsed, plan)
    return crash(parsed)


def _measurement(req: MfuRequest, parsed: ParsedLog | None, plan: Plan, fl: _Flops, findings: list[Finding]) -> tuple[float | None, str | None]:
    """Iteration time (s) and where it came from; cross-checks every other source against it."""
    tpi = fl.tokens_per_iteration
    cands: list[tuple[str, float]] = []
    if req.iteration_time_s:
        cands.append(("request.iteration_time_s", req.iteration_time_s))
    if req.tokens_per_s_per_gpu:
        cands.append(("request.tokens_per_s_per_gpu", tpi / (req.tokens_per_s_per_gpu * fl.world)))
    if req.tokens_per_s:
        cands.append(("request.tokens_per_s", tpi / req.tokens_per_s))
    if parsed is not None and parsed.iteration_time is not None:
        cands.append((f"log: median of {parsed.iteration_time.num_records} iteration records (first one, with start-up, left out)",
                      parsed.iteration_time.median_ms / 1000.0))
    if not cands:
        return None, None
    src, t = cands[0]
    for other, t2 in cands[1:]:
        if abs(t2 / t - 1) > 0.05:
            findings.append(_finding(
                "measurements_disagree", "warning", [],
                f"{other} implies {t2:.3f} s per iteration but {src} gives {t:.3f} s ({t2 / t - 1:+.0%}) for "
                f"global_batch_size {plan.training.global_batch_size} x seq_length {plan.training.seq_length} on "
                f"{fl.world} GPUs", "check the GPU count, the batch size, and that times are per global batch"))
    return t, src


def _log_gbs_scale(parsed: ParsedLog | None, plan: Plan, findings: list[Finding]) -> float:
    """The log's global batch vs the plan's (batch ramp-up or a different plan)."""
    if parsed is None:
        return 1.0
    gbs = [r.global_batch_size for r in parsed.iterations[-20:] if r.global_batch_size]
    if not gbs:
        return 1.0
    g = statistics.median(gbs)
    if g != plan.training.global_batch_size:
        findings.append(_finding("log_batch_differs", "warning", ["training.global_batch_size"],
                                 f"the log's global batch size is {g:g}, the plan's {plan.training.global_batch_size}; the log's numbers are scaled to its own batch",
                                 "set training.global_batch_size to the log's value"))
        return g / plan.training.global_batch_size
    return 1.0


def _log_findings(parsed: ParsedLog, findings: list[Finding]) -> None:
    if parsed.skipped_iterations_total:
        findings.append(_finding("skipped_iterations", "warning", ["training.precision"],
                                 f"{parsed.skipped_iterations_total} iterations were skipped (loss-scale overflow or NaN gradients) in the records read; they cost time and train nothing",
                                 "with fp16 lower the initial loss scale or use bf16; with bf16 look for a bad batch or learning rate"))
    if parsed.nan_iterations_total or parsed.nan_messages:
        findings.append(_finding("nan_loss", "error", [],
                                 "NaN/Inf losses: " + (parsed.nan_messages[0] if parsed.nan_messages else f"{parsed.nan_iterations_total} nan iterations"),
                                 "lower the learning rate or check the data and the checkpoint; Megatron's --check-for-nan-in-loss-and-grad names the rank"))
    if parsed.num_nccl_timeouts:
        t = parsed.nccl_timeouts[0] if parsed.nccl_timeouts else None
        what = f"{t.op_type} SeqNum {t.seq_num} on rank {t.rank} ran {t.ran_for_ms} ms past a {t.timeout_ms} ms timeout" if t else "a collective timed out"
        findings.append(_finding("nccl_timeout", "error", [],
                                 f"NCCL watchdog timeout ({parsed.num_nccl_timeouts} reports): {what}. The ranks that did NOT time out are the suspects: "
                                 "one rank stopped reaching the collective (a crash or OOM elsewhere, a data-loader hang, a very slow checkpoint write) or the network failed",
                                 "look for the first error on any other rank before the timeout; rerun with TORCH_NCCL_DESYNC_DEBUG=1 and NCCL_DEBUG=WARN"))
    for kind, line in parsed.error_lines.items():
        if kind in ("nccl_error", "cuda_error", "host_oom_kill"):
            fix = {"host_oom_kill": "the host ran out of CPU memory: fewer data-loader workers, or less pinned memory",
                   "nccl_error": "check NCCL_DEBUG=WARN output and the fabric (ibstat, nvidia-smi topo -m)",
                   "cuda_error": "rerun with CUDA_LAUNCH_BLOCKING=1 to find the failing kernel"}[kind]
            findings.append(_finding(kind, "error", [], f"{kind.replace('_', ' ')}: {line}", fix))


def check_mfu(request: MfuRequest) -> MfuReport:
    """MFU and HFU (both FLOP conventions), the log's own TFLOP/s convention, claim checks, the
    published band for comparable runs, and a diagnosis of low MFU or an OOM, with ranked fixes.

    Use it on a pasted training log (Megatron-LM, Megatron-Bridge, NeMo 2; its arguments dump can
    supply the plan), on a plan plus a measured iteration time or tokens/s, or to check a claim
    such as "390 TFLOP/s = 47% MFU on H100". Raises ValueError naming the field when neither a plan
    nor a log arguments dump is given and the log holds no OOM to diagnose.
    """
    notes: list[str] = []
    findings: list[Finding] = []
    parsed = parse_log(request.log_text) if request.log_text is not None else None
    if parsed is not None:
        notes.extend(f"log: {n}" for n in parsed.notes)
        _log_findings(parsed, findings)
    has_measure = any(v is not None for v in (request.iteration_time_s, request.tokens_per_s, request.tokens_per_s_per_gpu, request.reported_tflops_per_gpu))
    has_oom = parsed is not None and bool(parsed.num_oom_events or "out_of_memory" in parsed.error_lines)
    needs_plan = has_measure or (parsed is not None and parsed.has_training_data)
    plan, plan_source = _resolve_plan(request, parsed, notes, findings, required=needs_plan and not has_oom)
    failure = _failure(parsed, plan)
    if plan is None:
        if has_oom:
            return MfuReport(plan=None, plan_source="none", measurement_source=None, iteration_time_s=None, tokens_per_s_per_gpu=None, peak=None,
                             oom_diagnosis=oom(parsed, None), failure=failure, log=_trim(parsed), findings=findings,
                             notes=notes + ["no plan and no arguments dump: the OOM is read from the message alone; give model and "
                                            "num_gpus (or `plan`) to compare it with the memory model"])
        if failure is not None:
            return MfuReport(plan=None, plan_source="none", measurement_source=None, iteration_time_s=None, tokens_per_s_per_gpu=None,
                             peak=None, failure=failure, log=_trim(parsed), findings=findings,
                             notes=notes + ["diagnosed from the log alone; give model and num_gpus (or `plan`) to match the "
                                            "failing collective against the run's tensors and groups"])
        if parsed is not None and not parsed.has_training_data:
            raise ValueError("log_text: " + ("; ".join(parsed.notes) or "no training lines, failure or config found")
                             + "; paste the training stdout, or give model and num_gpus (or a full plan) with iteration_time_s")
        raise ValueError("plan is required: give `plan` (model, cluster, training, parallelism), or model and num_gpus, or a "
                         "log_text that contains Megatron's '------------------------ arguments ------------------------' dump")
    if parsed is not None and not has_measure and not parsed.has_training_data and not parsed.num_oom_events:
        if failure is not None or has_oom:
            return MfuReport(plan=plan, plan_source=plan_source, measurement_source=None, iteration_time_s=None,  # type: ignore[arg-type]
                             tokens_per_s_per_gpu=None, peak=None, failure=failure,
                             oom_diagnosis=oom(parsed, plan) if has_oom and request.diagnose else None,
                             log=_trim(parsed), findings=findings, notes=notes)
        raise ValueError("log_text: " + ("; ".join(parsed.notes) or "no iteration lines found")
                         + "; or give iteration_time_s / tokens_per_s_per_gpu / reported_tflops_per_gpu")

    shape = resolve_model(plan.model)
    gspec = gpu(plan.cluster.gpu)
    peak = peak_for(gspec, request.peak_tflops_per_gpu)
    fl = _Flops(plan, shape)
    gbs_scale = _log_gbs_scale(parsed, plan, findings)
    t, src = _measurement(request, parsed, plan, fl, findings)
    if src is not None and src.startswith("log") and gbs_scale != 1.0:
        t = t / gbs_scale  # per the plan's batch

    measured_t = t  # a time that was measured, not derived from a reported TFLOP/s
    log_conv = None
    checks: list[ClaimCheck] = []
    # The log's own TFLOP/s against its own time (both medians over the steady records).
    if parsed is not None:
        rt, tt = parsed.median_reported_tflops(), parsed.median_iteration_time_s()
        if rt is not None and tt is not None:
            log_conv = infer_convention(rt, fl, tt, gbs_scale)
    if request.reported_tflops_per_gpu is not None:
        if t is not None:
            inf = infer_convention(request.reported_tflops_per_gpu, fl, t)
            if log_conv is None:
                log_conv = inf
            checks.append(ClaimCheck(claim=f"{request.reported_tflops_per_gpu:g} TFLOP/s/GPU reported",
                                     consistent=inf.convention != "none", message=inf.message))
        else:
            conv = request.reported_tflops_convention
            if conv is None:
                notes.append("reported_tflops_per_gpu without a time or tokens/s: its convention cannot be inferred; "
                             "assumed 'causal' (Megatron >= 2025-03). Give reported_tflops_convention or a time to check it")
                conv = "causal"
            t = fl.model[conv] / (request.reported_tflops_per_gpu * 1e12 * fl.world)
            src = f"request.reported_tflops_per_gpu (taken as '{conv}')"

    out: dict = dict(
        flops_per_token_causal=fl.per_token["causal"].total_flops,
        flops_per_token_full=fl.per_token["full"].total_flops,
        model_flops_per_iteration_causal=fl.model["causal"],
        model_flops_per_iteration_full=fl.model["full"],
        hardware_flops_per_iteration_causal=fl.hardware["causal"],
        hardware_flops_per_iteration_full=fl.hardware["full"],
    )
    tok_gpu = None
    if t is not None:
        tok_gpu = fl.tokens_per_iteration / t / fl.world
        for c in ("causal", "full"):
            mt = fl.tflops_per_gpu("model", c, t)  # type: ignore[arg-type]
            ht = fl.tflops_per_gpu("hardware", c, t)  # type: ignore[arg-type]
            out[f"model_tflops_per_gpu_{c}"] = mt
            out[f"mfu_{c}_pct"] = 100 * mt / peak.tflops_per_gpu
            out[f"hfu_{c}_pct"] = 100 * ht / peak.tflops_per_gpu
        if plan.training.precision == "fp8" and gspec.fp8_dense_tflops and request.peak_tflops_per_gpu is None:
            out["mfu_vs_fp8_peak_causal_pct"] = 100 * out["model_tflops_per_gpu_causal"] / gspec.fp8_dense_tflops
        if out["mfu_causal_pct"] > 100 or out["hfu_causal_pct"] > 100:
            findings.append(_finding("mfu_above_peak", "error", ["cluster.num_gpus", "training.global_batch_size"],
                                     f"the measurement implies {out['mfu_causal_pct']:.0f}% MFU: above the hardware peak, so the time, the batch or the GPU count is wrong",
                                     "give the time of one global batch (not one micro-batch) and the total GPU count"))

    checks.extend(_claim_checks(request, plan, shape, gspec, peak, fl, measured_t, out))

    band = expected_band(plan, shape, fl)
    if band is not None and t is not None:
        band = band.model_copy(update={"verdict": _band_verdict(band, out.get("mfu_causal_pct"), out.get("mfu_full_pct"))})

    diagnosis = None
    oom_diag = None
    if request.diagnose:
        if parsed is not None and (parsed.num_oom_events or "out_of_memory" in parsed.error_lines):
            oom_diag = oom(parsed, plan)
        if t is not None and oom_diag is None:
            diagnosis = low_mfu(plan, t, parsed)

    return MfuReport(
        plan=plan,
        plan_source=plan_source,  # type: ignore[arg-type]
        measurement_source=src,
        iteration_time_s=t,
        tokens_per_s_per_gpu=tok_gpu,
        peak=peak,
        log_convention=log_conv,
        claim_checks=checks,
        expected_band=band,
        diagnosis=diagnosis,
        oom_diagnosis=oom_diag,
        failure=failure,
        log=_trim(parsed) if parsed else None,
        findings=findings,
        notes=notes,
        **out,
    )


def _trim(parsed: ParsedLog) -> ParsedLog:
    return parsed.model_copy(update={"iterations": parsed.iterations[-20:]})


def _claim_checks(req: MfuRequest, plan: Plan, shape: ModelShape, gspec: GpuSpec, peak: PeakUsed, fl: _Flops, t: float | None, out: dict) -> list[ClaimCheck]:
    checks: list[ClaimCheck] = []
    if req.tokens_per_s and req.tokens_per_s_per_gpu:
        implied = req.tokens_per_s / fl.world
        ok = abs(implied / req.tokens_per_s_per_gpu - 1) < 0.02
        checks.append(ClaimCheck(claim=f"{req.tokens_per_s:g} tokens/s and {req.tokens_per_s_per_gpu:g} tokens/s/GPU",
                                 consistent=ok, message=f"{req.tokens_per_s:g} / {fl.world} GPUs = {implied:.1f} tokens/s/GPU" + ("" if ok else f", not {req.tokens_per_s_per_gpu:g}")))
    m = req.claimed_mfu_pct
    if m is None:
        return checks
    if req.reported_tflops_per_gpu is not None:
        actual = 100 * req.reported_tflops_per_gpu / peak.tflops_per_gpu
        ok = abs(actual - m) <= CLAIM_TOLERANCE_PCT_POINTS
        implied_peak = req.reported_tflops_per_gpu / (m / 100)
        msg = f"{req.reported_tflops_per_gpu:g} TFLOP/s/GPU / {peak.tflops_per_gpu:g} ({peak.name}) = {actual:.1f}% MFU"
        if not ok:
            other = _matching_peak(gspec, implied_peak)
            msg += (f", not {m:g}%: {m:g}% would need a {implied_peak:.1f} TFLOP/s peak"
                    + (f", which is {other}: the claim used the wrong denominator" if other else ", which is no peak of this GPU"))
        checks.append(ClaimCheck(claim=f"{req.reported_tflops_per_gpu:g} TFLOP/s/GPU = {m:g}% MFU on {plan.cluster.gpu}", consistent=ok, message=msg))
    if t is not None and ("mfu_causal_pct" in out):
        mc, mf = out["mfu_causal_pct"], out["mfu_full_pct"]
        tok_gpu = fl.tokens_per_iteration / t / fl.world
        six_nd, n_desc = _six_nd_flops_per_token(fl, shape)
        m6 = 100 * tok_gpu * six_nd / 1e12 / peak.tflops_per_gpu
        close = [(name, v) for name, v in (("causal", mc), ("full", mf), ("6ND", m6)) if abs(v - m) <= CLAIM_TOLERANCE_PCT_POINTS]
        base = (f"{tok_gpu:.1f} tokens/s/GPU x {fl.per_token['causal'].total_flops / 1e9:.2f} GFLOP/token (causal) = {mc:.1f}% MFU; "
                f"full-attention count {mf:.1f}%; 6ND ({n_desc}) {m6:.1f}%")
        if close:
            name = close[0][0]
            msg = base + f". The claimed {m:g}% matches the {name} count" + (
                " (6ND ignores attention and, for MoE, may count parameters a token never uses)" if name == "6ND" else "")
        else:
            msg = base + f". The claimed {m:g}% matches none of them"
            if m > 100:
                msg += ": above 100% is impossible"
        checks.append(ClaimCheck(claim=f"{m:g}% MFU at {tok_gpu:.1f} tokens/s/GPU",
                                 consistent=any(name in ("causal", "full") for name, _ in close), message=msg))
    return checks


__all__ = [
    "MfuRequest", "MfuReport", "check_mfu", "infer_convention", "expected_band",
    "PeakUsed", "ConventionInference", "ClaimCheck", "ExpectedBand", "LowMfuDiagnosis", "OomDiagnosis", "FixSuggestion",
    "GapComponent", "FailureDiagnosis",
]
