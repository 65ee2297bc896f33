"""The H100 evidence set of Megatron-LM's own loop (benchmarks/results/gpu_h100_megatron_runs.jsonl),
read for the accuracy reports (benchmarks/memory_accuracy.py, benchmarks/throughput_accuracy.py).

Each row is predicted for the plan as it ran (launcher/as_ran.py: Megatron's parsed arguments in the
row's result). Held-out rule, fixed before any fitting: a row is held out when the first byte of
sha256(run name) is divisible by 3 (about a third); fitting may look at the other rows only, and the
reports give both parts separately.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcore_advisor.launcher.as_ran import as_ran
from mcore_advisor.schemas import Plan

RESULTS = Path(__file__).resolve().parents[1] / "results"
FILE = "gpu_h100_megatron_runs.jsonl"


def held_out(name: str) -> bool:
    return hashlib.sha256(name.encode()).digest()[0] % 3 == 0


@dataclass(frozen=True)
class Row:
    name: str
    group: str  # 'megatron' (one GPU) or 'at_scale' (one rank of the plan's world, fake process group)
    plan: Plan  # as the job ran it
    result: dict[str, Any]
    impl: str  # 'transformer_engine' or 'local'
    held_out: bool
    device: str

    @property
    def part(self) -> str:
        return "held-out" if self.held_out else "fit"


def load(path: Path | None = None) -> list[Row]:
    path = path or RESULTS / FILE
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        res = r.get("result") or {}
        if r.get("status") != "ok" or not res:
            continue
        plan = as_ran(Plan.model_validate(r["plan"]), res).plan
        out.append(Row(r["name"], r["group"], plan, res, res.get("transformer_impl", plan.implementation.transformer_impl),
                       held_out(r["name"]), res.get("device", "?")))
    return out
