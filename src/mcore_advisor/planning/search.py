"""The layout search behind recommend_parallelism: enumerate, check, prune, score in arrays.

How one search runs (`search(inputs)`):

1. Layouts. Every (TP, PP, stage split, VP, CP, EP, ETP, SP, precision) the constraints allow,
   with TP*PP*CP dividing the world size by construction (DP is derived; pinned values are tried
   even when they do not, so the validators can say why). Each VP is searched under the most balanced
   stage split Megatron builds with it: even, lighter first/last stages, or the embedding/loss-aware split
   (`pipeline_splits`). Where TP communication overlap (--tp-comm-overlap) can run (`tp_overlap_runs`),
   the layout is timed with and without it. A layout is counted once, under the first check it fails, in this order:
   - model-state bound: the bf16 weights + gradient buffer + Adam state of the most-loaded
     pipeline rank, with the distributed optimizer (or FSDP) sharding as far as the layout allows,
     plus the CUDA context, already exceed the usable memory (physics.memory.model_state_gib, all
     model-parallel shapes in one batch). It depends only on (TP, PP, split, VP, EP, ETP), so one
     check skips every CP, SP and precision under it (`layouts_pruned_by_model_state`);
   - the validators' error rules through their fast path `validators.layout_errors` (micro-batch
     1, no recompute), first failing code in registry order;
   - Megatron rules the validators report only as warnings but Megatron enforces
     (`RECOMMENDER_RULES`).
   With a caller's `deadline`, layouts are checked and scored in groups of shapes (`GROUP_LAYOUTS`),
   the likeliest winners first, merged into the outcome one batch of all of them gives; the deadline
   is asked between groups and stops the search there (`layouts_not_reached` counts the rest).
2. Configurations. Each surviving layout x micro-batch size (divisors of GBS/DP) x distributed
   optimizer on/off (off only under FSDP, which replaces it) x recompute option (none; selective =
   Megatron's default core_attn; full 'block' with k = 1..layers-per-chunk; full 'uniform' with
   every group size that tiles the chunks). Memory of all of them comes from
   `physics.memory.memory_arrays` on one physics.layouts.LayoutBatch, the function memory_breakdown
   is a one-row view of (so every memory field, FSDP included, is searched as the tools report it).
   The block sweep is solved in closed form (`physics.memory.block_recompute_layers_to_fit`): memory
   falls linearly with k, so the smallest k that fits is computed, not searched. Recompute options
   (and the selective-recompute activation table of a layout) are evaluated only for configurations
   that do not fit without recompute: where one does, every recompute option of it is dominated.
3. Timing. Recomputing more never runs faster (`physics.step_time` adds the rerun forward and at most
   hides the same amount of DP communication behind it), so per (layout, micro-batch, optimizer)
   only the fastest-possible fitting options are timed: no recompute if it fits, otherwise
   selective and the smallest fitting block k, otherwise the smallest fitting uniform group.
   Likewise the distributed optimizer never needs more memory and is never slower in physics.step_time,
   so optimizer-off variants are dominated unless pinned (tests check both premises). The rest
   are counted as dominated. Timing is one `physics.step_time.step_time_arrays` call over all of them.

Every count lands in `SearchStats`; configurations_enumerated = rejected + over memory +
dominated + timed, and layouts likewise (+ not reached). Pure: no clock, no I/O (a deadline is the caller's).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from typing import Literal, NamedTuple

import numpy as np

from mcore_advisor.knowledge.hardware import GpuSpec
from mcore_advisor.physics.layouts import (
    RECOMPUTE_FULL,
    RECOMPUTE_NONE,
    RECOMPUTE_SELECTIVE,
    Implementation,
    LayoutBatch,
)
from mcore_advisor.physics.memory import (
    CUDA_CONTEXT_GIB,
    activation_table,
    block_recompute_layers_to_fit,
    memory_arrays,
    model_state_gib,
    stage_table,
)
from mcore_advisor.physics.step_time import HardwareParams, step_time_arrays
from mcore_advisor.schemas import (
    MAX_MICRO_BATCH_SIZE,
    ClusterSpec,
    ImplementationSpec,
    ModelShape,
    layers_per_stage,
)
from mcore_advisor.validators import Ctx, layout_errors

# Recompute option codes in the candidate table.
RC_NONE, RC_SELECTIVE, RC_BLOCK, RC_UNIFORM = 0, 1, 2, 3

# Rejections the recommender makes beyond the validators' rules (code -> reason); none at present:
# MoE with TP > 1 and no SP is the validators' error expert_and_tensor_parallel_without_sp.
RECOMMENDER_RULES: dict[str, str] = {}
_CHUNK_ROWS = 1 << 16  # memory is evaluated in blocks of rows to bound the temporaries
GROUP_LAYOUTS = 1024
"""Layouts (counted under their model-parallel shapes) checked and scored together. A deadline is
looked at between groups, so one group's cost (up to about 0.4 s of CPU cold on a 2-core host) is how
late a search can stop. Measured warm on 4 large searches: 1024 costs about 10% over one batch of
all layouts, 512 about 70%, 256 twice."""


@dataclass(frozen=True)
class Fixed:
    """Values the user pinned; None = searched. vp 1 = not interleaved; recompute 'none' = off."""

    tp: int | None = None
    pp: int | None = None
    vp: int | None = None
    first: int | None = None
    last: int | None = None
    cp: int | None = None
    ep: int | None = None
    etp: int | None = None
    dp: int | None = None
    mbs: int | None = None
    sp: bool | None = None
    dist_opt: bool | None = None
    recompute: Literal["none", "selective", "full"] | None = None
    recompute_method: Literal["uniform", "block"] | None = None
    recompute_num_layers: int | None = None


@dataclass(frozen=True)
class SearchInputs:
    """Everything a search needs, resolved (the recommender builds it from a request)."""

    shape: ModelShape
    gpu: GpuSpec
    hardware: HardwareParams
    cluster: ClusterSpec
    seq_length: int
    global_batch_size: int
    precisions: tuple[str, ...]
    implementation: ImplementationSpec
    fp8_recipe: str = "delayed"
    fp8_param_gather: bool = False  # FP8 rows keep FP8 weights and all-gather them in FP8 (--fp8-param-gather)
    capacity_gib: float = 80.0
    required_headroom_gib: float = 0.0
    fixed: Fixed = field(default_factory=Fixed)
    max_tp: int | None = None
    allow_recompute: bool = True
    tp_comm_overlap: bool = True  # TE userbuffers TP overlap wherever it runs (tp_overlap_runs); False = never
    quick: bool = False  # lower fidelity: TP within a node, ETP 1 or TP, CP a power of two, SP on with TP > 1, micro-batch <= 8, distributed optimizer on


@dataclass
class SearchStats:
    """Counts of one search (see the module docstring for the order of checks)."""

    layouts_enumerated: int = 0
    layouts_pruned_by_model_state: int = 0
    layouts_rejected_by_rule: dict[str, int] = field(default_factory=dict)
    layouts_searched: int = 0
    layouts_not_reached: int = 0  # left unchecked when the caller's deadline stopped the search
    configurations_enumerated: int = 0
    configurations_rejected_by_rule: dict[str, int] = field(default_factory=dict)
    configurations_over_memory: int = 0
    configurations_dominated: int = 0
    configurations_timed: int = 0


class StageSplit(NamedTuple):
    """How the PP stages share the decoder layers: Megatron's --decoder-first/last-pipeline-num-layers
    (`first`/`last`; None = the even share) or its embedding/loss-aware split
    (--account-for-embedding/loss-in-pipeline-split: the embedding and the output layer + loss each count as one
    layer of an even split, so the first/last stage builds one layer fewer). A split is of one kind: Megatron's
    TransformerConfig rejects first/last stage layer counts together with the embedding/loss-aware split."""

    first: int | None = None
    last: int | None = None
    embedding: bool = False
    loss: bool = False


@dataclass
class Layout:
    tp: int
    pp: int
    vp: int
    split: StageSplit
    cp: int
    ep: int
    etp: int
    sp: bool
    precision: str
    dp: int
    tp_overlap: bool = False  # --tp-comm-overlap (tp_overlap_runs)


@dataclass
class SearchOutcome:
    """Timed candidates (parallel numpy columns, one entry per candidate) and the stats."""

    layouts: list[Layout]
    layout: np.ndarray  # index into layouts
    mbs: np.ndarray
    dist_opt: np.ndarray
    recompute: np.ndarray  # RC_* code
    recompute_num_layers: np.ndarray  # k (block) or group size (uniform); 0 otherwise
    iteration_time_s: np.ndarray
    tokens_per_s_per_gpu: np.ndarray
    memory_total_gib: np.ndarray
    stats: SearchStats
    min_model_state_gib: float  # smallest model-state bound over all (TP, PP, EP, ETP) tried
    best_unconstrained_total_gib: float  # smallest memory of any configuration that passed the rules


@lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


def divisors(n: int) -> list[int]:
    return list(_divisors(n))


def _first_last_sizes(num_layers: int, pp: int) -> list[tuple[int, int | None, tuple[int, ...]]]:
    """(first, last, stage sizes) of the first/last splits that keep the most-loaded stage at ceil(L / PP)
    layers (what physics.step_time times) and the middle stages equal (Llama-3.1-405B: 126 layers on PP16 =
    7 + 14 x 8 + 7)."""
    if pp == 2:
        first = num_layers // 2
        return [(first, None, (first, num_layers - first))]
    m = -(-num_layers // pp)
    rest = num_layers - (pp - 2) * m  # layers left for the first and last stages
    out: list[tuple[int, int | None, tuple[int, ...]]] = [(f, rest - f, (f, m, rest - f))
                                                         for f in range(max(1, rest - m), min(m, rest - 1) + 1)]
    f1 = num_layers - (pp - 1) * m
    if 1 <= f1 < m:
        out.append((f1, None, (f1, m)))
    return out


def _balance(sizes: tuple[int, ...]) -> tuple[int, bool]:
    # symmetric first/last stages, then a lighter first stage
    return abs(sizes[0] - sizes[-1]), sizes[-1] < sizes[0]


def pipeline_splits(num_layers: int, pp: int, *, account: bool = True) -> list[tuple[StageSplit, tuple[int, ...]]]:
    """(split, VPs) to search for one PP: each VP once, under the most balanced split Megatron builds with it.

    Candidates: the even split where PP divides the layers, else lighter first/last stages
    (`_first_last_sizes`), which interleave only over a VP dividing every stage's layers; and (`account`) the
    embedding/loss-aware splits where num_layers + 2 (embedding and loss) or + 1 (the loss alone: the
    output layer's vocabulary GEMM and the loss cost far more than the embedding lookup) divide by PP. Those
    build the stage sizes of a first/last split but interleave over any VP that divides a stage's slots
    (get_num_layers_to_build: the embedding/loss leave the first/last model chunk one layer short):
    Llama-3.1-405B's 126 layers on PP8 are 15 + 6 x 16 + 15 either way, interleaved only as 128 slots
    (VP 2, 4, 8, 16; the NeMo/Megatron-Bridge recipe runs VP8). Ranked by balance, and at equal balance a
    first/last split before an embedding/loss-aware one. No split exists: [] (the validators say why).
    """
    if pp == 1:
        return [(StageSplit(), (1,))]
    cands: list[tuple[tuple[int, bool], int, StageSplit, tuple[int, ...]]] = []
    if num_layers % pp == 0:
        cands.append(((0, False), 0, StageSplit(), _divisors(num_layers // pp)))
    else:
        cands += [(_balance(sizes), 0, StageSplit(first, last), _vps(sizes))
                  for first, last, sizes in _first_last_sizes(num_layers, pp)]
    for emb in (True, False) if account else ():
        slots = num_layers + emb + 1
        if slots % pp == 0 and slots // pp > 1:  # every stage keeps a layer
            sizes = tuple(layers_per_stage(num_layers, pp, embedding=emb, loss=True))
            # Every VP dividing the slots, even one whose first/last chunk holds only the embedding/loss
            # (Megatron's MoE model zoo runs Qwen3-235B's 94 layers as 96 slots on PP32 VP3).
            cands.append((_balance(sizes), 1, StageSplit(embedding=emb, loss=True), _divisors(slots // pp)))
    cands.sort(key=lambda c: c[:2])
    out: list[tuple[StageSplit, tuple[int, ...]]] = []
    used: set[int] = set()
    for _, _, split, vps in cands:
        new = tuple(v for v in vps if v not in used)
        if new:
            used.update(new)
            out.append((split, new))
    return out


def _vps(stage_sizes: tuple[int, ...]) -> tuple[int, ...]:
    g = 0
    for x in stage_sizes:
        g = math.gcd(g, x)
    return _divisors(max(1, g))


@lru_cache(maxsize=4096)
def stage_ends(num_layers: int, pp: int, split: StageSplit) -> tuple[int, int]:
    """(first, last) stage layers as a physics.layouts.LayoutBatch row encodes a split (-1 = the even share):
    the embedding/loss-aware split as the stage sizes Megatron builds (what LayoutBatch.from_plan encodes)."""
    if pp > 1 and (split.embedding or split.loss):
        stages = layers_per_stage(num_layers, pp, embedding=split.embedding, loss=split.loss)
        return stages[0], stages[-1]
    return (-1 if split.first is None else split.first), (-1 if split.last is None else split.last)


@lru_cache(maxsize=4096)
def chunk_layers(num_layers: int, pp: int, vp: int, split: StageSplit) -> tuple[int, ...]:
    """The distinct layer counts of the model chunks Megatron builds (transformer_block.get_num_layers_to_build):
    each stage's slots over VP, a slot being a layer or, with the embedding/loss-aware split, the embedding
    (first chunk of the first stage) or the output layer + loss (last chunk of the last stage), which that
    chunk builds in place of a layer. Uniform recompute groups must tile every one of them."""
    if pp == 1:
        return (num_layers,)
    stages = layers_per_stage(num_layers, pp, split.first, split.last, embedding=split.embedding, loss=split.loss)
    sizes = {n // vp for n in stages[1:-1]}
    emb, loss = int(split.embedding), int(split.loss)
    sizes.add((stages[0] + emb) // vp - emb)
    sizes.add((stages[-1] + loss) // vp - loss)
    if vp > 1:  # the ends' other chunks hold only layers
        sizes.update({(stages[0] + emb) // vp, (stages[-1] + loss) // vp})
    return tuple(sorted(sizes))


def tp_overlap_runs(tp: int, sequence_parallel: bool, transformer_impl: str, gpus_per_node: int) -> bool:
    """Whether --tp-comm-overlap can run on this layout: Megatron's validate_args asserts sequence parallelism
    (which Megatron turns off at TP 1), the overlap is Transformer Engine's userbuffers (initialize_ub; the
    local spec has none), and the userbuffers exchange through the TP peers' memory over NVLink, so the TP group
    (consecutive ranks) must sit in one node: TP divides the GPUs per node. The search times each such layout
    with and without it (Megatron-Bridge/NeMo performance recipes turn it on): the overlap hides the TP
    collectives but slows the GEMMs it runs beside (physics.step_time.UB_GEMM_STRETCH)."""
    return (sequence_parallel and tp > 1 and transformer_impl == "transformer_engine"
            and gpus_per_node % tp == 0)


def _overlap(inp: SearchInputs, tp: int, sp: bool) -> bool:
    return inp.tp_comm_overlap and tp_overlap_runs(tp, sp, inp.implementation.transformer_impl, inp.hardware.gpus_per_node)


def _overlap_options(inp: SearchInputs, tp: int, sp: bool) -> tuple[bool, ...]:
    """Both where the overlap can run: it hides the TP collectives but stretches the GEMMs beside it
    (physics.step_time.UB_GEMM_STRETCH), so which is faster depends on the layout."""
    return (True, False) if _overlap(inp, tp, sp) else (False,)


def _add(d: dict[str, int], key: str, n: int) -> None:
    if n:
        d[key] = d.get(key, 0) + n



def _recompute_allowed(inp: SearchInputs) -> tuple[bool, bool, bool, bool]:
    """(none, selective, block, uniform) options the request permits."""
    f = inp.fixed
    if not inp.allow_recompute:
        return True, False, False, False
    none = f.recompute in (None, "none")
    sel = f.recompute in (None, "selective")
    full = f.recompute in (None, "full")
    block = full and f.recompute_method in (None, "block")
    uniform = full and f.recompute_method in (None, "uniform")
    if f.recompute_num_layers is not None and f.recompute != "full" and f.recompute_method is None:
        none = sel = False
    if (block or uniform) and _full_recompute_refused(inp):
        block = uniform = False
    return none, sel, block, uniform


def _full_recompute_refused(inp: SearchInputs) -> bool:
    """Whether Megatron refuses full recompute with the request's implementation: error rules that full recompute
    adds to a candidate without it (the all-to-all overlap's, TransformerConfig's assert)."""
    base = _rules_base(inp)
    full = base.with_layout(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return bool(set(layout_errors(full)) - set(layout_errors(base)))



# ---------------------------------------------------------------------------------------------
# 1. Layouts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shard:
    """A model-parallel shape before CP, SP and precision: what the model-state bound depends on."""

    tp: int
    pp: int
    split: StageSplit
    vp: int
    ep: int
    etp: int
    cps: tuple[int, ...]
    sps: tuple[bool, ...]

    def layouts_under(self, inp: SearchInputs) -> int:
        return len(self.cps) * sum(len(_overlap_options(inp, self.tp, sp)) for sp in self.sps) * len(inp.precisions)


def _max_tp(inp: SearchInputs) -> int:
    max_tp = inp.max_tp or inp.cluster.num_gpus
    return min(max_tp, inp.hardware.gpus_per_node) if inp.quick else max_tp


def _splits(inp: SearchInputs, pp: int) -> list[tuple[StageSplit, int]]:
    """(stage split, VP) pairs to search for one PP."""
    f, L = inp.fixed, inp.shape.num_layers
    if pp > 1 and (f.first is not None or f.last is not None):
        try:
            sizes = tuple(layers_per_stage(L, pp, f.first, f.last))
        except ValueError:
            sizes = (1,)  # the validators reject it with the reason
        splits = [(StageSplit(f.first, f.last), _vps(sizes))]
    else:
        # A hybrid model's stages follow its pattern's '|': Megatron rejects the embedding/loss-aware split there.
        splits = (pipeline_splits(L, pp, account=inp.shape.hybrid_layer_pattern is None)
                  or [(StageSplit(), (1,))])  # none exists: the validators say so
    pairs = [(split, vp) for split, vps in splits for vp in vps if f.vp is None or vp == f.vp]
    if f.vp is not None and f.vp > 1 and pp > 1 and not pairs:
        pairs = [(splits[0][0], f.vp)]  # the validators say why it cannot be
    return pairs


def _cps(inp: SearchInputs, tp: int, pp: int) -> tuple[int, ...]:
    f = inp.fixed
    rest = max(1, inp.cluster.num_gpus // (tp * pp))
    cps = [f.cp] if f.cp is not None else divisors(rest)
    if inp.quick and f.cp is None:
        cps = [c for c in cps if c & (c - 1) == 0]
    if f.dp is not None:
        cps = [c for c in cps if rest // c == f.dp]
    return tuple(cps)


def _expert_dims(inp: SearchInputs, tp: int) -> tuple[list[int], list[int]]:
    """(EPs, ETPs) to search with this TP."""
    f, shape = inp.fixed, inp.shape
    if not shape.is_moe:
        return ([1] if f.ep in (None, 1) else [f.ep]), [tp]
    max_tp = _max_tp(inp)
    eps = [f.ep] if f.ep is not None else divisors(shape.num_experts or 0)
    etps = [f.etp] if f.etp is not None else [e for e in divisors(inp.hardware.gpus_per_node) if e <= max_tp]
    if f.etp is None and tp not in etps and tp <= max_tp:
        etps.append(tp)
    if inp.quick and f.etp is None:
        etps = [e for e in etps if e in (1, tp)]
    return eps, etps


def _shards(inp: SearchInputs) -> list[_Shard]:
    """Every model-parallel shape the constraints allow (pinned values are tried even when they do
    not divide the world size, so the validators say why)."""
    f, world = inp.fixed, inp.cluster.num_gpus
    out = []
    for tp in [f.tp] if f.tp is not None else [t for t in divisors(world) if t <= _max_tp(inp)]:
        sps = (False,) if tp == 1 else ((True,) if inp.quick else (True, False))
        if f.sp is not None and tp > 1:
            sps = (f.sp,)
        eps, etps = _expert_dims(inp, tp)
        for pp in [f.pp] if f.pp is not None else [p for p in divisors(max(1, world // tp)) if p <= inp.shape.num_layers]:
            cps = _cps(inp, tp, pp)
            out += [_Shard(tp, pp, split, vp, ep, etp, cps, sps)
                    for ep in eps for etp in etps for split, vp in _splits(inp, pp)]
    return out


def _implementation(inp: SearchInputs) -> Implementation:
    return Implementation.of(inp.implementation, fp8_recipe=inp.fp8_recipe, fp8_param_gather=inp.fp8_param_gather)


def _shard_batch(inp: SearchInputs, shards: list[_Shard], cp: np.ndarray | int = 1, **extra) -> LayoutBatch:
    """One row per shard (its TP, PP, VP, EP, ETP and uneven split), DP = world / (TP*PP*CP)."""
    world = inp.cluster.num_gpus
    col = lambda get: np.asarray([get(x) for x in shards], dtype=np.int64)  # noqa: E731
    tp, pp = col(lambda x: x.tp), col(lambda x: x.pp)
    return LayoutBatch(
        inp.shape, inp.seq_length, inp.global_batch_size, _implementation(inp), tp=tp, pp=pp, cp=cp,
        dp=np.maximum(1, world // (tp * pp * cp)), num_gpus=world, ep=col(lambda x: x.ep), etp=col(lambda x: x.etp),
        vp=col(lambda x: x.vp), use_distributed_optimizer=not inp.implementation.use_torch_fsdp2,
        first_stage_layers=col(lambda x: stage_ends(inp.shape.num_layers, x.pp, x.split)[0]),
        last_stage_layers=col(lambda x: stage_ends(inp.shape.num_layers, x.pp, x.split)[1]), **extra,
    )


def _model_state_bounds(inp: SearchInputs, shards: list[_Shard]) -> np.ndarray:
    """GiB of weights + gradients + optimizer state (sharded over DP*CP = world/(TP*PP)) on each
    shard's most-loaded rank, with the allocator margin and the CUDA context."""
    return model_state_gib(_shard_batch(inp, shards)) + CUDA_CONTEXT_GIB


