"""Plan changes: the one generator of candidate plan edits, and the memory fixes drawn from it.

`plan_changes(plan, purpose)` lists the single changes worth evaluating for speed or for memory
(a layout, batch, recompute, kernel or precision edit, with the fields that must move with it);
estimate_memory's suggestions and the OOM diagnosis's fixes both come from `memory_fixes`, the
same candidates filtered the same way, and the low-MFU diagnosis times the 'speed' candidates.
Node size, divisibility and Megatron's rules are taken one way for every tool: the cluster's
gpus_per_node (else the GPU catalog's), and the validators. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mcore_advisor.knowledge.hardware import gpu
from mcore_advisor.knowledge.megatron_flags import FULL_RECOMPUTE_DEFAULT
from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics.memory import MemoryBreakdown, memory_breakdown
from mcore_advisor.physics.moe import CUBLASLT_CACHE_FIX
from mcore_advisor.physics.step_time import hardware_params
from mcore_advisor.schemas import (
    ModelShape,
    ParallelDims,
    Plan,
    pads_to_capacity,
    parallel_dims,
    with_changes,
)
from mcore_advisor.validators import errors, validate
from mcore_advisor.validators._core import EP_OVERLAP

# Below this fraction of capacity left, suggest changes even though the plan fits: allocator
# behaviour and dataset-dependent peaks (MoE routing imbalance, variable sequence lengths) move
# the real peak by a few percent.
LOW_HEADROOM_FRACTION = 0.05
MIN_SAVING_GIB = 0.05
"""A memory fix must lower the total per-GPU memory by more than this (smaller is rounding)."""

Purpose = Literal["speed", "memory"]


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


@dataclass(frozen=True)
class PlanChange:
    """One candidate edit: the changed plan, each field that moves (dotted name, current, proposed;
    the first is the one the change is about) and what it costs or requires."""

    changes: tuple[tuple[str, Any, Any], ...]
    plan: Plan
    note: str | None = None

    @property
    def fields(self) -> list[str]:
        return [f for f, _, _ in self.changes]

    @property
    def description(self) -> str:
        return ", ".join(f"{f} {_fmt(cur)} -> {_fmt(new)}" for f, cur, new in self.changes)


def _fmt(v) -> str:
    return "None" if v is None else str(v)


@dataclass(frozen=True)
class _Ctx:
    plan: Plan
    shape: ModelShape
    dims: ParallelDims
    gpus_per_node: int  # the cluster's node size, else the GPU catalog's


def _change(c: _Ctx, section: str, note: str | None = None, **values: Any) -> PlanChange | None:
    """The plan with these fields of one section set; None when nothing changes or a value is
    outside its field's range (e.g. CP beyond 1024)."""
    cur = getattr(c.plan, section)
    values = {k: v for k, v in values.items() if getattr(cur, k) != v}
    if not values:
        return None
    try:
        changed = with_changes(c.plan, section, **values)
    except ValueError:
        return None
    return PlanChange(tuple((f"{section}.{k}", getattr(cur, k), v) for k, v in values.items()), changed, note)


def plan_changes(plan: Plan, purpose: Purpose) -> list[PlanChange]:
    """Single plan changes worth evaluating for `purpose`, each once (by the plan it makes).

    Layout changes keep the GPU count (DP absorbs TP/PP/CP changes); validity is for the caller
    to check (`memory_fixes` does)."""
    c = _Ctx(plan, resolve_model(plan.model), parallel_dims(plan), hardware_params(plan.cluster).gpus_per_node)
    seen: set[str] = set()
    out = []
    for gen in (_allocator_and_kernels, _cuda_graphs, _recompute, _batch_and_pipeline, _tensor_parallel, _data_parallel,
                _context_and_experts, _precision):
        for ch in gen(c, purpose):
            key = ch.plan.model_dump_json() if ch is not None else None
            if key is not None and key not in seen:
                seen.add(key)
                out.append(ch)
    return out


