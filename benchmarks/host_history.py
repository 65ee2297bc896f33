"""Which host figure predicts a profile job's step best: its own probe, or the median with its machine's earlier probes.

Run:  .venv/bin/python benchmarks/host_history.py   (writes benchmarks/results/host_history.txt)

Every stored row of Megatron-LM's own loop whose job probed the host with Transformer Engine
(launcher/entry/host_probe.py; the cuBLASLt-cache-off rows aside) is predicted four ways, the rest of
the plan as it ran (launcher/as_ran.py): the job's probe alone; the median with the probes of the jobs
that ran before it on the same machine (as_ran.earlier_machine_probes, what get_job and the accuracy
scripts use; rows from before s14 name no host, so one results file and device call is one machine);
the median of every probe of that machine, later jobs included (no tool has those when it predicts);
and the GPU catalog's VM figure. No figure is chosen on these rows: the pooling has no constant.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "gpu"))

from report_multi import ran_plan, with_machine_probes  # noqa: E402  (benchmarks/gpu)

from mcore_advisor.launcher.as_ran import machine_key  # noqa: E402
from mcore_advisor.physics.step_time import step_time  # noqa: E402

RESULTS = HERE / "results"
OUT = RESULTS / "host_history.txt"


def probed_rows() -> list[dict]:
    """Rows with a TE host probe, in run order per file, each with its machine's earlier probes."""
    out = []
    for path in sorted(RESULTS.glob("gpu_*_runs.jsonl")):
        kept = []
        for line in path.read_text().splitlines():
            r = json.loads(line) if line.strip() else {}
            res = r.get("result") or {}
            if r.get("status") == "ok" and isinstance(res.get("megatron"), dict) and res.get("mode") == "profile" \
                    and res.get("iter_s") and (res.get("host") or {}).get("cublaslt_heuristics_cache_capacity") != 0:
                kept.append({**r, "plan": r.get("plan_requested") or r["plan"], "file": path.stem})
        machines = [(path.stem, r.get("device_call")) for r in kept]
        out += [r for r in with_machine_probes(kept, machines) if machine_key(r["result"], "x") is not None]
    return out


def _err(row: dict, probes: list[float] | None) -> float:
    """Step error with the host set from `probes` (their median; None: the catalog's figure)."""
    if probes is None:
        row = {**row, "result": {**row["result"], "host": {**row["result"]["host"], "probe": {"impl": "none"}}}}
        plan = ran_plan({**row, "machine_probes_ms": []})
    else:
        own = statistics.median(probes)
        res = {**row["result"], "host": {**row["result"]["host"], "probe": {**row["result"]["host"]["probe"], "ms_per_layer": own}}}
        plan = ran_plan({**row, "result": res, "machine_probes_ms": []})
    return 100.0 * (step_time(plan).iteration_time_s / row["result"]["iter_s"] - 1.0)


def main() -> None:
    rows = probed_rows()
    whole = defaultdict(list)
    for r in rows:
        whole[(r["file"], r.get("device_call"))].append(r["result"]["host"]["probe"]["ms_per_layer"])
    ways = {"the job's probe alone": lambda r: [r["result"]["host"]["probe"]["ms_per_layer"]],
            "with the machine's earlier probes": lambda r: [r["result"]["host"]["probe"]["ms_per_layer"], *r["machine_probes_ms"]],
            "every probe of the machine": lambda r: whole[(r["file"], r.get("device_call"))],
            "the GPU catalog's (no probe)": lambda r: None}
    for r in rows:
        r["errs"] = {name: _err(r, way(r)) for name, way in ways.items()}
        r["moe"] = bool(r["plan"]["model"].get("num_experts"))
    groups = {"every row": lambda r: True, "held-out third": lambda r: r.get("held_out"), "other rows": lambda r: not r.get("held_out"),
              "MoE": lambda r: r["moe"], "dense": lambda r: not r["moe"],
              "one GPU": lambda r: r["nproc"] == 1, "several GPUs": lambda r: r["nproc"] > 1}
    lines = [__doc__.split("\n\n")[0], "", f"{len(rows)} rows on {len(whole)} machines; median |step error| and rows off by more than 20%", ""]
    lines.append(f"{'host figure':36s}" + "".join(f"{g:>22s}" for g in groups))
    for name in ways:
        cells = []
        for sel in groups.values():
            e = [abs(r["errs"][name]) for r in rows if sel(r)]
            cells.append(f"{statistics.median(e):5.1f}% {sum(x > 20 for x in e):3d}/{len(e):<3d}")
        lines.append(f"{name:36s}" + "".join(f"{c:>22s}" for c in cells))
    lines += ["", "per row (step error %, same order as above; probe ms and the earlier probes of its machine)"]
    for r in rows:
        errs = " ".join(f"{v:+6.1f}" for v in r["errs"].values())
        lines.append(f"{r['name'][:40]:40s} {r['file'][4:24]:20s} {'held' if r.get('held_out') else '    '} {errs}  "
                     f"{r['result']['host']['probe']['ms_per_layer']:5.2f} {[round(x, 2) for x in r['machine_probes_ms']]}")
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:12]))


if __name__ == "__main__":
    main()
