"""Megatron-LM's console lines: read the ones megatron.training prints, write the one it does not.

Formats follow megatron-core 0.19.2: megatron/training/training.py `training_log` (one line per
logged iteration), megatron/training/utils/common_utils.py `report_memory`, and
megatron/core/timers.py `Timers.log` ("(min, max) time across ranks (ms):" then one indented line
per timer). The profile job reads its figures from these lines, so its result says what the
user's own Megatron log would.
"""

from __future__ import annotations

import re
from typing import Any

_ITERATION = re.compile(r"\] iteration\s+(\d+)/\s*(\d+) \|")
_MEMORY = re.compile(
    r"^\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([\d.]+) \| max allocated: ([\d.]+)"
    r" \| reserved: ([\d.]+) \| max reserved: ([\d.]+)"
)
_TIMER = re.compile(r"^ {4}(\S.*?) \.*: \(?([\d.]+)(?:, ([\d.]+)\))?$")


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def parse_iteration_line(line: str) -> dict[str, Any] | None:
    """One `training_log` line as numbers; None for any other line.

    Keys: iteration, train_iters, elapsed_ms, tflops_per_gpu (None without --log-throughput),
    lm_loss, grad_norm, learning_rate, skipped, nan, and `fields` (every 'name: value' pair).
    """
    m = _ITERATION.search(line)
    if not m:
        return None
    fields: dict[str, float | str] = {}
    for part in line[m.end():].split("|"):
        key, sep, val = part.partition(":")
        if sep:
            fields[key.strip()] = _number(val.strip())
    return {
        "iteration": int(m.group(1)),
        "train_iters": int(m.group(2)),
        "elapsed_ms": fields.get("elapsed time per iteration (ms)"),
        "tflops_per_gpu": fields.get("throughput per GPU (TFLOP/s/GPU)"),
        "lm_loss": fields.get("lm loss"),
        "grad_norm": fields.get("grad norm"),
        "learning_rate": fields.get("learning rate"),
        "skipped": fields.get("number of skipped iterations"),
        "nan": fields.get("number of nan iterations"),
        "fields": fields,
    }


def parse_memory_line(line: str) -> dict[str, Any] | None:
    """One `report_memory` line (MB = 2^20 bytes); None for any other line."""
    m = _MEMORY.match(line.strip())
    if not m:
        return None
    rank, it, *mb = m.groups()
    return {"rank": int(rank), "iteration": int(it), "allocated_mb": float(mb[0]), "max_allocated_mb": float(mb[1]),
            "reserved_mb": float(mb[2]), "max_reserved_mb": float(mb[3])}


def parse_timer_line(line: str) -> tuple[str, float, float] | None:
    """(name, min ms, max ms) of one `Timers.log` entry; min = max where only the max is printed."""
    m = _TIMER.match(line.rstrip("\n"))
    if not m:
        return None
    lo = float(m.group(2))
    return m.group(1).strip(), lo, float(m.group(3)) if m.group(3) else lo


def memory_line(rank: int, iteration: int, allocated_mb: float, max_allocated_mb: float, reserved_mb: float, max_reserved_mb: float) -> str:
    """Megatron's `report_memory(f'(after {iteration} iterations)')` line as rank `rank` prints it
    (the job prints it for a measured rank Megatron leaves silent: a fake process group's rank
    whose data-parallel rank is not 0)."""
    s = f"(after {iteration} iterations) memory (MB)"
    s += f" | allocated: {allocated_mb:.2f}"
    s += f" | max allocated: {max_allocated_mb:.2f}"
    s += f" | reserved: {reserved_mb:.2f}"
    s += f" | max reserved: {max_reserved_mb:.2f}"
    return f"[Rank {rank}] {s}"


def argument_dump(args: Any) -> list[str]:
    """Megatron's argument dump (arguments.py `_print_args`), which it prints on rank 0 only."""
    rows = [f"  {k} {'.' * (48 - len(k))} {v}" for k, v in vars(args).items()]
    return (["------------------------ arguments ------------------------"]
            + sorted(rows, key=str.lower)
            + ["-------------------- end of arguments ---------------------"])
