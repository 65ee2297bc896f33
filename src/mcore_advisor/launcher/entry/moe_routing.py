"""How a profile job's MoE router actually routed: tokens per expert and per expert-parallel rank.

The step-time and memory models assume balanced routing. An untrained router on Megatron's mock data
is not balanced, and the EP all-to-alls wait on the rank that receives the most tokens, so the job
records what the router did in its measured iterations:

- `Recorder` wraps `megatron.core.transformer.moe.router.TopKRouter.forward` (class level, restored on
  exit). In megatron-core 0.19.2 it returns `(probs, routing_map)`, routing_map a [tokens,
  num_experts] bool tensor (router.py `TopKRouter.routing`, after token dropping). While recording is
  on (every training iteration: profile.py's _Hooks switches it per iteration and tags it measured or
  not), each call appends `routing_map.sum(0)` (int64, left on the device: no host sync per call) with
  the router's `layer_number` (Megatron's global layer number, pipeline offset included) and the
  iteration. The routing figures come from the measured iterations; the new-shape count (expert GEMM
  row counts each EP rank meets for the first time, per iteration) from all of them. Calls made while the
  autograd engine runs a backward pass are the activation-recompute replays of a forward already
  counted (reentrant and non-reentrant checkpoints both recompute inside the backward's graph task)
  and are skipped. A CUDA-graphed router replays without calling forward and records nothing.
- `Recorder.report()` turns the calls into one small dict per rank (its expert-parallel group's
  ranks, TP size, sequence parallelism, local experts, [[layer, [count per expert]], ...]); the job
  gathers them like its other per-rank fields and rank 0 calls `summarize`.
- `summarize(rows)` (pure): per pipeline stage and EP group, call i of every member is the same layer
  and micro-batch (the members run one schedule), so the group's per-expert load is the members' sum
  (divided by TP when TP > 1 without sequence parallelism: those ranks route the same tokens). EP rank
  j holds the contiguous block of experts j*E/EP .. (j+1)*E/EP - 1 (Megatron's layout), so it receives
  the sum of that block. Figures: max/mean of the EP ranks' tokens per call (the all-to-all waits on
  the max), the per-expert coefficient of variation (population std / mean) and max/mean, and how many
  distinct expert row counts (GEMM shapes) the window met and the share of expert GEMM calls with a new one.

Nothing here may fail the job: every step catches and leaves a note instead.
"""

from __future__ import annotations

import statistics
from typing import Any

#: per rank, the most per-expert counts kept (calls x experts): a long run's calls are many and all of
#: them are gathered on every rank (all_gather_object); the first ones already show the imbalance
MAX_COUNTS_PER_RANK = 1 << 18
SOURCE = ("Megatron's TopKRouter.forward routing_map (after token dropping) of the measured iterations, "
          "summed over each expert-parallel group's ranks per router call; EP rank tokens = its contiguous "
          "block of experts; recompute replays skipped")