# The validators' context fields that are ImplementationSpec fields: every candidate carries the request's.
_CTX_IMPLEMENTATION = tuple(f.name for f in fields(Ctx) if f.init and f.name in ImplementationSpec.model_fields)


def _rules_base(inp: SearchInputs) -> Ctx:
    """The validators' view of every candidate, before its layout is filled in (micro-batch 1, no recompute)."""
    cl, im = inp.cluster, inp.implementation
    # FSDP replaces the distributed optimizer and its parameter all-gather
    extra = dict(use_distributed_optimizer=False, overlap_param_gather=False) if im.use_torch_fsdp2 else {}
    return Ctx(
        inp.shape, inp.gpu, num_gpus=cl.num_gpus, seq_length=inp.seq_length, gbs=inp.global_batch_size, mbs=1,
        gpus_per_node=cl.gpus_per_node, nvlink_gbps=cl.nvlink_bandwidth_gbps, scaleout_gbps=cl.scaleout_bandwidth_gbps,
        hbm_gib=cl.gpu_memory_gib, fp8_recipe=inp.fp8_recipe, **{n: getattr(im, n) for n in _CTX_IMPLEMENTATION},
        **extra,
    )


def _surviving(inp: SearchInputs, st: SearchStats, shards: list[_Shard], bounds: list[float]) -> list[tuple[int, _Shard]]:
    """(position, shard) of the shards whose model-state bound fits (the rest are counted as pruned
    with every layout under them)."""
    world = inp.cluster.num_gpus
    static_budget = inp.capacity_gib - inp.required_headroom_gib
    keep = []
    for pos, (sh, bound) in enumerate(zip(shards, bounds, strict=True)):
        n_sub = sh.layouts_under(inp)
        st.layouts_enumerated += n_sub
        if world % (sh.tp * sh.pp) == 0 and bound > static_budget:
            st.layouts_pruned_by_model_state += n_sub
        else:
            keep.append((pos, sh))
    return keep


