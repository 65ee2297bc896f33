"""Plan changes: the candidate single-field edits that estimate_memory and the diagnoses evaluate.

Two generators live here side by side (estimate_memory's memory fixes, the diagnoses' speed and
memory what-ifs); unifying them is issue 13's next stage. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mcore_advisor.knowledge.hardware import gpu
from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics.memory import MemoryBreakdown, memory_breakdown
from mcore_advisor.schemas import ModelShape, Plan, parallel_dims, with_changes

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



def _memory_candidates(plan: Plan) -> list[tuple[str, Any, Any, Plan, str]]:
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
        # alive (physics.memory): with TE, selective core_attn recompute costs memory.
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


def memory_fixes(plan: Plan, bd: MemoryBreakdown) -> list[MemoryChange]:
    """Single plan changes that lower the most-loaded GPU's total memory, largest saving first."""
    suggestions: list[MemoryChange] = []
    for field, cur, new, cand, note in _memory_candidates(plan):
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
    return suggestions


# ---- what-ifs for the diagnoses (speed or memory) ---------------------------------------------

def _fmt(v) -> str:
    return "None" if v is None else str(v)


Candidate = tuple[str, list[str], Plan, str | None]


def _divisors_up(n: int, start: int, limit: int) -> list[int]:
    return [d for d in range(start + 1, limit + 1) if n % d == 0]


def candidate_changes(plan: Plan, shape: ModelShape, purpose: Literal["speed", "memory"]) -> Iterator[Candidate]:
    """Single plan changes worth evaluating; each as (description, fields, changed plan, caveat).

    Layout changes keep the GPU count (DP absorbs TP/PP/CP changes); validity is checked later."""
    return (c for c in _candidates(plan, shape, purpose) if c is not None)


