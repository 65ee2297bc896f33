"""What is live at the memory peak of iteration 2 (a diagnosis; off unless MCORE_ADVISOR_MEMORY_PEAK=1, CUDA only).

Method:
1. At the start of iteration 2 (optimizer state exists after iteration 1's step, so iteration 2 is a
   steady step) `torch.cuda.memory._record_memory_history` starts recording every allocator event
   with the Python stack of each allocation (context="alloc", stacks="python").
2. At the end of iteration 2 `torch.cuda.memory._snapshot()` returns the allocator's state: its
   `segments` (each with `blocks`: address, size, requested_size, state, frames) and
   `device_traces[device]`, the events in order (action "alloc" / "free_requested" /
   "free_completed" / "segment_alloc" / ..., addr, size, frames innermost first; torch/cuda/memory.py
   `_snapshot`, torch/cuda/_memory_viz.py). Recording stops.
3. `peak_live(snapshot, device)` replays the trace: an "alloc" adds its size, a "free_completed" (the
   point the caching allocator counts a block free again) removes it. A free of an address never
   allocated in the trace is a block allocated before recording began. The bytes of those still live
   at the end are the snapshot's active blocks that the replay does not hold; adding back the ones
   freed during the trace gives their total at the start, and their total at any moment. The peak is
   the event after which (before-recording bytes + replayed bytes) is largest; the blocks live then
   are grouped by the innermost frame inside megatron/ or transformer_engine/ (else the innermost
   frame outside torch; allocations from the autograd engine's threads carry no Python frame) plus
   one group "before iteration 2".

The trace's sizes are the requested sizes; torch's allocated counter (max_memory_allocated) counts
blocks rounded up (512 B, or an unsplit larger block), so the replayed peak sits slightly below it
(`max_allocated_bytes` is reported beside it). With more than MAX_ENTRIES events the recorder keeps the
latest ones: the earliest allocations of the iteration then count as "before iteration 2" and
`trace_full` says so. Recording costs host time, so iteration 2's step time includes it. The job's
memory figures are read as without it (the snapshot lives in host memory).
"""

from __future__ import annotations

import os
from typing import Any

ENV = "MCORE_ADVISOR_MEMORY_PEAK"
#: the iteration recorded (1-based, as the job counts them)
ITERATION = 2
#: allocator events kept (each carries a Python stack: several KB of host memory)
MAX_ENTRIES = 400_000
TOP_GROUPS = 40
BEFORE = "before iteration 2"
NO_FRAME = "no Python frame (autograd engine thread or C++)"
_LIBRARIES = ("megatron/", "transformer_engine/")


def enabled(use_cuda: bool) -> bool:
    return use_cuda and os.environ.get(ENV) == "1"


# --------------------------------------------------------------------------- the replay (pure)

def _short(filename: str) -> str:
    for lib in _LIBRARIES:
        i = filename.rfind("/" + lib)
        if i >= 0 or filename.startswith(lib):
            return filename[i + 1:] if i >= 0 else filename
    return "/".join(filename.split("/")[-3:])


def _inside(filename: str, lib: str) -> bool:
    return ("/" + lib) in filename or filename.startswith(lib)


def where(frames: list[dict[str, Any]]) -> str:
    """'file:line function' of the innermost library frame (megatron/, transformer_engine/), else of the
    innermost frame outside torch; frames are innermost first, as the snapshot lists them."""
    pick = next((f for f in frames if any(_inside(f["filename"], lib) for lib in _LIBRARIES)), None)
    if pick is None:
        pick = next((f for f in frames if not _inside(f["filename"], "torch/") and not f["filename"].startswith("<")), None)
    if pick is None:
        return NO_FRAME
    return f"{_short(pick['filename'])}:{pick['line']} {pick['name']}"


def _trace(snapshot: dict[str, Any], device: int) -> list[dict[str, Any]]:
    traces = snapshot.get("device_traces") or []
    return traces[device] if device < len(traces) else []


def _replay(trace: list[dict[str, Any]]) -> tuple[int, list[tuple[int, int]]]:
    """(index of the event after which replayed bytes minus the pre-recording bytes freed so far are
    largest, -1 before any event; the frees of pre-recording blocks as (event index, bytes))."""
    live: dict[int, int] = {}
    pre_frees: list[tuple[int, int]] = []
    cur = freed = best = 0
    best_i = -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            cur += e["size"]
        elif e["action"] == "free_completed":
            if e["addr"] in live:
                cur -= live.pop(e["addr"])
            else:
                pre_frees.append((i, e["size"]))
                freed += e["size"]
        if cur - freed > best:
            best, best_i = cur - freed, i
    return best_i, pre_frees


