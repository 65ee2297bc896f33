"""The layout search behind recommend_parallelism: enumerate, check, prune, score in arrays.

How one search runs (`search(inputs)`):

1. Layouts. Every (TP, PP, uneven split, VP, CP, EP, ETP, SP, precision) the constraints allow,
   with TP*PP*CP dividing the world size by construction (DP is derived; pinned values are tried
   even when they do not, so the validators can say why). PP that does not divide the layers is
   searched with uneven first/last stages (`uneven_splits`). A layout is counted once, under the
   first check it fails, in this order:
   - model-state bound: the bf16 weights + gradient buffer + Adam state of the most-loaded
     pipeline rank, with the distributed optimizer sharding as far as the layout allows, plus the
     CUDA context, already exceed the usable memory. It depends only on (TP, PP, split, VP, EP,
     ETP), so one check skips every CP, SP and precision under it (`layouts_pruned_by_model_state`);
   - the validators' error rules through their fast path `validators.layout_errors` (micro-batch
     1, no recompute), first failing code in registry order;
   - Megatron rules the validators report only as warnings but Megatron enforces
     (`RECOMMENDER_RULES`).
2. Configurations. Each surviving layout x micro-batch size (divisors of GBS/DP) x distributed
   optimizer on/off x recompute option (none; selective = Megatron's default core_attn; full
   'block' with k = 1..layers-per-chunk; full 'uniform' with every group size that tiles the
   chunks). Memory of all of them is computed at once by `_memory_total_gib`, a numpy replica of
   `physics.memory.memory_breakdown` built from that module's own per-layer functions (a test keeps
   the two equal). The block sweep is solved in closed form: memory falls linearly with k, so the
   smallest k that fits is computed, not searched.
3. Timing. Recomputing more never runs faster (`physics.step_time` adds the rerun forward and at most
   hides the same amount of DP communication behind it), so per (layout, micro-batch, optimizer)
   only the fastest-possible fitting options are timed: no recompute if it fits, otherwise
   selective and the smallest fitting block k, otherwise the smallest fitting uniform group.
   Likewise the distributed optimizer never needs more memory and is never slower in physics.step_time,
   so optimizer-off variants are dominated unless pinned (tests check both premises). The rest
   are counted as dominated. Timing is one `physics.step_time.step_time_arrays` call per precision over
   all of them.

Every count lands in `SearchStats`; configurations_enumerated = rejected + over memory +
dominated + timed, and layouts likewise. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

import numpy as np

from mcore_advisor.knowledge.hardware import GpuSpec
from mcore_advisor.physics.memory import (
    CUDA_CONTEXT_GIB,
    GIB,
    MISC_ALLOCATED_BYTES,
    NCCL_PER_COMMUNICATOR_GIB,
    ActivationOptions,
    _is_unfused,
    _stage_layers,
    cross_entropy_peak_bytes_per_logit,
    fragmentation_fraction,
    layer_activation_terms,
    layer_backward_working_bytes,
    rank_params,
    te_dummy_wgrad_bytes,
)
from mcore_advisor.physics.step_time import HardwareParams, step_time_arrays
from mcore_advisor.schemas import ClusterSpec, ImplementationSpec, ModelShape, layers_per_stage
from mcore_advisor.validators import layout_errors

# Recompute option codes in the candidate table.
RC_NONE, RC_SELECTIVE, RC_BLOCK, RC_UNIFORM = 0, 1, 2, 3

# Rejections the recommender makes beyond the validators' rules (code -> reason); none at present:
# MoE with TP > 1 and no SP is the validators' error expert_and_tensor_parallel_without_sp.
RECOMMENDER_RULES: dict[str, str] = {}
_NSLOTS = 4  # pipeline ranks memory_breakdown evaluates
_COLUMNS = (
    "tp", "pp", "vp", "cp", "ep", "etp", "sp", "dp", "edp", "fp8", "non_pt", "V",
    "dl", "ml", "dw1", "dw2", "mw1", "mw2", "dl_sel", "ml_sel", "dw1_sel", "dw2_sel", "mw1_sel", "mw2_sel",
    *(f"{name}{i}" for i in range(_NSLOTS) for name in ("r", "nl", "nd", "nm", "dp", "ep", "f8", "first", "last", "db")),
)


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
    capacity_gib: float = 80.0
    required_headroom_gib: float = 0.0
    fixed: Fixed = field(default_factory=Fixed)
    max_tp: int | None = None
    allow_recompute: bool = True
    quick: bool = False  # lower fidelity: TP within a node, ETP 1 or TP, CP a power of two, SP on with TP > 1, micro-batch <= 8, distributed optimizer on


@dataclass
class SearchStats:
    """Counts of one search (see the module docstring for the order of checks)."""

    layouts_enumerated: int = 0
    layouts_pruned_by_model_state: int = 0
    layouts_rejected_by_rule: dict[str, int] = field(default_factory=dict)
    layouts_searched: int = 0
    configurations_enumerated: int = 0
    configurations_rejected_by_rule: dict[str, int] = field(default_factory=dict)
    configurations_over_memory: int = 0
    configurations_dominated: int = 0
    configurations_timed: int = 0


@dataclass
class Layout:
    tp: int
    pp: int
    vp: int
    first: int | None
    last: int | None
    cp: int
    ep: int
    etp: int
    sp: bool
    precision: str
    dp: int


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


def uneven_splits(num_layers: int, pp: int) -> list[tuple[int | None, int | None, tuple[int, ...]]]:
    """Uneven (first, last, VPs) stage splits to search when num_layers does not divide by PP.

    Every split keeps the most-loaded stage at ceil(L / PP) layers (what physics.step_time times) and the
    middle stages equal (Megatron's --decoder-first/last-pipeline-num-layers); the first and last
    stages are lighter, as they also hold the embedding and the loss (Llama-3.1-405B: 126 layers on
    PP16 = 7 + 14 x 8 + 7). Interleaving needs every stage divisible by VP, so for each VP the most
    balanced split that allows it is kept: symmetric first, then a lighter first stage.
    """
    if pp == 2:
        first = num_layers // 2
        return [(first, None, _vps((first, num_layers - first)))]
    m = -(-num_layers // pp)
    rest = num_layers - (pp - 2) * m  # layers left for the first and last stages
    cands: list[tuple[tuple, int | None, int | None, tuple[int, ...]]] = []
    for f in range(max(1, rest - m), min(m, rest - 1) + 1):
        last = rest - f
        rank = (abs(f - last), last < f)  # symmetric, then lighter first
        cands.append((rank, f, last, (f, m, last)))
    f1 = num_layers - (pp - 1) * m
    if 1 <= f1 < m:
        cands.append(((m - f1, False), f1, None, (f1, m)))
    cands.sort(key=lambda c: c[0])
    out: list[tuple[int | None, int | None, tuple[int, ...]]] = []
    used: set[int] = set()
    for _, first, last, sizes in cands:
        vps = tuple(v for v in _vps(sizes) if v not in used)
        if vps:
            used.update(vps)
            out.append((first, last, vps))
    return out


def _vps(stage_sizes: tuple[int, ...]) -> tuple[int, ...]:
    g = 0
    for x in stage_sizes:
        g = math.gcd(g, x)
    return _divisors(max(1, g))


def _add(d: dict[str, int], key: str, n: int) -> None:
    if n:
        d[key] = d.get(key, 0) + n


# ---------------------------------------------------------------------------------------------
# Per-layout pieces (memoised: many layouts share them)
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=65536)
def _slots(shape: ModelShape, seq: int, tp: int, pp: int, vp: int, ep: int, etp: int,
           first_layers: int | None = None, last_layers: int | None = None) -> tuple[tuple, ...]:
    """The pipeline ranks memory_breakdown evaluates (first, second, second-to-last, last), padded to four.

    Each: (rank, num_layers, dense_layers, moe_layers, dense_params, expert_params, fp8_params, first, last,
    TE dummy weight-gradient bytes with gradient-accumulation fusion).
    """
    out = []
    for r in sorted({0, min(1, pp - 1), max(0, pp - 2), pp - 1}):
        layers = _stage_layers(shape.num_layers, pp, vp, r, first_layers, last_layers)
        first, last = r == 0, r == pp - 1
        rp = rank_params(shape, layers, first=first, last=last, tp=tp, ep=ep, etp=etp, seq_length=seq)
        n_moe = sum(shape.moe_layer_pattern[i] for i in layers) if shape.is_moe else 0
        dummies = te_dummy_wgrad_bytes(shape, tp, etp, has_dense=len(layers) > n_moe, has_moe=n_moe > 0,
                                       output_vocab=shape.padded_vocab_size(tp) if last else None)
        out.append((r, len(layers), len(layers) - n_moe, n_moe, rp.dense, rp.expert, rp.fp8_eligible, first, last, dummies))
    while len(out) < _NSLOTS:
        out.append(out[-1])
    return tuple(out)


@lru_cache(maxsize=65536)
def _act(shape: ModelShape, seq: int, tp: int, cp: int, sp: bool, ep: int, etp: int, fp8: bool, impl: str,
         unfused: bool, selective: bool) -> tuple[float, float, float, float, float, float]:
    """(dense layer, MoE layer) saved bytes per micro-batch of 1, and their backward working sets at
    micro-batch 1 and 2 (the working set is affine in the micro-batch), as memory_breakdown uses them."""
    o = ActivationOptions(
        tp=tp, cp=cp, sequence_parallel=sp, transformer_impl=impl, unfused_attention=unfused, fp8=fp8,
        fused_activation=True, recompute_modules=frozenset({"core_attn"} if selective else ()),
        ep=ep, etp=etp,
    )
    res = []
    for moe in (False, True) if shape.is_moe else (False,):
        t1 = layer_activation_terms(shape, seq, 1, moe, o)
        t2 = layer_activation_terms(shape, seq, 2, moe, o)
        w1 = layer_backward_working_bytes(shape, seq, 1, moe, o, t1)
        w2 = layer_backward_working_bytes(shape, seq, 2, moe, o, t2)
        res.append((sum(t1.values()), w1, w2))
    if len(res) == 1:
        res.append(res[0])
    (dl, dw1, dw2), (ml, mw1, mw2) = res
    return dl, ml, dw1, dw2, mw1, mw2


# ---------------------------------------------------------------------------------------------
# Vectorised memory (a replica of physics.memory.memory_breakdown's assembly)
# ---------------------------------------------------------------------------------------------


class _Table:
    """Per-configuration columns gathered from the per-layout arrays."""

    def __init__(self, lay: dict[str, np.ndarray], idx: np.ndarray, mbs: np.ndarray, dist: np.ndarray):
        self.g = {k: v[idx] for k, v in lay.items()}
        self.b = mbs.astype(np.float64)
        self.dist = dist
        self.n = len(idx)


def _memory_total_gib(inp: SearchInputs, t: _Table, kind: int, k: np.ndarray | None = None,
                      closed_form: bool = False):
    """total_gib of memory_breakdown for every row (kind = RC_*; k = block layers or uniform group).

    With closed_form (kind RC_BLOCK), returns instead the smallest block k per row that fits the
    budget (inf where no k does), solving peak(k) = C - k*D on every rank.
    """
    shape, im = inp.shape, inp.implementation
    g, b = t.g, t.b
    h = float(shape.hidden_size)
    s = float(inp.seq_length)
    tp, cp, pp, vp = g["tp"], g["cp"], g["pp"], g["vp"]
    sp_div = np.where(g["sp"] > 0, tp, 1.0)
    tok = s / cp * b
    full = kind in (RC_BLOCK, RC_UNIFORM)
    sel = kind == RC_SELECTIVE
    # Saved activations are linear in the micro-batch (every term scales with its tokens).
    dl = g["dl_sel" if sel else "dl"] * b
    ml = g["ml_sel" if sel else "ml"] * b
    sfx = "_sel" if sel else ""
    # The backward working set is affine in the micro-batch (the local spec's weight-gradient
    # tensor is the constant): interpolate from micro-batch 1 and 2.
    dw = g["dw1" + sfx] + (b - 1) * (g["dw2" + sfx] - g["dw1" + sfx])
    mw = g["mw1" + sfx] + (b - 1) * (g["mw2" + sfx] - g["mw1" + sfx])
    ckpt = 2.0 * h * tok / sp_div
    grad_bytes = 4.0 if im.grad_reduce_in_fp32 else 2.0
    fp8 = g["fp8"] > 0
    dp_opt = g["dp"] * cp
    edp = np.maximum(1.0, g["edp"])
    local = im.transformer_impl == "local"
    fused_dummies = im.gradient_accumulation_fusion and not local and not im.use_torch_fsdp2
    V = g["V"]
    M = np.maximum(1.0, np.floor(inp.global_batch_size / (b * g["dp"])))
    unfused = _is_unfused(im.attention_backend)
    # Loss peak per logit as memory_breakdown takes it (the plan's --cross-entropy-fusion-impl).
    ce_impl = im.cross_entropy_fusion_impl
    te_ce = im.cross_entropy_loss_fusion and ce_impl == "te"
    mx = 1.0 / 16 if inp.fp8_recipe == "mxfp8" else 0.0
    frag = np.where(
        (pp > 1) | full,
        fragmentation_fraction(expandable_segments=im.expandable_segments, pipelined_or_full_recompute=True),
        fragmentation_fraction(expandable_segments=im.expandable_segments, pipelined_or_full_recompute=False),
    )
    budget_gib = inp.capacity_gib - inp.required_headroom_gib - g["non_pt"]
    peak_max = budget_gib * GIB / (1.0 + frag)

    peak = np.zeros(t.n)
    kmin = np.ones(t.n)
    possible = np.ones(t.n, dtype=bool)
    for si in range(_NSLOTS):
        r = g[f"r{si}"]
        nl, nd, nm = g[f"nl{si}"], g[f"nd{si}"], g[f"nm{si}"]
        dense_p, exp_p, fp8e = g[f"dp{si}"], g[f"ep{si}"], g[f"f8{si}"]
        first, last = g[f"first{si}"] > 0, g[f"last{si}"] > 0
        n_params = dense_p + exp_p
        # bf16 weights; TE caches an FP8 copy and its transpose of every linear weight
        # (--fp8-param-gather, which replaces them, is never chosen by the search).
        weights = 2.0 * n_params + np.where(fp8, 2.0 * fp8e * (1.0 + mx), 0.0)
        grads = grad_bytes * n_params
        optim = np.where(t.dist, 12.0 * dense_p / dp_opt + 12.0 * exp_p / edp, 12.0 * n_params)
        opt_held = np.where(t.dist, dense_p / dp_opt + exp_p / edp, n_params)
        step_tmp = (4.0 * opt_held if local else 0.0) + (0.0 if im.grad_reduce_in_fp32 else 4.0 * opt_held)
        per_mb_full = nd * dl + nm * ml
        work = np.maximum(np.where(nd > 0, dw, 0.0), np.where(nm > 0, mw, 0.0))
        first_extra = np.where(first, 16.0 * tok, 0.0)
        infl = np.where(
            pp <= 1, 1.0,
            np.where(vp > 1, np.minimum(2 * (pp - r - 1) + (vp - 1) * pp + 1, M * vp) / vp, np.minimum(pp - r, M)),
        )
        # last-stage extras: final norm input + output-layer input, labels/mask; logits/loss transient
        last_acts = np.where(last, 2.0 * h * tok / sp_div * 2 + 12.0 * tok, 0.0)
        logits = 2.0 * V * tok / tp
        ce_peak = cross_entropy_peak_bytes_per_logit(im.cross_entropy_loss_fusion, ce_impl) / 2.0 * logits
        # bf16 output-layer weight gradient before main_grad.add_ (TE's cached dummy when fused)
        out_wgrad = 0.0 if fused_dummies else 2.0 * V * h / tp
        bwd_peak = logits + out_wgrad + 2.0 * h * tok
        mtp = shape.mtp_num_layers
        heads_extra = (mtp * (logits if te_ce else 2.0 * logits)) if mtp else 0.0
        last_transient = np.maximum(ce_peak + heads_extra, bwd_peak)
        if mtp:
            last_acts = last_acts + np.where(last, mtp * (ml if (shape.is_moe and shape.moe_layer_pattern[-1]) else dl), 0.0)
        buffers = float(MISC_ALLOCATED_BYTES)
        if fused_dummies:
            buffers = buffers + g[f"db{si}"]
        if local:
            gbuf = 0.0
            if unfused:
                gbuf = 2.0 * (shape.num_attention_heads / tp) * b * (s / cp) * s
            gbuf = np.where(g["sp"] > 0, np.maximum(gbuf, 2.0 * h * tok), gbuf)
            buffers = buffers + gbuf
        static = weights + grads + optim + buffers
        nl_safe = np.maximum(1.0, nl)
        per_layer = per_mb_full / nl_safe
        pc = np.maximum(1.0, np.floor(nl / vp))
        if full:
            if kind == RC_BLOCK:
                ws = per_layer + work
                if closed_form:
                    # peak(k) = C - k * D for k <= pc on this rank (fb phase); the step phase is fixed.
                    trans = np.where(last, np.maximum(ws, last_transient), ws)
                    C = static + infl * (vp * pc * per_layer + first_extra) + last_acts + trans
                    D = infl * vp * (per_layer - ckpt)
                    need = np.where(D > 0, np.ceil((C - peak_max) / np.where(D > 0, D, 1.0)), np.where(C <= peak_max, 0.0, np.inf))
                    need = np.maximum(need, 1.0)
                    ok = (need <= pc) & (static + step_tmp <= peak_max)
                    possible &= ok
                    kmin = np.maximum(kmin, need)
                    continue
                rec = np.minimum(k, pc)
                saved = vp * (rec * ckpt + (pc - rec) * per_layer)
            else:
                groups = np.ceil(pc / k)
                saved = vp * groups * ckpt
                ws = per_layer * np.minimum(k, pc) + work
            per_mb = saved
            work = ws
        else:
            per_mb = per_mb_full
        acts = infl * (per_mb + first_extra) + last_acts
        transient = np.where(last, np.maximum(work, last_transient), work)
        peak = np.maximum(peak, np.maximum(static + acts + transient, static + step_tmp))
    if closed_form:
        return np.where(possible, kmin, np.inf)
    return peak * (1.0 + frag) / GIB + g["non_pt"]


# ---------------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------------


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
    return none, sel, block, uniform


def search(inp: SearchInputs) -> SearchOutcome:
    """Enumerate, check, prune and time every candidate (see the module docstring)."""
    shape, f, im = inp.shape, inp.fixed, inp.implementation
    st = SearchStats()
    L = shape.num_layers
    world = inp.cluster.num_gpus
    gpn = inp.hardware.gpus_per_node
    seq, gbs = inp.seq_length, inp.global_batch_size
    E = shape.num_experts or 0
    moe = shape.is_moe
    max_tp = inp.max_tp or world
    if inp.quick:
        max_tp = min(max_tp, gpn)
    unfused = _is_unfused(im.attention_backend)
    static_budget = inp.capacity_gib - inp.required_headroom_gib - CUDA_CONTEXT_GIB

    common_rules = dict(
        fp8_recipe=inp.fp8_recipe, transformer_impl=im.transformer_impl, attention_backend=im.attention_backend,
        moe_token_dispatcher_type=im.moe_token_dispatcher_type, moe_grouped_gemm=im.moe_grouped_gemm,
        use_torch_fsdp2=im.use_torch_fsdp2, nvlink_bandwidth_gbps=inp.cluster.nvlink_bandwidth_gbps,
        scaleout_bandwidth_gbps=inp.cluster.scaleout_bandwidth_gbps, gpu_memory_gib=inp.cluster.gpu_memory_gib,
    )
    grad_bytes = 4.0 if im.grad_reduce_in_fp32 else 2.0
    frag_pp = fragmentation_fraction(expandable_segments=im.expandable_segments, pipelined_or_full_recompute=True)
    frag_1 = fragmentation_fraction(expandable_segments=im.expandable_segments, pipelined_or_full_recompute=False)

    layouts: list[Layout] = []
    rows: list[list] = []
    min_state = math.inf

    def record(lay: Layout, slots, act_none, act_sel, edp: int, non_pt: float):
        layouts.append(lay)
        row = [lay.tp, lay.pp, lay.vp, lay.cp, lay.ep, lay.etp, 1.0 if lay.sp else 0.0, lay.dp, edp,
               1.0 if lay.precision == "fp8" else 0.0, non_pt, float(shape.padded_vocab_size(lay.tp)),
               *act_none, *act_sel]
        for sl in slots:
            row.extend(sl)
        rows.append(row)

    # Pinned values are tried even when they do not divide the world size, so the validators say why.
    tps = [f.tp] if f.tp is not None else [t for t in divisors(world) if t <= max_tp]
    for tp in tps:
        sps = [False] if tp == 1 else ([True] if inp.quick else [True, False])
        if f.sp is not None and tp > 1:
            sps = [f.sp]
        for pp in ([f.pp] if f.pp is not None else [p for p in divisors(max(1, world // tp)) if p <= L]):
            if pp == 1:
                splits = [(None, None, (1,))]
            elif f.first is not None or f.last is not None:
                try:
                    sizes = tuple(layers_per_stage(L, pp, f.first, f.last))
                except ValueError:
                    sizes = (1,)  # the validators reject it with the reason
                splits = [(f.first, f.last, _vps(sizes))]
            elif L % pp == 0:
                splits = [(None, None, _divisors(L // pp))]
            else:
                splits = uneven_splits(L, pp) or [(None, None, (1,))]  # none exists: the validators say so
            rest = max(1, world // (tp * pp))
            cps = [f.cp] if f.cp is not None else divisors(rest)
            if inp.quick and f.cp is None:
                cps = [c for c in cps if c & (c - 1) == 0]
            if f.dp is not None:
                cps = [c for c in cps if rest // c == f.dp]
            if moe:
                eps = [f.ep] if f.ep is not None else divisors(E)
                etps = [f.etp] if f.etp is not None else [e for e in divisors(gpn) if e <= max_tp]
                if f.etp is None and tp not in etps and tp <= max_tp:
                    etps.append(tp)
                if inp.quick and f.etp is None:
                    etps = [e for e in etps if e in (1, tp)]
            else:
                eps = [1] if f.ep in (None, 1) else [f.ep]
                etps = [tp]
            pairs = [(first, last, vp) for first, last, vps in splits for vp in vps
                     if f.vp is None or vp == f.vp or (f.vp == 1 and vp == 1)]
            if f.vp is not None and f.vp > 1 and pp > 1 and not pairs:
                pairs = [(splits[0][0], splits[0][1], f.vp)]  # the validators say why it cannot be
            for ep in eps:
                for etp in etps:
                    n_sub = len(pairs) * len(cps) * len(sps) * len(inp.precisions)
                    if not n_sub:
                        continue
                    # Model-state bound: weights + grads + optimizer (sharded over DP*CP = world/(TP*PP))
                    # on the most-loaded rank, the same for every CP and SP under it.
                    dp_opt = max(1, world // (tp * pp))
                    edp = max(1, world // (etp * ep * pp))
                    divides = world % (tp * pp) == 0
                    frag = frag_pp if pp > 1 else frag_1
                    st.layouts_enumerated += n_sub
                    for first, last, vp in pairs:
                        sl = _slots(shape, seq, tp, pp, vp, ep, etp, first, last)
                        state = max((2.0 + grad_bytes) * (x[4] + x[5]) + 12.0 * x[4] / dp_opt + 12.0 * x[5] / edp for x in sl)
                        state_gib = state * (1 + frag) / GIB
                        min_state = min(min_state, state_gib + CUDA_CONTEXT_GIB)
                        if divides and state_gib > static_budget:
                            st.layouts_pruned_by_model_state += n_sub // len(pairs)
                            continue
                        for cp in cps:
                            dp = max(1, rest // cp)
                            for sp in sps:
                                for prec in inp.precisions:
                                    errs = layout_errors(
                                        shape, inp.gpu, world, inp.cluster.gpus_per_node, seq, gbs, 1, tp, pp,
                                        vp if vp > 1 else None, cp, ep, etp if moe else None, sp,
                                        precision=prec, decoder_first_pipeline_num_layers=first,
                                        decoder_last_pipeline_num_layers=last, **common_rules,
                                    )
                                    if errs:
                                        _add(st.layouts_rejected_by_rule, errs[0], 1)
                                        continue
                                    st.layouts_searched += 1
                                    fp8 = prec == "fp8"
                                    sp_eff = sp and tp > 1
                                    a0 = _act(shape, seq, tp, cp, sp_eff, ep, etp, fp8, im.transformer_impl, unfused, False)
                                    a1 = _act(shape, seq, tp, cp, sp_eff, ep, etp, fp8, im.transformer_impl, unfused, True)
                                    comms = sum(1 for size in (tp, pp, cp, dp, ep, etp if moe else 1) if size > 1) + (1 if pp > 1 else 0)
                                    non_pt = CUDA_CONTEXT_GIB + NCCL_PER_COMMUNICATOR_GIB * comms
                                    record(Layout(tp, pp, vp, first, last, cp, ep, etp, sp_eff, prec, dp),
                                           sl, a0, a1, edp, non_pt)
    cols = {}
    if rows:
        table = np.asarray(rows, dtype=np.float64)
        cols = {name: table[:, i] for i, name in enumerate(_COLUMNS)}
    return _score(inp, st, layouts, cols, min_state)


def _empty(layouts, st, min_state, best_seen) -> SearchOutcome:
    e = np.zeros(0)
    return SearchOutcome(layouts, e.astype(int), e.astype(int), e.astype(bool), e.astype(int), e, e, e, e, st,
                         min_state, best_seen)


def _score(inp: SearchInputs, st: SearchStats, layouts: list[Layout], cols: dict[str, np.ndarray],
           min_state: float) -> SearchOutcome:
    f = inp.fixed
    L = inp.shape.num_layers
    gbs = inp.global_batch_size
    if not layouts:
        return _empty(layouts, st, min_state, math.inf)
    n_lay = len(layouts)

    # Configuration grid: layout x micro-batch (a divisor of GBS/DP) x distributed optimizer.
    mb_all = divisors(gbs) if f.mbs is None else [f.mbs]
    if inp.quick:
        mb_all = [m for m in mb_all if m <= 8] or mb_all[:1]
    dists = [f.dist_opt] if f.dist_opt is not None else ([True] if inp.quick else [True, False])
    nmb, nd = len(mb_all), len(dists)
    li = np.repeat(np.arange(n_lay), nmb * nd)
    mbs = np.tile(np.repeat(np.asarray(mb_all, dtype=np.int64), nd), n_lay)
    dist = np.tile(np.asarray(dists, dtype=bool), n_lay * nmb)
    dp_i = cols["dp"].astype(np.int64)[li]
    keep = (gbs % dp_i == 0) & ((gbs // dp_i) % mbs == 0)
    li, mbs, dist = li[keep], mbs[keep], dist[keep]
    n = len(li)

    allow_none, allow_sel, allow_block, allow_uniform = _recompute_allowed(inp)
    nl_max = np.max([cols[f"nl{i}"] for i in range(_NSLOTS)], axis=0)
    pc_lay = np.maximum(1.0, np.floor(nl_max / cols["vp"]))
    # Uniform recompute groups must tile every stage's chunk (Megatron indexes past the end otherwise).
    gcd_lay = np.asarray([math.gcd(*layers_per_stage(L, lo.pp, lo.first, lo.last)) // lo.vp if lo.pp > 1 else L
                          for lo in layouts], dtype=np.int64)
    nu_lay = np.asarray([len(_divisors(max(1, int(x)))) - 1 for x in gcd_lay], dtype=np.int64)
    pinned_k = f.recompute_num_layers
    if pinned_k is not None:
        n_block_lay = np.where(pc_lay >= pinned_k, 1, 0) if allow_block else np.zeros(n_lay, dtype=np.int64)
        n_unif_lay = np.where(gcd_lay % pinned_k == 0, 1, 0) if allow_uniform else np.zeros(n_lay, dtype=np.int64)
    else:
        n_block_lay = pc_lay.astype(np.int64) if allow_block else np.zeros(n_lay, dtype=np.int64)
        n_unif_lay = nu_lay if allow_uniform else np.zeros(n_lay, dtype=np.int64)
    n_block, n_unif = n_block_lay[li], n_unif_lay[li]
    n_opts = int(allow_none) + int(allow_sel) + n_block + n_unif
    st.configurations_enumerated += int(n_opts.sum())

    # Megatron's interleaved schedule runs micro-batches in groups of PP.
    vp_i, pp_i = cols["vp"][li], cols["pp"][li].astype(np.int64)
    M = gbs // (mbs * dp_i[keep])
    bad = (vp_i > 1) & (M % pp_i != 0)
    _add(st.configurations_rejected_by_rule, "interleaved_microbatches_not_divisible_by_pp", int(n_opts[bad].sum()))
    # The distributed optimizer shards the Adam state (never more memory) and in physics.step_time moves
    # the same bytes as the all-reduce with a 1/DP-sized Adam step (never slower; a test checks
    # this), so optimizer-off variants are dominated unless pinned.
    dom_dist = ~dist & (f.dist_opt is None) & ~bad
    st.configurations_dominated += int(n_opts[dom_dist].sum())
    live = ~bad & ~dom_dist
    li, mbs, dist, n_block, n_unif = li[live], mbs[live], dist[live], n_block[live], n_unif[live]
    n = len(li)
    if not n:
        return _empty(layouts, st, min_state, math.inf)
    t = _Table(cols, li, mbs, dist)
    pc = pc_lay[li]
    gcd_i = gcd_lay[li]
    budget = inp.capacity_gib - inp.required_headroom_gib

    inf = np.full(n, np.inf)
    mem_none = _memory_total_gib(inp, t, RC_NONE) if allow_none else inf
    mem_sel = _memory_total_gib(inp, t, RC_SELECTIVE) if allow_sel else inf
    fits_none = mem_none <= budget
    fits_sel = mem_sel <= budget
    # Block: the smallest k that fits (closed form), then its exact memory.
    k_block = inf
    mem_block = inf
    if allow_block and (n_block > 0).any():
        if pinned_k is not None:
            k_block = np.where(n_block > 0, float(pinned_k), np.inf)
        else:
            k_block = _memory_total_gib(inp, t, RC_BLOCK, closed_form=True)
        kk = np.where(np.isfinite(k_block), np.minimum(k_block, pc), pc)
        mem_block = _memory_total_gib(inp, t, RC_BLOCK, k=kk)
        if pinned_k is None:
            # The closed form's ceil can land one short under rounding: step once more where so.
            retry = np.isfinite(k_block) & (mem_block > budget) & (kk < pc)
            if retry.any():
                kk = np.where(retry, kk + 1, kk)
                mem_block = np.where(retry, _memory_total_gib(inp, t, RC_BLOCK, k=kk), mem_block)
        ok = np.isfinite(k_block) & (mem_block <= budget)
        k_block = np.where(ok, kk, np.inf)
    fits_block = np.isfinite(k_block)
    best_seen = float(np.min(np.minimum(np.minimum(mem_none, mem_sel), mem_block)))

    # Uniform groups are evaluated only where nothing cheaper fits (same compute as block k = chunk).
    r_unif = np.full(n, np.inf)
    mem_unif = np.full(n, np.inf)
    n_unif_fit = np.zeros(n, dtype=np.int64)
    need = ~fits_none & ~fits_sel & ~fits_block & (n_unif > 0)
    if need.any():
        sub = np.nonzero(need)[0]
        ts = _Table(cols, li[sub], mbs[sub], dist[sub])
        sizes = sorted({d for x in set(gcd_i[sub].tolist()) for d in _divisors(max(1, int(x))) if d > 1})
        if pinned_k is not None:
            sizes = [pinned_k]
        for R in sizes:
            valid = gcd_i[sub] % R == 0
            if not valid.any():
                continue
            m = _memory_total_gib(inp, ts, RC_UNIFORM, k=np.full(len(sub), float(R)))
            fit = valid & (m <= budget)
            n_unif_fit[sub] += fit
            take = fit & ~np.isfinite(r_unif[sub])
            r_unif[sub] = np.where(take, R, r_unif[sub])
            mem_unif[sub] = np.where(take, m, mem_unif[sub])
        best_seen = min(best_seen, float(np.min(mem_unif)))
    fits_unif = np.isfinite(r_unif)

    # Accounting: an option is dominated when a cheaper-or-equal-compute option of its row fits,
    # timed when it is the cheapest fitting one of its kind, over memory otherwise.
    t_none, t_sel = fits_none, fits_sel & ~fits_none
    t_block = fits_block & ~fits_none
    t_unif = fits_unif
    timed = t_none.astype(np.int64) + t_sel + t_block + t_unif
    n_opts_live = int(allow_none) + int(allow_sel) + n_block + n_unif
    dominated = np.where(fits_none, n_opts_live - 1, 0)
    k_fit = np.where(fits_block, k_block, 0)
    dominated = dominated + np.where(~fits_none & fits_block, n_block - k_fit, 0)
    dominated = dominated + np.where(~fits_none & (fits_sel | fits_block), n_unif, 0)
    dominated = dominated + np.where(fits_unif, n_unif_fit - 1, 0)
    st.configurations_timed += int(timed.sum())
    st.configurations_dominated += int(dominated.sum())
    st.configurations_over_memory += int((n_opts_live - timed - dominated).sum())

    parts = []
    for mask, code, kval, mem in (
        (t_none, RC_NONE, np.zeros(n), mem_none),
        (t_sel, RC_SELECTIVE, np.zeros(n), mem_sel),
        (t_block, RC_BLOCK, k_block, mem_block),
        (t_unif, RC_UNIFORM, r_unif, mem_unif),
    ):
        idx = np.nonzero(mask)[0]
        if len(idx):
            parts.append((idx, np.full(len(idx), code), kval[idx], mem[idx]))
    if not parts:
        return _empty(layouts, st, min_state, best_seen)
    rows = np.concatenate([p[0] for p in parts])
    rc = np.concatenate([p[1] for p in parts])
    rk = np.concatenate([p[2] for p in parts])
    mem = np.concatenate([p[3] for p in parts])
    gl = {k: v[rows] for k, v in t.g.items()}
    b = mbs[rows]
    d = dist[rows]
    # Perf's recompute fraction: step_time uses L // (PP * VP) layers per chunk.
    chunk = np.maximum(1.0, np.floor(L / (gl["pp"] * gl["vp"])))
    frac = np.where(rc == RC_BLOCK, np.minimum(rk, chunk) / chunk, 1.0)
    rcode = np.where(rc == RC_NONE, 0, np.where(rc == RC_SELECTIVE, 1, 2))
    it = np.empty(len(rows))
    tok = np.empty(len(rows))
    im = inp.implementation
    for prec_v, prec in ((0.0, "bf16"), (1.0, "fp8")):
        sel_rows = np.nonzero(gl["fp8"] == prec_v)[0]
        if not len(sel_rows):
            continue
        r = step_time_arrays(
            inp.shape, inp.hardware, inp.seq_length, gbs,
            tp=gl["tp"][sel_rows], pp=gl["pp"][sel_rows], dp=gl["dp"][sel_rows], cp=gl["cp"][sel_rows],
            ep=gl["ep"][sel_rows], etp=gl["etp"][sel_rows], vp=gl["vp"][sel_rows], micro_batch_size=b[sel_rows],
            sequence_parallel=gl["sp"][sel_rows], recompute=rcode[sel_rows], recompute_fraction=frac[sel_rows],
            use_distributed_optimizer=d[sel_rows], overlap_grad_reduce=True, overlap_param_gather=d[sel_rows],
            tp_comm_overlap=False, precision=prec, fp8_recipe=inp.fp8_recipe, fp8_param_gather=False,
            transformer_impl=im.transformer_impl, attention_backend=im.attention_backend,
            grad_reduce_in_fp32=im.grad_reduce_in_fp32, gradient_accumulation_fusion=im.gradient_accumulation_fusion,
            moe_token_dispatcher_type=im.moe_token_dispatcher_type,
            moe_grouped_gemm=im.moe_grouped_gemm, cross_entropy_loss_fusion=im.cross_entropy_loss_fusion,
            # slots hold ranks (0, 1, PP-2, PP-1): first, middles, last stage layer counts
            stage_layers=(gl["nl0"][sel_rows], np.maximum(gl["nl1"], gl["nl2"])[sel_rows], gl["nl3"][sel_rows]),
        )
        it[sel_rows] = np.broadcast_to(r["iteration_time_s"], sel_rows.shape)
        tok[sel_rows] = np.broadcast_to(r["tokens_per_s_per_gpu"], sel_rows.shape)
    return SearchOutcome(
        layouts=layouts, layout=li[rows], mbs=b, dist_opt=d, recompute=rc, recompute_num_layers=rk,
        iteration_time_s=it, tokens_per_s_per_gpu=tok, memory_total_gib=mem, stats=st,
        min_model_state_gib=min_state, best_unconstrained_total_gib=best_seen,
    )
