"""estimate_memory(plan): the memory breakdown, whether it fits, and what to change when it does not."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from mcore_advisor.physics.evaluate import blocking_first
from mcore_advisor.physics.memory import MemoryBreakdown, memory_breakdown
from mcore_advisor.planning.plan_changes import LOW_HEADROOM_FRACTION, MemoryChange, memory_fixes
from mcore_advisor.schemas import Finding, Plan
from mcore_advisor.validators import validate

__all__ = ["LOW_HEADROOM_FRACTION", "MemoryChange", "MemoryReport", "estimate_memory"]


class MemoryReport(BaseModel):
    """What estimate_memory returns: breakdown, verdict, imbalance across ranks, ranked fixes."""

    model_config = ConfigDict(frozen=True)

    valid: bool = Field(description="False when a validator rejects the plan (Megatron would refuse it); its blocking findings come first. The breakdown is then what the layout would need, not a runnable plan's.")
    breakdown: MemoryBreakdown
    fits: bool
    headroom_gib: float
    most_loaded_pipeline_rank: int
    most_loaded_role: str
    imbalance_gib: float = Field(description="Peak allocated of the most-loaded minus the least-loaded pipeline rank, GiB.")
    findings: list[Finding] = Field(description="Validation findings plus memory verdicts, blocking errors first (errors make the plan unrunnable).")
    suggestions: list[MemoryChange] = Field(description="Ranked by memory saved; given when the plan does not fit or headroom < 5%.")


def estimate_memory(plan: Plan) -> MemoryReport:
    """Per-GPU memory of a plan: the breakdown on the most-loaded rank, whether it fits, and fixes.

    Use before launching (or inside a search) to see if a layout fits and why not. "Does not fit"
    is a normal result (fits=False with an error finding and ranked suggestions, each a single
    plan field change with the GiB it saves). Peak allocated follows
    torch.cuda.max_memory_allocated(); total adds the allocator's fragmentation margin and the
    CUDA context + NCCL buffers, and is what must stay below the GPU's capacity.
    """
    bd = memory_breakdown(plan)
    findings = validate(plan)
    valid = not any(f.severity == "error" for f in findings)
    imbalance = max(s.peak_allocated_bytes for s in bd.stages) / 2**30 - bd.least_loaded_peak_gib
    low = bd.headroom_gib < LOW_HEADROOM_FRACTION * bd.capacity_gib
    if not bd.fits:
        findings.append(Finding(
            code="does_not_fit", severity="error",
            fields=["cluster.gpu", "parallelism.tensor_model_parallel_size", "training.micro_batch_size"],
            message=(f"needs {bd.total_gib:.1f} GiB per GPU on pipeline rank {bd.most_loaded_pipeline_rank} "
                     f"({bd.most_loaded_role}) but the GPU has {bd.capacity_gib:.1f} GiB: over by {-bd.headroom_gib:.1f} GiB"),
            fix="apply one of the suggestions (largest saving first)",
        ))
    elif low:
        findings.append(Finding(
            code="low_memory_headroom", severity="warning", fields=["cluster.gpu"],
            message=(f"only {bd.headroom_gib:.1f} GiB ({100 * bd.headroom_gib / bd.capacity_gib:.1f}%) left on pipeline rank "
                     f"{bd.most_loaded_pipeline_rank}; allocator fragmentation or routing imbalance can push it over"),
            fix="set implementation.expandable_segments or apply a suggestion",
        ))
    suggestions = memory_fixes(plan, bd) if not bd.fits or low else []
    return MemoryReport(
        valid=valid, breakdown=bd, fits=bd.fits, headroom_gib=bd.headroom_gib,
        most_loaded_pipeline_rank=bd.most_loaded_pipeline_rank, most_loaded_role=bd.most_loaded_role,
        imbalance_gib=imbalance, findings=blocking_first(findings), suggestions=suggestions,
    )
