"""The pipeline schedule of a plan, drawn from a small simulation of Megatron's own op order.

Order per pipeline rank as in megatron/core/pipeline_parallel/schedules.py:
- 1F1B (forward_backward_pipelining_without_interleaving): pp - rank - 1 warm-up forwards, then one
  forward + one backward each, then the cool-down backwards;
- interleaved (forward_backward_pipelining_with_interleaving, microbatch group size = pp):
  (pp - rank - 1) * 2 + (vp - 1) * pp warm-up forwards, model chunk of the k-th virtual
  micro-batch = (k mod pp*vp) // pp (reversed for backwards).
Each op starts when its rank is free and its input has arrived (the previous stage's forward, the
next stage's backward); communication is taken as free, so the idle time is the bubble alone. With
equal stages the simulated bubble is (pp - 1) / (vp * m) of the ideal time (Narayanan et al. 2021).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcore_advisor.charts._figure import COLORS, figure, png

# enough micro-batches to show warm-up, steady state and cool-down; more only blur the picture
DRAWN_MICROBATCHES_PER_STAGE = 2


@dataclass(frozen=True)
class Op:
    rank: int
    kind: str  # "F" or "B"
    chunk: int
    microbatch: int
    start: float
    end: float


def _rank_order(p: int, vp: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """(kind, chunk, microbatch) in the order Megatron runs them on `rank`."""
    total = m * vp

    def virtual(k: int, kind: str) -> tuple[str, int, int]:
        group = k % (p * vp)
        chunk = group // p
        mb = (k // (p * vp)) * p + k % p
        return kind, (chunk if kind == "F" else vp - 1 - chunk), mb

    warm = min(total, (p - rank - 1) * 2 + (vp - 1) * p) if vp > 1 else min(m, p - rank - 1)
    fwd = [virtual(k, "F") if vp > 1 else ("F", 0, k) for k in range(total)]
    bwd = [virtual(k, "B") if vp > 1 else ("B", 0, k) for k in range(total)]
    order = fwd[:warm]
    for j in range(total - warm):
        order += [fwd[warm + j], bwd[j]]
    return order + bwd[total - warm:]


def schedule(p: int, vp: int, m: int, forward_s: float, backward_s: float) -> list[Op]:
    """Simulated ops of one step; `forward_s`/`backward_s` are one micro-batch through one stage
    (all its model chunks), so one chunk takes 1/vp of them."""
    if p < 1 or vp < 1 or m < 1:
        raise ValueError("pipeline: pp, vp and the number of micro-batches must be >= 1")
    if vp > 1 and m % p:
        raise ValueError(f"pipeline: the interleaved schedule needs micro-batches ({m}) divisible by pp ({p})")
    dur = {"F": forward_s / vp, "B": backward_s / vp}
    orders = [_rank_order(p, vp, m, r) for r in range(p)]
    pos = [0] * p
    free = [0.0] * p
    done: dict[tuple[str, int, int, int], float] = {}
    ops: list[Op] = []

    def dependency(kind: str, chunk: int, mb: int, rank: int) -> tuple[str, int, int, int] | None:
        if kind == "F":
            if rank > 0:
                return ("F", chunk, mb, rank - 1)
            return ("F", chunk - 1, mb, p - 1) if chunk > 0 else None
        if rank < p - 1:
            return ("B", chunk, mb, rank + 1)
        return ("B", chunk + 1, mb, 0) if chunk < vp - 1 else ("F", vp - 1, mb, p - 1)

    while any(pos[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                kind, chunk, mb = orders[r][pos[r]]
                dep = dependency(kind, chunk, mb, r)
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done[dep] if dep is not None else 0.0)
                end = start + dur[kind]
                done[(kind, chunk, mb, r)] = end
                ops.append(Op(r, kind, chunk, mb, start, end))
                free[r] = end
                pos[r] += 1
                progressed = True
        if not progressed:  # cannot happen for Megatron's orders; guards a bad edit
            raise RuntimeError("pipeline schedule deadlocked")
    return ops


def bubble_fraction(ops: list[Op], m: int, forward_s: float, backward_s: float) -> float:
    """Idle time over the ideal time m * (forward + backward) of one rank."""
    span = max(o.end for o in ops) - min(o.start for o in ops)
    ideal = m * (forward_s + backward_s)
    return span / ideal - 1.0


def pipeline_png(evaluation: Any, title: str = "") -> bytes:
    """`evaluation`: evaluate_plan's Evaluation of a plan with pipeline parallelism."""
    par, perf = evaluation.parallel, evaluation.performance
    p, vp, m = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size, par.num_microbatches
    if p == 1:
        raise ValueError("pp: the plan has no pipeline (pp=1), so there is no schedule to draw; ask for chart='step_time'")
    if perf is None:
        raise ValueError("plan: no step-time prediction for a plan the validators reject; fix its error findings first")
    b = perf.breakdown
    # Per micro-batch work of the slowest stage: the step minus the bubble and the once-per-step terms;
    # backward = 2 x forward (two GEMMs per forward GEMM), recompute included in the backward.
    per_mb = (perf.iteration_time_s - b.pipeline_bubble_s - b.dp_comm_exposed_s - b.optimizer_s - b.overhead_s) / m
    fwd = (per_mb - b.recompute_s / m) / 3
    bwd = per_mb - fwd
    drawn = min(m, max(DRAWN_MICROBATCHES_PER_STAGE * p, 4))
    if vp > 1:
        drawn -= drawn % p
    ops = schedule(p, vp, drawn, fwd, bwd)
    fig, ax = figure()
    groups: dict[tuple[int, int, str], list[tuple[float, float]]] = {}
    for o in ops:  # one artist per (stage, chunk, direction): thousands of single bars draw slowly
        groups.setdefault((o.rank, o.chunk, o.kind), []).append((o.start, o.end - o.start))
    for (rank, chunk, kind), spans in groups.items():
        ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=COLORS[chunk % len(COLORS)], edgecolor="white",
                       linewidth=0.3, alpha=1.0 if kind == "F" else 0.55)
    if len(ops) <= 200:
        for o in ops:
            ax.text((o.start + o.end) / 2, o.rank, str(o.microbatch), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(p), [f"stage {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (forward solid, backward light; colour = model chunk)")
    sim = bubble_fraction(ops, drawn, fwd, bwd)
    shown = "" if drawn == m else f"; first {drawn} of {m} micro-batches drawn"
    ax.set_title(title or f"PP{p}" + (f" VP{vp}" if vp > 1 else "") + f", {m} micro-batches: bubble "
                 f"{100 * perf.pipeline_bubble_fraction:.1f}% of the step\n(drawn: the schedule idles "
                 f"{100 * sim:.1f}% over the ideal time{shown})", fontsize=10)
    return png(fig)
