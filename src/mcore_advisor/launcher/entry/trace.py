"""Exposed communication time from a torch.profiler Chrome trace (dependency-free).

On a GPU, communication is exposed where a collective kernel (NCCL) runs while no compute kernel
runs on any stream of that device: exposed = |U(comm)| - |U(comm) n U(compute)|, U = union of
intervals. On the CPU (gloo), the calling thread blocks inside the collective, so the whole
collective time counts as exposed.
"""

from __future__ import annotations

import re
from typing import Any

_COMM_KERNEL = re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter|sendrecv|alltoall", re.I)
_COMM_CPU_OP = re.compile(r"^(c10d::|gloo:|nccl:|record_param_comms)", re.I)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _length(u: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in u)


def _intersection_length(u: list[tuple[float, float]], v: list[tuple[float, float]]) -> float:
    """Length of the intersection of two unions (each sorted and disjoint)."""
    i = j = 0
    total = 0.0
    while i < len(u) and j < len(v):
        a = max(u[i][0], v[j][0])
        b = min(u[i][1], v[j][1])
        if b > a:
            total += b - a
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return total


def exposed_comm(events: list[dict[str, Any]], num_steps: int = 1) -> dict[str, Any]:
    """Per-iteration communication and exposed-communication seconds from trace events.

    `events` is a Chrome trace's traceEvents (timestamps and durations in microseconds).
    Uses GPU kernels when the trace has any, else CPU collective ops.
    """
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel" and "dur" in e]
    steps = max(1, num_steps)
    if kernels:
        comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if _COMM_KERNEL.search(e.get("name", ""))])
        compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if not _COMM_KERNEL.search(e.get("name", ""))])
        comm_us = _length(comm)
        exposed_us = comm_us - _intersection_length(comm, compute)
        busy_us = _length(_union(comm + compute))
        method = "gpu kernels: NCCL kernel time not overlapped by any compute kernel"
    else:
        ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op" and "dur" in e]
        comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in ops if _COMM_CPU_OP.search(e.get("name", ""))])
        comm_us = exposed_us = _length(comm)
        busy_us = _length(_union([(e["ts"], e["ts"] + e["dur"]) for e in ops]))
        method = "cpu ops: blocking collective (c10d/gloo) time, all counted as exposed"
    return {
        "comm_s": comm_us / 1e6 / steps,
        "exposed_comm_s": exposed_us / 1e6 / steps,
        "device_busy_s": busy_us / 1e6 / steps,
        "method": method,
    }
