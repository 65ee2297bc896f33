"""estimate_memory(plan): the memory breakdown, whether it fits, and what to change when it does not."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.schemas import Finding, Plan, parallel_dims, with_changes
from mcore_advisor.tools.memory import MemoryBreakdown, memory_breakdown
from mcore_advisor.validators import validate

# Below this fraction of capacity left, suggest changes even though the plan fits: allocator
# behaviour and dataset-dependent peaks (MoE routing imbalance, variable sequence lengths) move
# the real peak by a few percent.
LOW_HEADROOM_FRACTION = 0.05


class MemoryChange(BaseModel):
    """One concrete change to the plan and what it does to the most-loaded GPU's memory."""

    model_config = ConfigDict(frozen=True)

    field: str = Field(description="Dotted plan field, e.g. 'parallelism.recompute_granularity'.")
    current: Any = Field(description="The plan's value.")
    proposed: Any = Field(description="The value to set.")
    saves_gib: float = Field(description="Reduction of total per-GPU memory (reserved + non-PyTorch), GiB.")
    total_gib_after: float
    fits_after: bool
    note: str = Field(description="What it costs or requires.")

    @property
    def summary(self) -> str:
        return f"{self.field} {self.current} -> {self.proposed}: -{self.saves_gib:.1f} GiB"


class MemoryReport(BaseModel):
    """What estimate_memory returns: breakdown, verdict, imbalance across ranks, ranked fixes."""

    model_config = ConfigDict(frozen=True)

    breakdown: MemoryBreakdown
    fits: bool
    headroom_gib: float
    most_loaded_pipeline_rank: int
    most_loaded_role: str
    imbalance_gib: float = Field(description="Peak allocated of the most-loaded minus the least-loaded pipeline rank, GiB.")
    findings: list[Finding] = Field(description="Validation findings (errors make the plan unrunnable) plus memory verdicts.")
    suggestions: list[MemoryChange] = Field(description="Ranked by memory saved; given when the plan does not fit or headroom < 5%.")


