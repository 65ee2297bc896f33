"""evaluate_plan(plan): validation findings + resolved model + parallel layout + memory + step time.

One call answers "is this plan runnable, does it fit, how fast is it, and where does the time go".
Pure and fast (about a millisecond for a 405B plan: benchmarks/evaluate_speed.py measures it).
For searching thousands of layouts use the array paths instead: validators.layout_errors,
physics.step_time.step_time_arrays.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from mcore_advisor.knowledge.hardware import gpu
from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics.memory import MemoryBreakdown, memory_breakdown
from mcore_advisor.physics.moe import CUBLASLT_CACHE_FIX, LOAD_SPREAD_FIX, untrained_spread_statement
from mcore_advisor.physics.step_time import PerfEstimate, step_time
from mcore_advisor.schemas import Finding, ModelShape, Plan, pads_to_capacity, parallel_dims
from mcore_advisor.validators import validate


class ParallelSummary(BaseModel):
    """The layout Megatron will build: derived degrees and micro-batching."""

    model_config = ConfigDict(frozen=True)

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int = Field(description="Model chunks per stage; 1 = not interleaved.")
    context_parallel_size: int
    expert_model_parallel_size: int
    expert_tensor_parallel_size: int
    data_parallel_size: int = Field(description="num_gpus / (TP * PP * CP).")
    expert_data_parallel_size: int = Field(description="num_gpus / (ETP * EP * PP): replicas of each expert.")
    num_microbatches: int = Field(description="global_batch_size / (micro_batch_size * data_parallel_size).")
    num_gpus: int
    gpus_per_node: int
    num_nodes: int


class Evaluation(BaseModel):
    """What evaluate_plan returns. `valid` = no validator error (Megatron would start it); `feasible` =
    valid and it fits in memory."""

    model_config = ConfigDict(frozen=True)

    valid: bool = Field(description="False when a validator rejects the plan (Megatron would refuse it): the blocking findings come first, and there is no performance figure.")
    feasible: bool
    findings: list[Finding] = Field(description="Validation findings, blocking errors first: errors block the plan, warnings and info explain it.")
    model: ModelShape = Field(description="The resolved model shape (catalog + overrides + Megatron defaults).")
    parallel: ParallelSummary
    memory: MemoryBreakdown | None = Field(description="Per-GPU memory on the most-loaded rank; None if the layout is too broken to estimate.")
    performance: PerfEstimate | None = Field(description="Predicted step time and throughput; None for a plan the validators reject (see performance_unavailable).")
    performance_unavailable: str | None = Field(None, description="Why there is no performance figure (a plan Megatron would refuse has no throughput).")
    explanation: list[str] = Field(description="Short human summary: verdict, dominant costs, what limits the plan.")


def evaluate_plan(plan: Plan) -> Evaluation:
    """Check a training plan and predict its memory and speed.

    Returns validation findings, the resolved model shape, the derived layout (DP, micro-batches),
    the per-GPU memory breakdown, the predicted step time with its breakdown (tokens/s/GPU,
    TFLOP/s and MFU in both FLOP conventions) and a short explanation of the dominant costs.
    A plan that does not fit or breaks a Megatron rule is a normal result with feasible=False.
    Raises KeyError/ValueError (naming the field) only for input that cannot be resolved, such
    as an unknown model or GPU.
    """
    shape = resolve_model(plan.model)
    g = gpu(plan.cluster.gpu)
    findings = blocking_first(validate(plan))
    has_error = any(f.severity == "error" for f in findings)
    dims = parallel_dims(plan)
    tr = plan.training
    gpn = plan.cluster.gpus_per_node or g.gpus_per_node
    parallel = ParallelSummary(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vp,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.etp,
        data_parallel_size=dims.dp,
        expert_data_parallel_size=max(1, dims.expert_dp),
        num_microbatches=max(1, tr.global_batch_size // (tr.micro_batch_size * dims.dp)),
        num_gpus=dims.world,
        gpus_per_node=gpn,
        num_nodes=-(-dims.world // gpn),
    )
    notes: list[str] = []
    memory = _guarded(memory_breakdown, plan, has_error, notes, "memory")
    perf, why_none = None, None
    if has_error:
        first = next(f for f in findings if f.severity == "error")
        why_none = (f"no throughput for a plan Megatron would refuse: {first.message}"
                    + (f" (fix: {first.fix})" if first.fix else ""))
    else:
        perf = step_time(plan, shape)
        findings = blocking_first(findings + host_bound_findings(perf, plan) + dataloader_mask_findings(perf)
                                  + expert_cache_findings(perf) + load_spread_findings(plan, shape))
    feasible = not has_error and memory is not None and memory.fits
    return Evaluation(
        valid=not has_error,
        feasible=feasible,
        findings=findings,
        model=shape,
        parallel=parallel,
        memory=memory,
        performance=perf,
        performance_unavailable=why_none,
        explanation=_explain(findings, memory, perf) + notes,
    )


def blocking_first(findings: list[Finding]) -> list[Finding]:
    """Errors (what makes Megatron refuse the plan) first, then warnings, then info; stable within each."""
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(findings, key=lambda f: order[f.severity])


def host_bound_findings(perf: PerfEstimate, plan: Plan) -> list[Finding]:
    """A finding when the prediction is host-bound (PerfEstimate.host_bound): the GPU waits on the host."""
    if not perf.host_bound:
        return []
    b, it = perf.breakdown, perf.iteration_time_s
    tr, im = plan.training, plan.implementation
    checks = " or --no-check-for-nan-in-loss-and-grad (fewer host syncs)" if im.check_for_nan_in_loss_and_grad else ""
    return [Finding(
        code="host_bound", severity="warning",
        fields=["training.micro_batch_size", "cluster.host_floor_ms_per_layer", "implementation.check_for_nan_in_loss_and_grad"],
        message=(f"host-bound: the GPU is predicted to wait {b.host_bound_s:.3f} s ({100 * b.host_bound_s / it:.0f}%) of the "
                 f"{it:.3f} s step for the host (kernel launches of layers with little GPU work at micro-batch "
                 f"{tr.micro_batch_size}, host syncs, the step's own host work); such steps follow the host's speed and "
                 "load (one host-bound MoE plan ran 1.34-1.66 s in three jobs on one H100 VM: "
                 "benchmarks/results/gpu_h100_X_summary.md)"),
        fix=(f"a larger micro-batch (more GPU work per launch){checks}; a faster host (bare metal) shrinks it; "
             "to predict for your machine, run one profile job there (run_profile_job) and pass the "
             "host_floor_ms_per_layer get_job reports as cluster.host_floor_ms_per_layer"),
    )]


def load_spread_findings(plan: Plan, shape: ModelShape) -> list[Finding]:
    """A finding when an as-routed MoE plan without a shared expert is predicted on the assumed untrained spread: such
    routers measured 4-13x that spread, and the step ran 14-30% over the prediction (physics.moe.UNTRAINED_LOAD_CV_RANGE)."""
    im = plan.implementation
    if (not shape.is_moe or shape.moe_shared_expert_intermediate_size or im.moe_router_force_load_balancing
            or im.moe_expert_load_cv is not None
            or pads_to_capacity(im.moe_expert_capacity_factor, im.moe_pad_expert_input_to_capacity)):
        return []
    return [Finding(
        code="moe_untrained_load_spread", severity="warning",
        fields=["implementation.moe_expert_load_cv", "implementation.moe_router_force_load_balancing"],
        message=f"the step is likely under-predicted: {untrained_spread_statement(False)} (benchmarks/results/gpu_h100_O_summary.md)",
        fix=LOAD_SPREAD_FIX,
    )]


#: a step share of the data loader's masks worth a warning
DATALOADER_MASK_FLAG = 0.02


def dataloader_mask_findings(perf: PerfEstimate) -> list[Finding]:
    """A finding when Megatron-LM's default data-loader masks cost the step (breakdown.dataloader_mask_s)."""
    b, it = perf.breakdown, perf.iteration_time_s
    if b.dataloader_mask_s < DATALOADER_MASK_FLAG * it:
        return []
    return [Finding(
        code="dataloader_attention_mask", severity="warning", fields=["implementation.create_attention_mask_in_dataloader"],
        message=(f"the data loader builds a seq x seq attention mask per sample (Megatron-LM's default), pins it and copies "
                 f"it to the GPU every micro-batch: predicted {b.dataloader_mask_s:.3f} s ({100 * b.dataloader_mask_s / it:.0f}%) "
                 f"of the {it:.3f} s step; causal attention never reads it"),
        fix="implementation.create_attention_mask_in_dataloader false (--no-create-attention-mask-in-dataloader)",
    )]


