"""Multi-GPU evidence (issue 20) re-scored by the model at this commit: every stored multi-GPU row.

Run:  .venv/bin/python benchmarks/multi_gpu_accuracy.py   (writes benchmarks/results/multi_gpu_accuracy.txt)

benchmarks/gpu/report_multi.py scores a lease's rows when they come back from the device; this script
re-predicts every row kept in benchmarks/results/gpu_<gpu>x<N>*_runs.jsonl (Megatron-LM's own loop on
2-4 GPUs; each row keeps the plan it was asked for and the job's result.json) with the code at this
commit, for the plan as the job ran it (launcher/as_ran.py: its host probe and routing record
included), so a model change is scored on every lease at once. Held out: crc32(name) % 3 == 0, fixed
before the runs (configs_multi.py); held-out rows never choose a constant.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "gpu"))

from report_multi import real_row, with_machine_probes  # noqa: E402  (benchmarks/gpu)

RESULTS = HERE / "results"
OUT = RESULTS / "multi_gpu_accuracy.txt"


def rows() -> list[tuple[str, dict]]:
    """Every multi-GPU row, with the earlier host probes of its machine (a row without a hostname: its file and call)."""
    out = []
    for path in sorted(RESULTS.glob("gpu_*x[0-9]*_runs.jsonl")):
        kept = []
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r.get("status") == "ok" and r.get("group", "multi") == "multi" and (r.get("result") or {}).get("iter_s"):
                kept.append({**r, "plan": r.get("plan_requested") or r["plan"]})
        machines = [(path.stem, r.get("device_call")) for r in kept]
        out += [(path.stem.removesuffix("_runs"), r) for r in with_machine_probes(kept, machines)]
    return out


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):5.1f}%" if xs else "   - "


def score(scored: list[tuple[str, dict]], label: str) -> list[str]:
    lines = [f"  {label}"]
    for part, keep in (("held-out third", True), ("other rows", False)):
        sel = [r for _, r in scored if r["held_out"] == keep]
        step = [abs(r["step_error_pct"]) for r in sel if r.get("step_error_pct") is not None]
        mem = [max(abs(e) for e in r["memory_error_pct_per_rank"]) for r in sel if r.get("memory_error_pct_per_rank")]
        within = sum(m <= 5.0 for m in mem)
        lines.append(f"    {part:15s} n={len(sel):3d}  step median |err| {_median(step)}  "
                     f"memory (worst rank) median |err| {_median(mem)}  every rank within 5%: {within}/{len(mem)}")
    return lines


def main() -> None:
    scored = [(s, real_row(r, r.get("device_call", "?"))) for s, r in rows()]
    lines = [__doc__.split("\n\n")[0], "", "row                                         set                held  step err %  worst-rank memory err %"]
    for s, r in scored:
        mem = max(r.get("memory_error_pct_per_rank") or [0.0], key=abs)
        lines.append(f"{r['name'][:43]:43s} {s[:18]:18s} {'yes' if r['held_out'] else '   '}  "
                     f"{r['step_error_pct']:+9.1f}  {mem:+8.2f}")
    lines += ["", "summary:"]
    for s in sorted({s for s, _ in scored}):
        lines += score([x for x in scored if x[0] == s], s)
    probe = [x for x in scored if x[0] in ("gpu_h100x4_L", "gpu_h100x2_R", "gpu_h100x2_S", "gpu_h100x2_R2", "gpu_h100x4_M", "gpu_h200x4_C", "gpu_h100x4_C", "gpu_h100x4_V", "gpu_h200x2_T", "gpu_h200x2_E", "gpu_h200x2_R3", "gpu_h200x4_W", "gpu_h200x2_O2")]
    lines += score(probe, "sets with the job's host probe (L, R, S, R2, M, C, V, T, E, R3, W, O2)")
    # without Transformer Engine the job's probe times torch modules, which as_ran does not read: the N set is
    # predicted on the catalog's host figure, as a user's plan is
    lines += score([x for x in scored if x[0] in ("gpu_h100x4_N", "gpu_h100x4_N2", "gpu_h200x4_G", "gpu_h200x2_P", "gpu_h200x2_P2", "gpu_h200x4_Q")],
                   "Megatron-LM without Transformer Engine (N, N2 on H100; G, P, P2, Q on H200), the catalog's host figure")
    lines += score(scored, "every multi-GPU row")
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-30:]))


if __name__ == "__main__":
    main()
