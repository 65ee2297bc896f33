"""Where a running profile job is (queued, starting, warm-up, profiled, measured steps) and its ETA.

Read from what the job already writes: its spec (how many warm-up, profiled and measured
iterations, launcher/spec.py) and the Megatron-format iteration lines of its train.log
(launcher/entry/trainlog.py: `iteration N/ TOTAL | ... elapsed time per iteration (ms): X |`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcore_advisor.launcher.entry.profile import iteration_plan

_ITER_RE = re.compile(r"iteration\s+(\d+)/\s*(\d+)\s*\|.*?elapsed time per iteration \(ms\):\s*([0-9.]+)")
_KIND_NAMES = {"warmup": "warm-up", "profile": "profiled step", "measure": "measured step", "extra": "extra step"}


@dataclass(frozen=True)
class Phase:
    phase: str
    steps_done: int | None = None
    steps_total: int | None = None
    eta_s: float | None = None


def _kinds(job_dir: str) -> list[str] | None:
    try:
        run = json.loads((Path(job_dir) / "spec.json").read_text())["run"]
        return iteration_plan(run["warmup_steps"], run["measure_steps"], run.get("profile_steps"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def job_phase(status: Any) -> Phase:
    """`status`: get_job's JobStatus."""
    state = status.state
    if state == "PENDING":
        return Phase("queued")
    if state == "UNKNOWN":  # the backend did not answer just now: the job may well still run
        return Phase(f"unknown: the scheduler did not answer (last known {status.last_known_state})")
    if state != "RUNNING":
        return Phase("done" if state == "COMPLETED" else "ended")
    kinds = _kinds(status.job_dir)
    hits = _ITER_RE.findall(status.log_tail or "")
    total = len(kinds) if kinds else (int(hits[-1][1]) if hits else None)
    if not hits:
        return Phase("started: building the model and the first step", 0, total)
    done = int(hits[-1][0])
    step_s = float(hits[-1][2]) / 1000
    kind = kinds[done - 1] if kinds and done <= len(kinds) else "measure"
    counts = [k for k in (kinds or [])[:done] if k == kind]
    of = (kinds or []).count(kind)
    label = _KIND_NAMES.get(kind, kind) + (f" {len(counts)}/{of}" if of else "")
    eta = max(0, (total or done) - done) * step_s
    return Phase(label, done, total, round(eta, 3))