#: a share of expert GEMMs missing cuBLASLt's heuristics cache worth a warning
EXPERT_CACHE_MISS_FLAG = 0.1


def expert_cache_findings(perf: PerfEstimate) -> list[Finding]:
    """A finding when the routed experts' token counts thrash cuBLASLt's heuristics cache (perf's
    moe_expert_gemm_miss_share): each miss is a heuristic query on the host before the expert's GEMM."""
    share = perf.moe_expert_gemm_miss_share
    if share is None or share < EXPERT_CACHE_MISS_FLAG:
        return []
    return [Finding(
        code="expert_gemm_cache_thrash", severity="warning", fields=["implementation.cublaslt_heuristics_cache_capacity"],
        message=(f"{100 * share:.0f}% of the routed experts' GEMMs are predicted to miss cuBLASLt's heuristics cache: "
                 "each expert's token count is a GEMM shape, uneven routing makes thousands of them, and each miss is a "
                 "host heuristic query before that expert's GEMM (64 experts top-8 on 4 x H200: 0.735 s per step, "
                 "0.656 s with a larger cache)"),
        fix=f"implementation.cublaslt_heuristics_cache_capacity {CUBLASLT_CACHE_FIX} (environment variable "
            "CUBLASLT_HEURISTICS_CACHE_CAPACITY)",
    )]