class Recorder:
    """The router's per-call tokens per expert, recorded while `recording` is True (context manager:
    installs the wrapper on entry, restores TopKRouter.forward on exit)."""

    def __init__(self) -> None:
        self.recording = False
        # the training iteration being recorded and whether it is a measured one (profile.py's _Hooks set both)
        self.iteration = 0
        self.measured = False
        self.calls: list[tuple[int, int, bool, Any]] = []
        self.dropped = 0
        self.notes: list[str] = []
        self._router_cls = None
        self._orig = None

    def __enter__(self) -> Recorder:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def install(self) -> None:
        try:
            import torch
            from megatron.core.transformer.moe.router import TopKRouter
        except Exception as exc:  # no MoE support in this megatron: nothing to record
            self.notes.append(f"MoE routing not recorded: {type(exc).__name__}: {exc}"[:300])
            return
        orig = TopKRouter.forward
        recorder = self

        def forward(router_self, *args, **kwargs):
            out = orig(router_self, *args, **kwargs)
            if recorder.recording and torch._C._current_graph_task_id() == -1:
                recorder._add(router_self, out)
            return out

        forward.__wrapped__ = orig
        self._router_cls, self._orig = TopKRouter, orig
        TopKRouter.forward = forward

    def uninstall(self) -> None:
        if self._router_cls is not None:
            self._router_cls.forward = self._orig
            self._router_cls = self._orig = None

    def _add(self, router, out) -> None:
        try:
            routing_map = out[1]
            num_experts = routing_map.shape[-1]
            used = len(self.calls) * num_experts + num_experts
            if not self.measured and used > MAX_COUNTS_PER_RANK // 2:  # warm-up calls: the new-shape record only
                return
            if used > MAX_COUNTS_PER_RANK:
                self.dropped += 1
                return
            layer = router.layer_number
            # a bool tensor's sum is int64
            self.calls.append((int(layer) if layer is not None else -1, self.iteration, self.measured,
                               routing_map.sum(0)))
        except Exception as exc:  # a recorder's fault must never reach the training step
            self.recording = False
            self.notes.append(f"MoE routing recording stopped: {type(exc).__name__}: {exc}"[:300])

    def report(self, args) -> dict[str, Any] | None:
        """This rank's routing for the gather (None when the model has no MoE layer or on failure)."""
        if not getattr(args, "num_experts", None):
            return None
        try:
            return self._report(args)
        except Exception as exc:
            self.notes.append(f"MoE routing report failed: {type(exc).__name__}: {exc}"[:300])
            return None

    def _report(self, args) -> dict[str, Any]:
        import torch
        from megatron.core import parallel_state as ps

        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        try:
            group = [int(r) for r in torch.distributed.get_process_group_ranks(ps.get_expert_model_parallel_group())]
        except Exception:  # no expert group (EP 1 in some set-ups): this rank alone
            group = [rank]
        counts = torch.stack([c[-1] for c in self.calls]).cpu().tolist() if self.calls else []
        return {
            "rank": rank,
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "ep_group": group,
            "tp": ps.get_tensor_model_parallel_world_size(),
            "sequence_parallel": bool(getattr(args, "sequence_parallel", False)),
            "num_local_experts": args.num_experts // len(group),
            "calls": [[layer, c, it, measured] for (layer, it, measured, _), c in zip(self.calls, counts, strict=True)],
            "dropped_calls": self.dropped,
        }


# --------------------------------------------------------------------------- the summary (rank 0)

def _group_calls(members: list[dict[str, Any]]) -> list[tuple[int, list[float], int, bool]]:
    """(layer, per-expert tokens of the group, iteration, measured) for each call index every member made
    (jobs before s9 recorded [layer, counts] of the measured iterations only: iteration 0, measured)."""
    n = min(len(m["calls"]) for m in members)
    first = members[0]
    duplicate = first["tp"] if first["tp"] > 1 and not first["sequence_parallel"] else 1
    out = []
    for i in range(n):
        layer = first["calls"][i][0]
        if any(m["calls"][i][0] != layer for m in members):
            raise ValueError(f"router call {i} is layer {layer} on rank {first['rank']} but another layer on a rank "
                             f"of its expert-parallel group {first['ep_group']}: the schedules differ")
        totals = [sum(col) / duplicate for col in zip(*(m["calls"][i][1] for m in members), strict=True)]
        it, measured = (first["calls"][i][2], bool(first["calls"][i][3])) if len(first["calls"][i]) > 2 else (0, True)
        out.append((layer, totals, it, measured))
    return out


#: cuBLASLt's heuristics cache in row counts: its default 8192 problems (CUBLASLT_HEURISTICS_CACHE_CAPACITY) over
#: the six GEMM problems of one expert row count: physics.moe's CUBLASLT_HEURISTICS_CACHE_KEYS and
#: EXPERT_GEMM_SHAPES (the job imports no numpy-side physics; tests/launcher/test_entry_moe_routing.py pins them equal)
GEMMS_PER_ROW_COUNT = 6
HEURISTIC_CACHE_ROW_COUNTS = 8192 // GEMMS_PER_ROW_COUNT