LIKELY_MICRO_BATCH = 8
"""The largest micro-batch _likeliest_first tries (the quick space's cap): a layout that wins only with a
larger micro-batch than 1 (TP2 on Llama-3-8B with TP overlap: mbs 4 beats TP1's best) is still looked at early."""


def _likeliest_first(inp: SearchInputs, shards: list[tuple[int, _Shard]]) -> list[tuple[int, _Shard]]:
    """The shards in order of the predicted throughput of their first layout without recompute
    (physics.step_time), at micro-batch 1 or the largest up to LIKELY_MICRO_BATCH that its data-parallel
    batch allows, whichever is faster, fastest first: what a search stopped by its deadline has then
    checked are the likeliest winners (DeepSeek-V3 on 1024 GPUs, cut at 3.5 s cold: TP8 EP256 found
    this way, TP1 PP16 with full recompute in enumeration order). The order changes no result."""
    if len(shards) < 2:
        return shards
    own = [sh for _, sh in shards]
    f, world, gbs = inp.fixed, inp.cluster.num_gpus, inp.global_batch_size
    cp = np.asarray([sh.cps[0] for sh in own], dtype=np.int64)
    sp = np.asarray([sh.sps[0] for sh in own], dtype=bool)
    ov = np.asarray([_overlap(inp, sh.tp, sh.sps[0]) for sh in own], dtype=bool)
    per_dp = [gbs // max(1, world // (sh.tp * sh.pp * c)) for sh, c in zip(own, cp.tolist(), strict=True)]
    small = np.full(len(own), f.mbs or 1, dtype=np.int64)
    big = np.asarray([f.mbs or max(m for m in _divisors(max(1, n)) if m <= LIKELY_MICRO_BATCH) for n in per_dp],
                     dtype=np.int64)
    speed = np.full(len(own), -1.0)
    for mbs in (small,) if f.mbs else (small, big):
        batch = _shard_batch(inp, own, cp=cp, sequence_parallel=sp, fp8=inp.precisions[0] == "fp8",
                             micro_batch_size=mbs, tp_comm_overlap=ov)
        speed = np.maximum(speed, np.nan_to_num(step_time_arrays(batch, inp.hardware)["tokens_per_s_per_gpu"], nan=-1.0))
    return [shards[i] for i in np.argsort(-speed, kind="stable")]


def _groups(inp: SearchInputs, shards: list[tuple[int, _Shard]], limit: float) -> list[list[tuple[int, _Shard]]]:
    """Consecutive shards with about `limit` layouts under them (at least one shard each)."""
    groups: list[list[tuple[int, _Shard]]] = []
    size = limit
    for item in shards:
        if size >= limit:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item[1].layouts_under(inp)
    return groups


def _layouts(inp: SearchInputs, st: SearchStats, shards: list[tuple[int, _Shard]], scratch: Ctx) -> tuple[list[Layout], list[int]]:
    """The layouts under these shards that pass the validators' error rules, and each one's place in
    the enumeration (`scratch`: one context re-laid per layout; relayout mutates it)."""
    world = inp.cluster.num_gpus
    moe = inp.shape.is_moe
    layouts: list[Layout] = []
    places: list[int] = []
    for pos, sh in shards:
        for j, cp in enumerate(sh.cps):
            for sp, ov in ((s, o) for s in sh.sps for o in _overlap_options(inp, sh.tp, s)):
                for prec in inp.precisions:
                    errs = layout_errors(scratch.relayout(
                        tp=sh.tp, pp=sh.pp, vp_raw=sh.vp if sh.vp > 1 else None, cp=cp, ep=sh.ep,
                        etp_raw=sh.etp if moe else None, sp=sp, precision=prec, tp_comm_overlap=ov,
                        fp8_param_gather=inp.fp8_param_gather and prec == "fp8",
                        decoder_first_pipeline_num_layers=sh.split.first, decoder_last_pipeline_num_layers=sh.split.last,
                        account_for_embedding_in_pipeline_split=sh.split.embedding,
                        account_for_loss_in_pipeline_split=sh.split.loss))
                    if errs:
                        _add(st.layouts_rejected_by_rule, errs[0], 1)
                        continue
                    st.layouts_searched += 1
                    dp = max(1, world // (sh.tp * sh.pp) // cp)
                    layouts.append(Layout(sh.tp, sh.pp, sh.vp, sh.split, cp, sh.ep, sh.etp, sp and sh.tp > 1, prec, dp, ov))
                    places.append((pos << 24) + (j << 8) + (sh.sps.index(sp) << 4) + (int(not ov) << 3)
                                  + inp.precisions.index(prec))
    return layouts, places


def space_size(inp: SearchInputs) -> int:
    """Layouts `search(inp)` would enumerate, counted without checking them: what its cost grows with."""
    return sum(sh.layouts_under(inp) for sh in _shards(inp))


def search(inp: SearchInputs, deadline: Callable[[], bool] | None = None) -> SearchOutcome:
    """Enumerate, check, prune and time every candidate (see the module docstring).

    With a `deadline`, layouts are checked and scored in groups of shards (`GROUP_LAYOUTS`), the
    likeliest winners first, and the deadline is asked after each group whether the caller's time is
    up: the search then stops and counts the layouts it did not check in `stats.layouts_not_reached`
    (the first group always runs). Uncut, the outcome is the same as without a deadline: one batch.
    """
    st = SearchStats()
    shards = [sh for sh in _shards(inp) if sh.layouts_under(inp)]
    if not shards:
        return _empty([], st, math.inf, math.inf)
    bounds = _model_state_bounds(inp, shards).tolist()
    scratch = _rules_base(inp).with_layout()
    parts: list[tuple[SearchOutcome, list[int]]] = []
    alive = _surviving(inp, st, shards, bounds)
    # Without a deadline one group: the same outcome without the groups' overhead (about 10%).
    groups = (_groups(inp, alive, math.inf) if deadline is None
              else _groups(inp, _likeliest_first(inp, alive), GROUP_LAYOUTS))
    for i, group in enumerate(groups):
        if i and deadline is not None and deadline():
            st.layouts_not_reached = sum(sh.layouts_under(inp) for g in groups[i:] for _, sh in g)
            break
        layouts, places = _layouts(inp, st, group, scratch)
        if layouts:
            parts.append((_score(inp, st, layouts), places))
    return _merge(parts, st, min(bounds))


def _merge(parts: list[tuple[SearchOutcome, list[int]]], st: SearchStats, min_state: float) -> SearchOutcome:
    """The groups' outcomes as one: layouts in enumeration order, candidates in the order one batch of
    all layouts gives (option kind, then layout, then micro-batch: ties in the ranking keep that order)."""
    if not parts:
        return _empty([], st, min_state, math.inf)
    layouts: list[Layout] = []
    li = []
    for p, _ in parts:
        li.append(p.layout + len(layouts))
        layouts += p.layouts
    perm = np.argsort(np.concatenate([np.asarray(places, dtype=np.int64) for _, places in parts]), kind="stable")
    place_of = np.empty_like(perm)
    place_of[perm] = np.arange(len(perm))
    cat = lambda name: np.concatenate([getattr(p, name) for p, _ in parts])  # noqa: E731
    li_all, rc, mbs = place_of[np.concatenate(li)], cat("recompute"), cat("mbs")
    order = np.lexsort((mbs, li_all, rc))
    return SearchOutcome(
        layouts=[layouts[j] for j in perm], layout=li_all[order], mbs=mbs[order], dist_opt=cat("dist_opt")[order], recompute=rc[order],
        recompute_num_layers=cat("recompute_num_layers")[order], iteration_time_s=cat("iteration_time_s")[order],
        tokens_per_s_per_gpu=cat("tokens_per_s_per_gpu")[order], memory_total_gib=cat("memory_total_gib")[order],
        stats=st, min_model_state_gib=min_state,
        best_unconstrained_total_gib=min(p.best_unconstrained_total_gib for p, _ in parts),
    )


# ---------------------------------------------------------------------------------------------
# 2. Configurations and their memory
# ---------------------------------------------------------------------------------------------


def _layout_batch(inp: SearchInputs, layouts: list[Layout]) -> LayoutBatch:
    """One row per layout, with the per-layout stage table every configuration reuses (activation
    tables follow in _configurations, for the layouts the grid keeps)."""
    col = lambda get, kind=np.int64: np.asarray([get(lo) for lo in layouts], dtype=kind)  # noqa: E731
    b = LayoutBatch(
        inp.shape, inp.seq_length, inp.global_batch_size, _implementation(inp),
        tp=col(lambda lo: lo.tp), pp=col(lambda lo: lo.pp), dp=col(lambda lo: lo.dp), cp=col(lambda lo: lo.cp),
        ep=col(lambda lo: lo.ep), etp=col(lambda lo: lo.etp), vp=col(lambda lo: lo.vp), num_gpus=inp.cluster.num_gpus,
        sequence_parallel=col(lambda lo: lo.sp, bool), fp8=col(lambda lo: lo.precision == "fp8", bool),
        tp_comm_overlap=col(lambda lo: lo.tp_overlap, bool),
        first_stage_layers=col(lambda lo: stage_ends(inp.shape.num_layers, lo.pp, lo.split)[0]),
        last_stage_layers=col(lambda lo: stage_ends(inp.shape.num_layers, lo.pp, lo.split)[1]),
    )
    return replace(b, stages=stage_table(b))


def _activations_of(lb: LayoutBatch, li: np.ndarray, selective: bool):
    """The activation table of rows li of the layout batch, computed once for each layout they use and
    only for those (the per-layout tables are most of a cold search's cost)."""
    used, pos = np.unique(li, return_inverse=True)
    return activation_table(lb.select(used), selective).take(pos.reshape(-1))


def _configurations(lb: LayoutBatch, g: _Grid) -> LayoutBatch:
    """The grid's rows of the layout batch with their micro-batch and optimizer sharding (no recompute)."""
    li = g.li
    cols = {n: getattr(lb, n)[li] for n in ("tp", "pp", "dp", "cp", "ep", "etp", "vp", "num_gpus", "sequence_parallel",
                                            "fp8", "tp_comm_overlap", "first_stage_layers", "last_stage_layers")}
    return LayoutBatch(lb.shape, lb.seq_length, lb.global_batch_size, lb.impl, **cols, micro_batch_size=g.mbs,
                       use_distributed_optimizer=g.dist, overlap_param_gather=g.dist, stages=lb.stages.take(li),
                       activations=_activations_of(lb, li, False))


def _in_chunks(fn, b: LayoutBatch) -> np.ndarray:
    if len(b) <= _CHUNK_ROWS:
        return fn(b)
    return np.concatenate([fn(b.select(slice(i, i + _CHUNK_ROWS))) for i in range(0, len(b), _CHUNK_ROWS)])


def _total_gib(b: LayoutBatch, recompute: int, k=0, block: bool = False) -> np.ndarray:
    """memory_breakdown's total_gib of every row with this recompute option."""
    rb = replace(b, recompute=recompute, recompute_block=block, recompute_num_layers=np.asarray(k, dtype=np.int64))
    return _in_chunks(lambda x: memory_arrays(x).total_gib, rb)


@dataclass
class _Grid:
    """Live configurations (parallel arrays) and their recompute option counts."""

    li: np.ndarray  # layout index
    mbs: np.ndarray
    dist: np.ndarray
    n_block: np.ndarray  # block k values allowed
    n_unif: np.ndarray  # uniform group sizes allowed
    pc: np.ndarray  # layers per chunk of the most-loaded stage
    gcd: np.ndarray  # group sizes must divide this (every stage's chunk)

    def take(self, rows: np.ndarray) -> _Grid:
        return _Grid(*(getattr(self, f.name)[rows] for f in fields(self)))


def _grid(inp: SearchInputs, st: SearchStats, lb: LayoutBatch, layouts: list[Layout]) -> _Grid | None:
    """Layout x micro-batch (a divisor of GBS/DP) x distributed optimizer, counted and filtered by
    Megatron's interleaving rule and the distributed-optimizer dominance."""
    f, gbs, L = inp.fixed, inp.global_batch_size, inp.shape.num_layers
    mb_all = [m for m in divisors(gbs) if m <= MAX_MICRO_BATCH_SIZE] if f.mbs is None else [f.mbs]
    if inp.quick:
        mb_all = [m for m in mb_all if m <= 8] or mb_all[:1]
    fsdp = inp.implementation.use_torch_fsdp2
    dists = [False] if fsdp else ([f.dist_opt] if f.dist_opt is not None else ([True] if inp.quick else [True, False]))
    nmb, nd = len(mb_all), len(dists)
    li = np.repeat(np.arange(len(layouts)), nmb * nd)
    mbs = np.tile(np.repeat(np.asarray(mb_all, dtype=np.int64), nd), len(layouts))
    dist = np.tile(np.asarray(dists, dtype=bool), len(layouts) * nmb)
    dp_i = lb.dp[li]
    keep = (gbs % dp_i == 0) & ((gbs // dp_i) % mbs == 0)
    li, mbs, dist, dp_i = li[keep], mbs[keep], dist[keep], dp_i[keep]

    allow_none, allow_sel, allow_block, allow_uniform = _recompute_allowed(inp)
    chunks = [chunk_layers(L, lo.pp, lo.vp, lo.split) for lo in layouts]
    pc_lay = np.asarray([max(1, c[-1]) for c in chunks], dtype=np.int64)  # the largest chunk
    # Uniform recompute groups must tile every chunk (Megatron indexes past the end otherwise).
    gcd_lay = np.asarray([math.gcd(*c) for c in chunks], dtype=np.int64)
    k = f.recompute_num_layers
    zeros = np.zeros(len(layouts), dtype=np.int64)
    if k is not None:
        n_block_lay = np.where(pc_lay >= k, 1, 0) if allow_block else zeros
        n_unif_lay = np.where(gcd_lay % k == 0, 1, 0) if allow_uniform else zeros
    else:
        n_block_lay = pc_lay if allow_block else zeros
        n_unif_lay = np.asarray([len(_divisors(max(1, int(x)))) - 1 for x in gcd_lay], dtype=np.int64) if allow_uniform else zeros
    n_opts = int(allow_none) + int(allow_sel) + n_block_lay[li] + n_unif_lay[li]
    st.configurations_enumerated += int(n_opts.sum())
    # Megatron's interleaved schedule runs micro-batches in groups of PP.
    bad = (lb.vp[li] > 1) & ((gbs // (mbs * dp_i)) % lb.pp[li] != 0)
    _add(st.configurations_rejected_by_rule, "interleaved_microbatches_not_divisible_by_pp", int(n_opts[bad].sum()))
    # The distributed optimizer shards the Adam state (never more memory) and in physics.step_time moves
    # the same bytes as the all-reduce with a 1/DP-sized Adam step (never slower; a test checks
    # this), so optimizer-off variants are dominated unless pinned (or FSDP replaces the optimizer).
    dom_dist = ~dist & (f.dist_opt is None) & (not fsdp) & ~bad
    st.configurations_dominated += int(n_opts[dom_dist].sum())
    live = ~bad & ~dom_dist
    if not live.any():
        return None
    li = li[live]
    return _Grid(li, mbs[live], dist[live], n_block_lay[li], n_unif_lay[li], pc_lay[li], gcd_lay[li])


@dataclass
class _Options:
    """Per configuration: the memory of each recompute option and the smallest fitting block k /
    uniform group (inf where none fits)."""

    mem_none: np.ndarray
    mem_sel: np.ndarray
    k_block: np.ndarray
    mem_block: np.ndarray
    r_unif: np.ndarray
    mem_unif: np.ndarray
    n_unif_fit: np.ndarray  # uniform group sizes that fit


def _block_option(inp: SearchInputs, b: LayoutBatch, g: _Grid, budget: float) -> tuple[np.ndarray, np.ndarray]:
    """(smallest fitting block k, its memory); inf where no k fits."""
    inf = np.full(len(b), np.inf)
    pinned = inp.fixed.recompute_num_layers
    if not (_recompute_allowed(inp)[2] and (g.n_block > 0).any()):
        return inf, inf
    if pinned is not None:
        k_block = np.where(g.n_block > 0, float(pinned), np.inf)
    else:
        block = replace(b, recompute=RECOMPUTE_FULL, recompute_block=True)
        k_block = _in_chunks(lambda x: block_recompute_layers_to_fit(x, budget), block)
    kk = np.where(np.isfinite(k_block), np.minimum(k_block, g.pc), g.pc).astype(np.int64)
    mem_block = _total_gib(b, RECOMPUTE_FULL, kk, block=True)
    if pinned is None:
        # The closed form's ceil can land one short under rounding: step once more where so.
        retry = np.isfinite(k_block) & (mem_block > budget) & (kk < g.pc)
        if retry.any():
            kk = np.where(retry, kk + 1, kk)
            mem_block = np.where(retry, _total_gib(b, RECOMPUTE_FULL, kk, block=True), mem_block)
    ok = np.isfinite(k_block) & (mem_block <= budget)
    return np.where(ok, kk, np.inf), mem_block


def _uniform_option(inp: SearchInputs, b: LayoutBatch, g: _Grid, need: np.ndarray, budget: float) -> tuple:
    """Uniform groups, evaluated only where nothing cheaper fits (same compute as block k = chunk):
    (smallest fitting group, its memory, how many groups fit)."""
    n = len(b)
    r_unif, mem_unif, n_fit = np.full(n, np.inf), np.full(n, np.inf), np.zeros(n, dtype=np.int64)
    if not need.any():
        return r_unif, mem_unif, n_fit
    sub = np.nonzero(need)[0]
    sb = b.select(sub)
    gcd = g.gcd[sub]
    sizes = sorted({d for x in set(gcd.tolist()) for d in _divisors(max(1, int(x))) if d > 1})
    if inp.fixed.recompute_num_layers is not None:
        sizes = [inp.fixed.recompute_num_layers]
    for R in sizes:
        valid = gcd % R == 0
        if not valid.any():
            continue
        m = _total_gib(sb, RECOMPUTE_FULL, R)
        fit = valid & (m <= budget)
        n_fit[sub] += fit
        take = fit & ~np.isfinite(r_unif[sub])
        r_unif[sub] = np.where(take, R, r_unif[sub])
        mem_unif[sub] = np.where(take, m, mem_unif[sub])
    return r_unif, mem_unif, n_fit


def _options(inp: SearchInputs, lb: LayoutBatch, g: _Grid, b: LayoutBatch) -> _Options:
    """Every recompute option's memory where the configuration does not fit without recompute; where it
    does, recompute is dominated (module docstring, step 3) and only mem_none is computed, the rest
    left inf (so best_unconstrained_total_gib is exact only when nothing fits: the one case it is read)."""
    budget = inp.capacity_gib - inp.required_headroom_gib
    allow_none, allow_sel, _, _ = _recompute_allowed(inp)
    n = len(b)
    mem_none = _total_gib(b, RECOMPUTE_NONE) if allow_none else np.full(n, np.inf)
    o = _Options(mem_none, *(np.full(n, np.inf) for _ in range(5)), np.zeros(n, dtype=np.int64))
    rows = np.nonzero(~(mem_none <= budget))[0]
    if not len(rows):
        return o
    sg = g.take(rows)
    sb = b.select(rows)
    mem_sel = np.full(len(rows), np.inf)
    if allow_sel:
        mem_sel = _total_gib(replace(sb, activations_selective=_activations_of(lb, sg.li, True)), RECOMPUTE_SELECTIVE)
    k_block, mem_block = _block_option(inp, sb, sg, budget)
    need = (mem_none[rows] > budget) & (mem_sel > budget) & ~np.isfinite(k_block) & (sg.n_unif > 0)
    r_unif, mem_unif, n_fit = _uniform_option(inp, sb, sg, need, budget)
    for name, v in (("mem_sel", mem_sel), ("k_block", k_block), ("mem_block", mem_block), ("r_unif", r_unif),
                    ("mem_unif", mem_unif), ("n_unif_fit", n_fit)):
        getattr(o, name)[rows] = v
    return o


# ---------------------------------------------------------------------------------------------
# 3. Timing
# ---------------------------------------------------------------------------------------------


def _empty(layouts, st, min_state, best_seen) -> SearchOutcome:
    e = np.zeros(0)
    return SearchOutcome(layouts, e.astype(int), e.astype(int), e.astype(bool), e.astype(int), e, e, e, e, st,
                         min_state, best_seen)


def _account(inp: SearchInputs, st: SearchStats, g: _Grid, o: _Options) -> tuple:
    """Count each option: dominated when a cheaper-or-equal-compute option of its row fits, timed when
    it is the cheapest fitting one of its kind, over memory otherwise. Returns the timed masks."""
    budget = inp.capacity_gib - inp.required_headroom_gib
    allow_none, allow_sel, _, _ = _recompute_allowed(inp)
    fits_none, fits_sel = o.mem_none <= budget, o.mem_sel <= budget
    fits_block, fits_unif = np.isfinite(o.k_block), np.isfinite(o.r_unif)
    t_none, t_sel = fits_none, fits_sel & ~fits_none
    t_block = fits_block & ~fits_none
    timed = t_none.astype(np.int64) + t_sel + t_block + fits_unif
    n_opts_live = int(allow_none) + int(allow_sel) + g.n_block + g.n_unif
    dominated = np.where(fits_none, n_opts_live - 1, 0)
    k_fit = np.where(fits_block, o.k_block, 0)
    dominated = dominated + np.where(~fits_none & fits_block, g.n_block - k_fit, 0)
    dominated = dominated + np.where(~fits_none & (fits_sel | fits_block), g.n_unif, 0)
    dominated = dominated + np.where(fits_unif, o.n_unif_fit - 1, 0)
    st.configurations_timed += int(timed.sum())
    st.configurations_dominated += int(dominated.sum())
    st.configurations_over_memory += int((n_opts_live - timed - dominated).sum())
    return t_none, t_sel, t_block, fits_unif


def _score(inp: SearchInputs, st: SearchStats, layouts: list[Layout]) -> SearchOutcome:
    """One group's timed candidates (its model-state bound is filled in by _merge)."""
    min_state = math.inf
    lb = _layout_batch(inp, layouts)
    g = _grid(inp, st, lb, layouts)
    if g is None:
        return _empty(layouts, st, min_state, math.inf)
    b = _configurations(lb, g)
    o = _options(inp, lb, g, b)
    best_seen = float(np.min(np.minimum(np.minimum(np.minimum(o.mem_none, o.mem_sel), o.mem_block), o.mem_unif)))
    masks = _account(inp, st, g, o)
    parts = []
    zeros = np.zeros(len(b))
    for mask, code, kval, mem in zip(masks, (RC_NONE, RC_SELECTIVE, RC_BLOCK, RC_UNIFORM),
                                     (zeros, zeros, o.k_block, o.r_unif), (o.mem_none, o.mem_sel, o.mem_block, o.mem_unif),
                                     strict=True):
        idx = np.nonzero(mask)[0]
        if len(idx):
            parts.append((idx, np.full(len(idx), code), kval[idx], mem[idx]))
    if not parts:
        return _empty(layouts, st, min_state, best_seen)
    rows, rc, rk, mem = (np.concatenate([p[i] for p in parts]) for i in range(4))
    timed = replace(b.select(rows), recompute=np.where(rc == RC_NONE, RECOMPUTE_NONE, np.where(rc == RC_SELECTIVE, RECOMPUTE_SELECTIVE, RECOMPUTE_FULL)),
                    recompute_block=rc == RC_BLOCK, recompute_num_layers=rk.astype(np.int64))
    r = step_time_arrays(timed, inp.hardware)
    return SearchOutcome(
        layouts=layouts, layout=g.li[rows], mbs=g.mbs[rows], dist_opt=g.dist[rows], recompute=rc, recompute_num_layers=rk,
        iteration_time_s=np.asarray(r["iteration_time_s"], dtype=np.float64),
        tokens_per_s_per_gpu=np.asarray(r["tokens_per_s_per_gpu"], dtype=np.float64), memory_total_gib=mem, stats=st,
        min_model_state_gib=min_state, best_unconstrained_total_gib=best_seen,
    )