def _allocator_and_kernels(c: _Ctx, purpose: Purpose) -> Iterator[PlanChange | None]:
    im, impl = c.plan.implementation, "implementation"
    if purpose == "memory" and not im.expandable_segments:
        yield _change(c, impl, "environment variable PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; no throughput "
                      "cost (not with CUDA graphs in older PyTorch)", expandable_segments=True)
    if im.attention_backend in ("unfused", "local"):
        yield _change(c, impl, "flash/fused attention never stores the s x s scores; also faster", attention_backend="auto")
    if im.transformer_impl == "local":
        yield _change(c, impl, "needs Transformer Engine installed (its fused LayerNorm-linear, activation and cuDNN "
                      "attention kernels)", transformer_impl="transformer_engine", attention_backend="flash")
    if im.create_attention_mask_in_dataloader:
        yield _change(c, impl, "--no-create-attention-mask-in-dataloader: causal attention never reads the seq x seq "
                      "mask the data loader builds, pins and copies every micro-batch", create_attention_mask_in_dataloader=False)
    # TE's fused cross entropy (2 B/logit) is not offered: Megatron-LM 0.19's validate_args refuses it.
    if purpose == "memory" and im.cross_entropy_loss_fusion and im.cross_entropy_fusion_impl == "native":
        yield _change(c, impl, "unfused vocab-parallel cross entropy works in place: 6 B/logit instead of 10; a few "
                      "more kernels", cross_entropy_loss_fusion=False)
    if purpose == "speed" and not im.gradient_accumulation_fusion and not im.use_torch_fsdp2:
        yield _change(c, impl, "Megatron's own linear layers need Apex's fused_weight_gradient_mlp_cuda (NGC images "
                      "ship it); Transformer Engine layers accumulate into main_grad natively",
                      gradient_accumulation_fusion=True)


def _cuda_graphs(c: _Ctx, purpose: Purpose) -> Iterator[PlanChange | None]:
    """Transformer Engine's CUDA graphs (Megatron-Bridge's choice): the whole layer, or on a dropless MoE model the
    attention, router and preprocess (the experts' dispatch reads token counts back to the host, which a graph cannot
    hold). On one H100 the whole layer took a host-bound 0.85B Llama-style step from 1.61-1.93 s to 0.49 s
    (benchmarks/results/gpu_h100_Z_runs.jsonl)."""
    im = c.plan.implementation
    if purpose != "speed" or im.cuda_graph_impl != "none" or im.transformer_impl != "transformer_engine":
        return
    drop_pad = pads_to_capacity(im.moe_expert_capacity_factor, im.moe_pad_expert_input_to_capacity)
    mods = ["attn", "moe_router", "moe_preprocess"] if c.shape.is_moe and not drop_pad else []
    what = "the attention, router and preprocess" if mods else "each layer"
    ch = _change(c, "implementation", f"CUDA graphs of {what}: the captured kernels replay from one launch, so a host "
                 "that launches slower than the GPU runs stops holding it back; the graphs' pools take some memory",
                 cuda_graph_impl="transformer_engine", cuda_graph_modules=mods or None)
    # Megatron's CUDA-graph asserts (full recompute, recompute under dropout, ...) refuse some plans: no offer there
    if ch is not None and not any(f.code.startswith("cuda_graph") for f in errors(validate(ch.plan))):
        yield ch


def _recompute(c: _Ctx, purpose: Purpose) -> Iterator[PlanChange | None]:
    p, im, P = c.plan.parallelism, c.plan.implementation, "parallelism"
    rg = p.recompute_granularity
    if purpose == "speed":
        if rg == "full":
            yield _change(c, P, "reruns only core attention", recompute_granularity="selective", recompute_method=None,
                          recompute_num_layers=None, recompute_modules=None)
        if rg is not None:
            yield _change(c, P, "no forward rerun in backward; more activation memory", recompute_granularity=None,
                          recompute_method=None, recompute_num_layers=None, recompute_modules=None)
        return
    if (rg == "selective" and im.transformer_impl == "transformer_engine" and im.attention_backend not in ("unfused", "local")
            and set(p.recompute_modules or ["core_attn"]) == {"core_attn"}):
        # Flash attention stores no s x s scores, and checkpointing it keeps the whole QKV output
        # alive (physics.memory): with TE, selective core_attn recompute costs memory.
        yield _change(c, P, "with TE flash attention, recomputing core attention saves nothing and keeps the QKV "
                      "GEMM output; also faster", recompute_granularity=None, recompute_modules=None)
    if rg is None:
        yield _change(c, P, "recomputes core attention (Megatron default module): ~2-3% more FLOPs",
                      recompute_granularity="selective", recompute_modules=None)
    if rg != "full":
        yield _change(c, P, "reruns every layer's forward: ~25-33% more compute", recompute_granularity="full",
                      recompute_method=FULL_RECOMPUTE_DEFAULT[0], recompute_num_layers=FULL_RECOMPUTE_DEFAULT[1],
                      recompute_modules=None)