def _guarded(fn, plan: Plan, has_error: bool, notes: list[str], what: str):
    """Estimates of a plan the validators reject may hit impossible arithmetic: report, don't raise."""
    try:
        return fn(plan)
    except (ArithmeticError, ValueError) as e:
        if not has_error:
            raise
        notes.append(f"{what} not estimated: the layout errors above make it undefined ({type(e).__name__})")
        return None


_TERM_NAMES = {
    "gemm_s": "GEMMs",
    "attention_s": "core attention",
    "ssm_scan_s": "Mamba-2 convolution and SSD scan",
    "elementwise_s": "memory-bound elementwise ops",
    "recompute_s": "activation recompute",
    "tp_comm_exposed_s": "exposed TP/SP communication",
    "cp_comm_exposed_s": "exposed CP ring exchange",
    "ep_comm_s": "MoE all-to-all",
    "pp_p2p_s": "pipeline send/receive",
    "pipeline_bubble_s": "pipeline bubble",
    "dp_comm_exposed_s": "exposed data-parallel gradient/parameter communication",
    "optimizer_s": "optimizer step",
    "host_bound_s": "GPU waiting for the host (kernel launches, host syncs, per-step host work)",
    "dataloader_mask_s": "the data loader's seq x seq attention masks (--no-create-attention-mask-in-dataloader removes them)",
    "overhead_s": "fixed overhead",
}


def _explain(findings: list[Finding], memory: MemoryBreakdown | None, perf: PerfEstimate | None) -> list[str]:
    out: list[str] = []
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        out.append(f"not runnable: {len(errors)} error finding(s), first: {errors[0].message}")
    if memory is not None:
        if memory.fits:
            out.append(f"fits: {memory.total_gib:.1f} of {memory.capacity_gib:.1f} GiB on the most-loaded GPU ({memory.most_loaded_role} stage), {memory.headroom_gib:.1f} GiB headroom")
        else:
            out.append(f"does not fit: {memory.total_gib:.1f} GiB needed vs {memory.capacity_gib:.1f} GiB on the most-loaded GPU ({memory.most_loaded_role} stage), {-memory.headroom_gib:.1f} GiB over")
    if perf is None:
        return out
    it = perf.iteration_time_s
    out.append(
        f"step {it:.3f} s, {perf.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {perf.model_tflops_per_gpu_causal:.0f} TFLOP/s/GPU causal "
        f"({perf.model_tflops_per_gpu_full:.0f} full), MFU {perf.mfu_bf16_causal_pct:.1f}% of dense BF16 peak"
        + (f" ({perf.mfu_fp8_causal_pct:.1f}% of dense FP8 peak)" if perf.mfu_fp8_causal_pct is not None else "")
    )
    terms = sorted(((v, k) for k, v in perf.breakdown.model_dump().items() if v > 0), reverse=True)
    top = [f"{_TERM_NAMES[k]} {100 * v / it:.0f}%" for v, k in terms[:3]]
    out.append("dominant costs: " + ", ".join(top))
    b = perf.breakdown
    comm = b.tp_comm_exposed_s + b.cp_comm_exposed_s + b.ep_comm_s + b.pp_p2p_s + b.dp_comm_exposed_s
    if comm / it > 0.15:
        out.append(f"communication not hidden costs {100 * comm / it:.0f}% of the step")
    if perf.pipeline_bubble_fraction > 0.05:
        out.append(f"pipeline bubble {100 * perf.pipeline_bubble_fraction:.0f}% of the step: more micro-batches or virtual pipeline stages shrink it")
    if b.recompute_s / it > 0.1:
        out.append(f"recompute adds {100 * b.recompute_s / it:.0f}%: use it only as far as memory requires")
    return out


__all__ = ["Evaluation", "ParallelSummary", "blocking_first", "dataloader_mask_findings", "evaluate_plan",
           "expert_cache_findings",
           "host_bound_findings"]