def _live_at(trace: list[dict[str, Any]], last: int) -> dict[int, dict[str, Any]]:
    """addr -> alloc event of the blocks allocated in the trace and live after event `last`."""
    live: dict[int, dict[str, Any]] = {}
    for e in trace[:last + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    return live


def _before_at_end(snapshot: dict[str, Any], device: int, live_end: dict[int, Any]) -> tuple[int, int]:
    """(requested bytes, count) of the snapshot's active blocks that were allocated before recording."""
    total = count = 0
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        for b in seg.get("blocks", []):
            if b["state"].startswith("active") and b["address"] not in live_end:
                total += b.get("requested_size", b["size"])
                count += 1
    return total, count


def peak_live(snapshot: dict[str, Any], device: int = 0, top: int = TOP_GROUPS) -> dict[str, Any]:
    """The replayed peak of one device's trace and the blocks live at it, grouped by where they were allocated."""
    trace = _trace(snapshot, device)
    peak_i, pre_frees = _replay(trace)
    # pre-recording blocks live at the peak = those live at the snapshot + those freed after the peak
    end_bytes, end_count = _before_at_end(snapshot, device, _live_at(trace, len(trace) - 1))
    later = [size for i, size in pre_frees if i > peak_i]
    before_at_peak, before_count = end_bytes + sum(later), end_count + len(later)
    groups: dict[str, list[int]] = {}
    for e in _live_at(trace, peak_i).values():
        g = groups.setdefault(where(e.get("frames") or []), [0, 0])
        g[0] += e["size"]
        g[1] += 1
    rows = [{"where": k, "bytes": v[0], "count": v[1]} for k, v in groups.items()]
    replayed = sum(r["bytes"] for r in rows)
    if before_at_peak:
        rows.append({"where": BEFORE, "bytes": before_at_peak, "count": before_count})
    rows.sort(key=lambda r: -r["bytes"])
    return {
        "peak_bytes_replayed": before_at_peak + replayed,
        "before_recording_bytes": before_at_peak,
        "peak_event": peak_i,
        "events": len(trace),
        "groups": rows[:top],
    }


# --------------------------------------------------------------------------- the recorder (CUDA)

class PeakRecorder:
    """Records iteration 2's allocator history and keeps its peak summary (`summary`, None until then)."""

    def __init__(self, use_cuda: bool) -> None:
        self.on = enabled(use_cuda)
        self.summary: dict[str, Any] | None = None
        self.notes: list[str] = []
        self._recording = False

    def begin(self, iteration: int) -> None:
        if not self.on or iteration != ITERATION:
            return
        try:
            import torch

            torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                     max_entries=MAX_ENTRIES)
            self._recording = True
        except Exception as exc:  # a diagnosis: the run goes on without it
            self.notes.append(f"memory peak not recorded: {type(exc).__name__}: {exc}"[:300])

    def end(self, iteration: int) -> None:
        if not self._recording or iteration != ITERATION:
            return
        import torch

        self._recording = False
        try:
            snapshot = torch.cuda.memory._snapshot()
        except Exception as exc:
            self.notes.append(f"memory peak snapshot failed: {type(exc).__name__}: {exc}"[:300])
            snapshot = None
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        if snapshot is None:
            return
        try:
            device = torch.cuda.current_device()
            summary = peak_live(snapshot, device)
            summary.update(iteration=ITERATION, max_allocated_bytes=int(torch.cuda.max_memory_allocated()),
                           trace_full=summary["events"] >= MAX_ENTRIES)
            self.summary = summary
        except Exception as exc:
            self.notes.append(f"memory peak replay failed: {type(exc).__name__}: {exc}"[:300])
        self.notes.append(f"{ENV}=1: allocator history recorded in iteration {ITERATION} (its step time includes the recording)")

    def report(self, rank: int) -> dict[str, Any] | None:
        """This rank's summary for the gather (None when off or nothing was recorded)."""
        return None if self.summary is None else {"rank": rank, **self.summary}


def pick(rows: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """result["memory_peak"]: rank 0's summary and the most loaded rank's (by replayed peak), each with its rank."""
    have = [r for r in rows if r]
    if not have:
        return []
    top = max(have, key=lambda r: r["peak_bytes_replayed"])
    return [r for r in have if r["rank"] == 0 or r is top]