def _batch_and_pipeline(c: _Ctx, purpose: Purpose) -> Iterator[PlanChange | None]:
    t, p, d, L = c.plan.training, c.plan.parallelism, c.dims, c.shape.num_layers
    if purpose == "speed":
        yield _change(c, "training", "bigger GEMMs; more activation memory, fewer micro-batches to fill the pipeline",
                      micro_batch_size=t.micro_batch_size * 2)
    if t.micro_batch_size > 1:
        yield _change(c, "training", "smaller GEMMs, more microbatches", micro_batch_size=t.micro_batch_size // 2)
    if purpose == "speed" and d.pp > 1:
        # Interleaved pipeline: fewer bubbles (Narayanan 2021: bubble (p-1)/(v*m)).
        per_stage, cur = L // d.pp, p.virtual_pipeline_model_parallel_size or 1
        for vp in [v for v in range(cur + 1, per_stage + 1) if per_stage % v == 0 and v in (2, 3, 4, 5, 6, 8)][:3]:
            yield _change(c, "parallelism", "smaller bubble; more activations in flight and more send/receive",
                          virtual_pipeline_model_parallel_size=vp)
    pp2 = d.pp * 2
    if purpose == "memory" and L % pp2 == 0 and c.plan.cluster.num_gpus % (d.tp * pp2 * d.cp) == 0 and d.dp >= 2:
        vp = p.virtual_pipeline_model_parallel_size
        extra = {"virtual_pipeline_model_parallel_size": None} if vp and L % (pp2 * vp) else {}
        yield _change(c, "parallelism", f"halves DP to {d.dp // 2}; larger pipeline bubble",
                      pipeline_model_parallel_size=pp2, **extra)


def _tensor_parallel(c: _Ctx, purpose: Purpose) -> Iterator[PlanChange | None]:
    p, d, s, P = c.plan.parallelism, c.dims, c.shape, "parallelism"
    if purpose == "speed" and d.tp > 1:
        tp = d.tp // 2
        yield _change(c, P, "bigger GEMMs and less TP communication; more memory per GPU", tensor_model_parallel_size=tp,
                      sequence_parallel=p.sequence_parallel and tp > 1, tp_comm_overlap=p.tp_comm_overlap and tp > 1)
    tp2 = d.tp * 2
    # Megatron needs heads and query groups divisible by TP; keep TP inside the NVLink domain.
    if (purpose == "memory" and s.num_attention_heads % tp2 == 0 and s.num_query_groups % tp2 == 0
            and tp2 <= c.gpus_per_node and c.plan.cluster.num_gpus % (tp2 * d.pp * d.cp) == 0):
        yield _change(c, P, f"halves DP to {d.dp // 2}; more TP communication inside the node",
                      tensor_model_parallel_size=tp2, sequence_parallel=True)
    if d.tp > 1 and not p.sequence_parallel:
        yield _change(c, P, "shards norm/dropout activations over TP at no extra communication", sequence_parallel=True)
    if (purpose == "speed" and d.tp > 1 and p.sequence_parallel and not p.tp_comm_overlap
            and c.plan.implementation.transformer_impl == "transformer_engine"):
        yield _change(c, P, "needs Transformer Engine userbuffers (and --tp-comm-overlap support on the cluster)",
                      tp_comm_overlap=True)


def _data_parallel(c: _Ctx, purpose: Purpose) -> Iterator[PlanChange | None]:
    p, d, P = c.plan.parallelism, c.dims, "parallelism"
    if d.dp * d.cp <= 1:
        return
    if not p.use_distributed_optimizer:
        yield _change(c, P, "shards the fp32 main params and Adam state over DP*CP (reduce-scatter + all-gather "
                      "instead of all-reduce)", use_distributed_optimizer=True)
    if purpose == "speed" and not p.overlap_grad_reduce:
        yield _change(c, P, "hides the gradient reduction behind the backward", overlap_grad_reduce=True)
    if purpose == "speed" and not p.overlap_param_gather and p.use_distributed_optimizer:
        yield _change(c, P, "hides the parameter all-gather behind the forward", overlap_param_gather=True)


def _context_and_experts(c: _Ctx, purpose: Purpose) -> Iterator[PlanChange | None]:
    d, s, t, P, n = c.dims, c.shape, c.plan.training, "parallelism", c.plan.cluster.num_gpus
    if purpose == "speed" and d.cp > 1:
        yield _change(c, P, "less ring-attention communication; more activation memory", context_parallel_size=d.cp // 2)
    cp2 = d.cp * 2
    if purpose == "memory" and t.seq_length >= 8192 and t.seq_length % (2 * cp2) == 0 and n % (d.tp * d.pp * cp2) == 0 and d.dp >= 2:
        yield _change(c, P, "splits the sequence; ring attention communication", context_parallel_size=cp2)
    im = c.plan.implementation
    if (purpose == "speed" and s.is_moe and not im.moe_router_force_load_balancing
            and (im.cublaslt_heuristics_cache_capacity or 0) < CUBLASLT_CACHE_FIX):
        yield _change(c, "implementation", f"environment variable CUBLASLT_HEURISTICS_CACHE_CAPACITY={CUBLASLT_CACHE_FIX}: "
                      "the expert GEMMs' row counts, uneven under real routing, stop thrashing cuBLASLt's algorithm cache "
                      "(a few MB of host memory)", cublaslt_heuristics_cache_capacity=CUBLASLT_CACHE_FIX)
    if purpose == "speed" and s.is_moe:
        yield _accepted_by_megatron(_change(
            c, "implementation", "Megatron's combined 1F1B schedule: each token all-to-all runs under the other "
            "micro-batch's attention or experts, the expert weight gradients under the backward's dispatch; its own host "
            "launches cost about what it hides on a slow (VM) host", overlap_moe_expert_parallel_comm=True,
            delay_wgrad_compute=im.transformer_impl == "transformer_engine"), EP_OVERLAP)
    if s.is_moe and s.num_experts:
        for ep in (d.ep * 2, d.ep // 2):
            if ep >= 1 and ep != d.ep and s.num_experts % ep == 0 and (d.world // (d.etp * d.pp)) % ep == 0:
                note = "fewer experts per GPU; more all-to-all traffic" if ep > d.ep else "less all-to-all traffic; more experts per GPU"
                yield _change(c, P, note, expert_model_parallel_size=ep)


def _accepted_by_megatron(ch: PlanChange | None, field: str) -> PlanChange | None:
    """The change unless a validator rule on `field` refuses the plan it makes (the rules are Megatron's asserts)."""
    if ch is None or any(field in f.fields for f in errors(validate(ch.plan))):
        return None
    return ch


def _precision(c: _Ctx, purpose: Purpose) -> Iterator[PlanChange | None]:
    t, im = c.plan.training, c.plan.implementation
    if (purpose == "speed" and t.precision == "bf16" and gpu(c.plan.cluster.gpu).fp8_dense_tflops
            and im.transformer_impl == "transformer_engine"):
        yield _change(c, "training", "changes numerics: validate the loss curve against bf16 first", precision="fp8")
    if im.grad_reduce_in_fp32:
        yield _change(c, "implementation", "last resort: bf16 gradient buffer and reduction lose precision over many "
                      "data-parallel ranks (2 B/param less)", grad_reduce_in_fp32=False)


# ---- memory fixes: the same for estimate_memory and the OOM diagnosis ------------------------


@dataclass(frozen=True)
class MemoryFix:
    change: PlanChange
    memory: MemoryBreakdown  # the changed plan's
    saves_gib: float


def memory_fix_candidates(plan: Plan, base: MemoryBreakdown) -> list[MemoryFix]:
    """The 'memory' changes that add no validator error to the plan's and lower the most-loaded
    GPU's total memory by more than MIN_SAVING_GIB, largest saving first."""
    base_errors = {f.code for f in errors(validate(plan))}
    out = []
    for ch in plan_changes(plan, "memory"):
        try:
            if {f.code for f in errors(validate(ch.plan))} - base_errors:
                continue
            nb = memory_breakdown(ch.plan)
        except (KeyError, ValueError, ArithmeticError):
            continue
        saves = base.total_gib - nb.total_gib
        if saves > MIN_SAVING_GIB:
            out.append(MemoryFix(ch, nb, saves))
    out.sort(key=lambda f: -f.saves_gib)
    return out


def memory_fixes(plan: Plan, bd: MemoryBreakdown) -> list[MemoryChange]:
    """estimate_memory's suggestions: `memory_fix_candidates`, each by the field it is about."""
    return [MemoryChange(field=f.change.changes[0][0], current=f.change.changes[0][1], proposed=f.change.changes[0][2],
                         saves_gib=round(f.saves_gib, 2), total_gib_after=round(f.memory.total_gib, 2),
                         fits_after=f.memory.fits, note=f.change.note or "")
            for f in memory_fix_candidates(plan, bd)]