def _candidates(plan: Plan, shape: ModelShape, purpose: Literal["speed", "memory"]) -> Iterator[Candidate | None]:
    p, t, im = plan.parallelism, plan.training, plan.implementation
    dims = parallel_dims(plan)
    g = gpu(plan.cluster.gpu)

    def ch(section: str, caveat: str | None = None, **kv) -> Candidate | None:
        cur = getattr(plan, section)
        kv = {k: v for k, v in kv.items() if getattr(cur, k) != v}
        if not kv:
            return None
        desc = ", ".join(f"{section}.{k} {_fmt(getattr(cur, k))} -> {_fmt(v)}" for k, v in kv.items())
        try:
            changed = with_changes(plan, section, **kv)
        except ValueError:  # outside a field's range (e.g. CP beyond 1024): not a candidate
            return None
        return desc, [f"{section}.{k}" for k in kv], changed, caveat

    # Interleaved pipeline: fewer bubbles (Narayanan 2021: bubble (p-1)/(v*m)).
    if dims.pp > 1:
        per_stage = shape.num_layers // dims.pp
        cur_vp = p.virtual_pipeline_model_parallel_size or 1
        for vp in [v for v in _divisors_up(per_stage, cur_vp, per_stage) if v in (2, 3, 4, 5, 6, 8)][:3]:
            yield ch("parallelism", virtual_pipeline_model_parallel_size=vp)
    # Micro-batch: bigger GEMMs vs more memory / fewer micro-batches to hide the bubble.
    for b in (t.micro_batch_size * 2, t.micro_batch_size // 2):
        if b >= 1 and b != t.micro_batch_size:
            yield ch("training", micro_batch_size=b)
    # Recompute ladder.
    rg = p.recompute_granularity
    if purpose == "speed":
        if rg == "full":
            yield ch("parallelism", recompute_granularity="selective", recompute_method=None, recompute_num_layers=None, recompute_modules=None)
            yield ch("parallelism", recompute_granularity=None, recompute_method=None, recompute_num_layers=None, recompute_modules=None)
        elif rg == "selective":
            yield ch("parallelism", recompute_granularity=None, recompute_modules=None)
    else:
        if rg is None:
            yield ch("parallelism", recompute_granularity="selective")
        if rg != "full":
            yield ch("parallelism", recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1, recompute_modules=None)
    # Tensor parallelism: smaller TP for bigger GEMMs and less exposed communication; larger for memory.
    if purpose == "speed" and dims.tp > 1:
        tp = dims.tp // 2
        yield ch("parallelism", tensor_model_parallel_size=tp, sequence_parallel=p.sequence_parallel and tp > 1,
                 tp_comm_overlap=p.tp_comm_overlap and tp > 1)
    if purpose == "memory" and dims.tp * 2 <= g.gpus_per_node:
        yield ch("parallelism", tensor_model_parallel_size=dims.tp * 2, sequence_parallel=True)
    if dims.tp > 1 and not p.sequence_parallel:
        yield ch("parallelism", sequence_parallel=True)
    if purpose == "speed" and dims.tp > 1 and p.sequence_parallel and not p.tp_comm_overlap and im.transformer_impl == "transformer_engine":
        yield ch("parallelism", tp_comm_overlap=True, caveat="needs Transformer Engine userbuffers (and --tp-comm-overlap support on the cluster)")
    # Pipeline: more stages for memory.
    if purpose == "memory" and shape.num_layers % (dims.pp * 2) == 0:
        yield ch("parallelism", pipeline_model_parallel_size=dims.pp * 2)
    # Data-parallel plumbing.
    if not p.use_distributed_optimizer and dims.dp * dims.cp > 1:
        yield ch("parallelism", use_distributed_optimizer=True)
    if purpose == "speed":
        if not p.overlap_grad_reduce and dims.dp * dims.cp > 1:
            yield ch("parallelism", overlap_grad_reduce=True)
        if not p.overlap_param_gather and p.use_distributed_optimizer and dims.dp * dims.cp > 1:
            yield ch("parallelism", overlap_param_gather=True)
    # Context / expert parallel.
    if dims.cp > 1 and purpose == "speed":
        yield ch("parallelism", context_parallel_size=dims.cp // 2)
    if purpose == "memory" and t.seq_length >= 8192:
        yield ch("parallelism", context_parallel_size=dims.cp * 2)
    if shape.is_moe and shape.num_experts:
        for ep in (dims.ep * 2, dims.ep // 2):
            if ep >= 1 and ep != dims.ep and shape.num_experts % ep == 0:
                yield ch("parallelism", expert_model_parallel_size=ep)
    # Kernels and precision.
    if im.attention_backend in ("unfused", "local") or im.transformer_impl == "local":
        if im.transformer_impl == "local":
            yield ch("implementation", transformer_impl="transformer_engine", attention_backend="flash",
                     caveat="needs Transformer Engine installed (its fused LayerNorm-linear, activation and cuDNN attention kernels)")
        else:
            yield ch("implementation", attention_backend="flash")
    if purpose == "speed" and t.precision == "bf16" and g.fp8_dense_tflops and im.transformer_impl == "transformer_engine":
        yield ch("training", precision="fp8", caveat="changes numerics: validate the loss curve against bf16 first")
    if purpose == "speed" and not im.gradient_accumulation_fusion and not im.use_torch_fsdp2:
        yield ch("implementation", gradient_accumulation_fusion=True,
                 caveat="Megatron's own linear layers need Apex's fused_weight_gradient_mlp_cuda (NGC images ship it); "
                        "Transformer Engine layers accumulate into main_grad natively")
    if purpose == "memory" and not im.expandable_segments:
        yield ch("implementation", expandable_segments=True, caveat="environment variable PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; not with CUDA graphs in older PyTorch")
    if im.grad_reduce_in_fp32:
        yield ch("implementation", grad_reduce_in_fp32=False,
                 caveat="last resort: bf16 gradient reduction loses precision over many data-parallel ranks")