def _candidates(plan: Plan) -> list[tuple[str, Any, Any, Plan, str]]:
    """(field, current, proposed, new plan, note) for every change that could lower memory."""
    shape = resolve_model(plan.model)
    d = parallel_dims(plan)
    p, t, im, cl = plan.parallelism, plan.training, plan.implementation, plan.cluster
    out: list[tuple[str, Any, Any, Plan, str]] = []
    P = "parallelism"

    def add(section: str, name: str, new: Any, note: str, **extra: Any) -> None:
        cur = getattr(getattr(plan, section), name)
        out.append((f"{section}.{name}", cur, new, with_changes(plan, section, **{name: new}, **extra), note))

    if not im.expandable_segments:
        add("implementation", "expandable_segments", True,
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; no throughput cost")
    if not p.use_distributed_optimizer and d.dp * d.cp > 1:
        add(P, "use_distributed_optimizer", True, "shards fp32 main params and Adam state over DP*CP; ~1-2% slower")
    if im.attention_backend in ("unfused", "local"):
        add("implementation", "attention_backend", "auto",
            "flash/fused attention never stores the s x s scores; also faster")
    if im.cross_entropy_loss_fusion and im.cross_entropy_fusion_impl == "native":
        if im.transformer_impl == "transformer_engine":
            add("implementation", "cross_entropy_fusion_impl", "te",
                "Transformer Engine's cross entropy writes the gradient into the bf16 logits: 2 B/logit instead of 10")
        add("implementation", "cross_entropy_loss_fusion", False,
            "unfused vocab-parallel cross entropy works in place: 6 B/logit instead of 10; a few more kernels")
    if (p.recompute_granularity == "selective" and im.transformer_impl == "transformer_engine"
            and im.attention_backend not in ("unfused", "local")
            and set(p.recompute_modules or ["core_attn"]) == {"core_attn"}):
        # Flash attention stores no s x s scores, and checkpointing it keeps the whole QKV output
        # alive (tools.memory): with TE, selective core_attn recompute costs memory.
        add(P, "recompute_granularity", None,
            "with TE flash attention, recomputing core attention saves nothing and keeps the QKV GEMM output; also faster",
            recompute_modules=None)
    if p.recompute_granularity is None:
        add(P, "recompute_granularity", "selective", "recomputes core attention (Megatron default module): ~2-3% more FLOPs",
            recompute_modules=None)
    if p.recompute_granularity != "full":
        add(P, "recompute_granularity", "full", "reruns every layer's forward: ~25-33% more compute",
            recompute_method="uniform", recompute_num_layers=1, recompute_modules=None)
    if t.micro_batch_size > 1:
        add("training", "micro_batch_size", t.micro_batch_size // 2, "smaller GEMMs, more microbatches")
    if d.tp > 1 and not p.sequence_parallel:
        add(P, "sequence_parallel", True, "shards norm/dropout activations over TP at no extra communication")
    tp2 = d.tp * 2
    gpn = cl.gpus_per_node or 8
    # Megatron needs heads and query groups divisible by TP; keep TP inside the NVLink domain.
    if (shape.num_attention_heads % tp2 == 0 and shape.num_query_groups % tp2 == 0 and tp2 <= gpn
            and cl.num_gpus % (tp2 * d.pp * d.cp) == 0):
        add(P, "tensor_model_parallel_size", tp2, f"halves DP to {d.dp // 2}; more TP communication inside the node",
            sequence_parallel=True)
    pp2 = d.pp * 2
    if shape.num_layers % pp2 == 0 and cl.num_gpus % (d.tp * pp2 * d.cp) == 0 and d.dp >= 2:
        vp = p.virtual_pipeline_model_parallel_size
        extra = {}
        if vp and shape.num_layers % (pp2 * vp) != 0:
            extra["virtual_pipeline_model_parallel_size"] = None
        add(P, "pipeline_model_parallel_size", pp2, f"halves DP to {d.dp // 2}; larger pipeline bubble", **extra)
    cp2 = d.cp * 2
    if t.seq_length >= 8192 and t.seq_length % (2 * cp2) == 0 and cl.num_gpus % (d.tp * d.pp * cp2) == 0 and d.dp >= 2:
        add(P, "context_parallel_size", cp2, "splits the sequence; ring attention communication")
    if shape.is_moe and shape.num_experts and shape.num_experts % (d.ep * 2) == 0 and (d.world // (d.etp * d.pp)) % (d.ep * 2) == 0:
        add(P, "expert_model_parallel_size", d.ep * 2, "fewer experts per GPU; more all-to-all traffic")
    if im.grad_reduce_in_fp32:
        add("implementation", "grad_reduce_in_fp32", False, "bf16 gradient buffer and reduction: 2 B/param less, slightly less accurate")
    return out


def estimate_memory(plan: Plan) -> MemoryReport:
    """Per-GPU memory of a plan: the breakdown on the most-loaded rank, whether it fits, and fixes.

    Use before launching (or inside a search) to see if a layout fits and why not. "Does not fit"
    is a normal result (fits=False with an error finding and ranked suggestions, each a single
    plan field change with the GiB it saves). Peak allocated follows
    torch.cuda.max_memory_allocated(); total adds the allocator's fragmentation margin and the
    CUDA context + NCCL buffers, and is what must stay below the GPU's capacity.
    """
    bd = memory_breakdown(plan)
    findings = list(validate(plan))
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
    suggestions: list[MemoryChange] = []
    if not bd.fits or low:
        for field, cur, new, cand, note in _candidates(plan):
            try:
                nb = memory_breakdown(cand)
            except (KeyError, ValueError):
                continue
            saves = bd.total_gib - nb.total_gib
            if saves <= 0.05:
                continue
            suggestions.append(MemoryChange(field=field, current=cur, proposed=new, saves_gib=round(saves, 2),
                                            total_gib_after=round(nb.total_gib, 2), fits_after=nb.fits, note=note))
        suggestions.sort(key=lambda c: -c.saves_gib)
    return MemoryReport(
        breakdown=bd, fits=bd.fits, headroom_gib=bd.headroom_gib,
        most_loaded_pipeline_rank=bd.most_loaded_pipeline_rank, most_loaded_role=bd.most_loaded_role,
        imbalance_gib=imbalance, findings=findings, suggestions=suggestions,
    )