def _rank_rows(totals: list[float], rank: int, num_local_experts: int) -> list[int]:
    """The row counts of EP rank `rank`'s experts in one call (its contiguous block), experts without a token
    (no GEMM) left out."""
    block = totals[rank * num_local_experts:(rank + 1) * num_local_experts]
    return [r for r in (round(t) for t in block) if r > 0]


def heuristic_misses(calls: list[tuple[int, list[float], int, bool]], num_local_experts: int,
                     capacity: int = HEURISTIC_CACHE_ROW_COUNTS) -> tuple[int, int]:
    """(expert GEMM calls of the measured iterations whose row count is not in an LRU cache of `capacity` row
    counts, those calls), the EP rank with most misses: each rank's row counts replayed in call order through its
    own LRU from the first iteration on. A count met for the first time misses like one evicted earlier: both
    ask cuBLASLt's heuristic (physics.moe.HEURISTIC_QUERY_REF_LAYERS)."""
    from collections import OrderedDict

    best = (0, 0)
    ranks = len(calls[0][1]) // num_local_experts if calls else 0
    for j in range(ranks):
        lru: OrderedDict[int, None] = OrderedDict()
        missed = total = 0
        for _, totals, _, measured in calls:
            for r in _rank_rows(totals, j, num_local_experts):
                total += measured
                if r in lru:
                    lru.move_to_end(r)
                    continue
                missed += measured
                if len(lru) >= capacity:
                    lru.popitem(last=False)
                lru[r] = None
        best = max(best, (missed, total))
    return best


def new_shapes(calls: list[tuple[int, list[float], int, bool]], num_local_experts: int) -> dict[int, list[int]]:
    """{iteration: [expert GEMM calls with a row count the EP rank had not met before, its expert GEMM calls]}
    of the busiest EP rank (most new counts in the run), over one group's calls in order. Each EP rank's
    process keeps its own cuBLASLt heuristics cache, keyed by the GEMM's shape: an expert's row count met
    for the first time is a shape its six GEMMs (fc1, fc2 forward; their dgrad and wgrad) have not met.
    Experts with no token run no GEMM."""
    per_rank: list[dict[int, list[int]]] = []
    ranks = len(calls[0][1]) // num_local_experts if calls else 0
    for j in range(ranks):
        seen: set[int] = set()
        tally: dict[int, list[int]] = {}
        for _, totals, it, _ in calls:
            rows = _rank_rows(totals, j, num_local_experts)
            fresh = [r for r in rows if r not in seen]
            seen.update(rows)
            t = tally.setdefault(it, [0, 0])
            t[0], t[1] = t[0] + len(set(fresh)), t[1] + len(rows)
        per_rank.append(tally)
    return max(per_rank, key=lambda t: sum(v[0] for v in t.values())) if per_rank else {}


def _call_figures(totals: list[float], num_local_experts: int) -> tuple[float, float, float, list[float]] | None:
    """(EP-rank max/mean, expert std/mean, expert max/mean, tokens per EP rank) of one call; None if no token."""
    mean = statistics.fmean(totals)
    if mean <= 0:
        return None
    ranks = [sum(totals[j:j + num_local_experts]) for j in range(0, len(totals), num_local_experts)]
    return (max(ranks) / statistics.fmean(ranks), statistics.pstdev(totals) / mean, max(totals) / mean, ranks)


