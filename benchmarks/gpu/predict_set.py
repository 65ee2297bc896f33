"""Predict every row of a spec file before it runs: the plan as requested at given host figures.

    .venv/bin/python benchmarks/gpu/predict_set.py benchmarks/gpu/specs_multi_Z.jsonl --host 4.7 5.5 6.3

Prints one line per row (iteration seconds at each host figure, the host-bound share at the first, the
largest MoE part) so a set's predictions are on record with its commit before the GPU sees it; the
report (report_multi.py) re-predicts each row as it ran (launcher/as_ran.py: the job's own host probe).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from mcore_advisor.physics.step_time import step_time
from mcore_advisor.schemas import Plan


def _at_host(plan: Plan, ms: float) -> Plan:
    return plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"host_floor_ms_per_layer": ms})})


def lines(specs: Path, hosts: list[float]) -> list[str]:
    out = [f"{'row':40s} " + " ".join(f"iter_s@{h:<4}" for h in hosts) + "  host share  largest MoE part"]
    for row in map(json.loads, specs.read_text().splitlines()):
        plan = Plan.model_validate(row["spec"]["plan"])
        perf = [step_time(_at_host(plan, h)) for h in hosts]
        first = perf[0]
        share = first.breakdown.host_bound_s / first.iteration_time_s
        part = first.moe_dominant_part or "-"
        out.append(f"{row['name']:40s} " + " ".join(f"{p.iteration_time_s:10.3f}" for p in perf)
                   + f"  {share:9.0%}  {part}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", type=Path)
    ap.add_argument("--host", type=float, nargs="+", default=[5.5], help="host_floor_ms_per_layer figures")
    a = ap.parse_args()
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    print(f"{a.specs.name}: predicted at commit {commit} by physics.step_time, plans as requested, h100-sxm")
    print("\n".join(lines(a.specs, a.host)))


if __name__ == "__main__":
    main()