def summarize(rows: list[dict[str, Any] | None], local_only: bool = False,
              cache_row_counts: int = HEURISTIC_CACHE_ROW_COUNTS) -> dict[str, Any] | None:
    """result["moe_routing"] from the ranks' `Recorder.report()` dicts (None entries: ranks without
    MoE); None when no rank recorded a router call. `local_only`: memory_at_scale, where one process
    plays one rank and the group's other ranks never ran (their share is missing from the sums)."""
    rows = [r for r in rows if r and r["calls"]]
    if not rows:
        return None
    groups: dict[tuple[int, tuple[int, ...]], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["pp_rank"], tuple(r["ep_group"])), []).append(r)
    imbalance, cv, peak, per_layer, per_rank = [], [], [], {}, []
    # each expert's tokens in a call is its GEMMs' row count: a count not met before in the window is a GEMM shape
    # cuBLASLt has not chosen an algorithm for (the traces' host gaps inside TE's grouped GEMM follow it)
    expert_rows: list[int] = []
    fresh: dict[int, list[int]] = {}
    misses, warm_up_recorded = [0, 0], False
    for members in groups.values():
        calls = _group_calls(members)
        warm_up_recorded = warm_up_recorded or any(not m for _, _, _, m in calls)
        n_miss, n_calls = heuristic_misses(calls, members[0]["num_local_experts"], cache_row_counts)
        if n_calls and (not misses[1] or n_miss / n_calls > misses[0] / misses[1]):
            misses = [n_miss, n_calls]
        for it, (n_new, n_all) in new_shapes(calls, members[0]["num_local_experts"]).items():
            t = fresh.setdefault(it, [0, 0])
            t[0], t[1] = max(t[0], n_new), max(t[1], n_all)
        for layer, totals, _, measured in calls:
            if not measured:
                continue
            expert_rows += [round(t) for t in totals]
            fig = _call_figures(totals, members[0]["num_local_experts"])
            if fig is None:
                continue
            imbalance.append(fig[0])
            cv.append(fig[1])
            peak.append(fig[2])
            per_rank.append(fig[3])
            per_layer.setdefault(str(layer), []).append(fig[0])
    if not imbalance:
        return None
    first = min(rows, key=lambda r: r["rank"])
    sample = [m for m in rows if m["pp_rank"] == first["pp_rank"] and m["ep_group"] == first["ep_group"]]
    return {
        "ep_size": len(first["ep_group"]),
        "num_experts": len(first["calls"][0][1]),
        "ep_groups": len(groups),
        "calls": len(imbalance),
        "rank_imbalance_mean": statistics.fmean(imbalance),
        "rank_imbalance_max": max(imbalance),
        "expert_load_cv_mean": statistics.fmean(cv),
        "expert_max_over_mean_mean": statistics.fmean(peak),
        "per_layer": {k: statistics.fmean(v) for k, v in sorted(per_layer.items(), key=lambda kv: int(kv[0]))},
        "tokens_per_ep_rank_mean": [statistics.fmean(col) for col in zip(*per_rank, strict=True)],
        "first_call_per_rank": [{"rank": m["rank"], "layer": m["calls"][0][0], "tokens_per_expert": m["calls"][0][1]}
                                for m in sorted(sample, key=lambda m: m["rank"])],
        "expert_rows_distinct": len(set(expert_rows)),
        # every distinct count is new exactly once
        "expert_rows_new_fraction": len(set(expert_rows)) / len(expert_rows),
        # per iteration (all of them, warm-up included), the busiest EP rank of each group: its expert GEMM calls
        # with a row count its process had not met, and all its expert GEMM calls (max over groups)
        "expert_rows_new_per_iteration": {str(k): v for k, v in sorted(fresh.items())},
        # the measured iterations' expert GEMMs whose row count missed cuBLASLt's heuristics cache (LRU replay from
        # the first iteration, the EP rank with the highest share); only where warm-up calls were recorded (s9 on)
        **({"expert_gemm_heuristic_miss_share": misses[0] / misses[1], "heuristic_cache_row_counts": cache_row_counts}
           if misses[1] and warm_up_recorded else {}),
        "dropped_calls": sum(r.get("dropped_calls", 0) for r in rows),
        "source": SOURCE + (" (memory_at_scale: this one rank's own routing, the group's other ranks did not run)"
                            if local_only else ""),
    }
