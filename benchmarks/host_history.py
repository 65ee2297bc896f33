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

import statistics
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "gpu"))

from report_multi import ran_plan  # noqa: E402  (benchmarks/gpu)
from throughput_accuracy import loop_rows  # noqa: E402

from mcore_advisor.launcher.as_ran import te_probe_ms  # noqa: E402
from mcore_advisor.physics.step_time import step_time  # noqa: E402

RESULTS = HERE / "results"
OUT = RESULTS / "host_history.txt"


def probed_rows() -> list[dict]:
    """Rows with a TE host probe (the cuBLASLt-cache-off rows aside), in run order per file, each with its machine's
    earlier probes (throughput_accuracy.loop_rows)."""
    return [{**r, "file": path.stem} for path in sorted(RESULTS.glob("gpu_*_runs.jsonl")) for r in loop_rows(path)
            if te_probe_ms(r["result"]) is not None and r["result"]["host"].get("cublaslt_heuristics_cache_capacity") != 0]


def _err(row: dict, others: list[float] | None) -> float:
    """Step error with the host as_ran takes from the job's probe and `others` of its machine (None: no probe read,
    the catalog's figure)."""
    if others is None:
        row = {**row, "result": {**row["result"], "host": {**row["result"]["host"], "probe": {"impl": "none"}}}}
    plan = ran_plan({**row, "machine_probes_ms": others or []})
    return 100.0 * (step_time(plan).iteration_time_s / row["result"]["iter_s"] - 1.0)


def _without_one(values: list[float], x: float) -> list[float]:
    out = list(values)
    out.remove(x)
    return out


def _error_against_probe(rows: list[dict]) -> list[str]:
    """How the step error (the machine's earlier probes pooled) moves with the probe figure the row is predicted on: a
    host cost that scales with the probe as the model says leaves no slope; a part that does not track the probe leaves
    the rows on slow readings predicted slow and the rows on fast ones fast."""
    name = "with the machine's earlier probes"
    out = ["", f"step error against the host figure it is predicted on ({name}): least-squares slope and correlation"]
    for label, sel in (("one GPU, MoE", lambda r: r["nproc"] == 1 and r["moe"]), ("one GPU, dense", lambda r: r["nproc"] == 1 and not r["moe"]),
                       ("several GPUs, MoE", lambda r: r["nproc"] > 1 and r["moe"]), ("several GPUs, dense", lambda r: r["nproc"] > 1 and not r["moe"])):
        pts = [(statistics.median([te_probe_ms(r["result"]), *r["machine_probes_ms"]]), r["errs"][name]) for r in rows if sel(r)]
        if len(pts) < 3:
            continue
        x, y = zip(*pts, strict=True)
        slope = statistics.linear_regression(x, y).slope
        out.append(f"  {label:22s} n={len(pts):3d}  {slope:+5.1f} points per ms  r = {statistics.correlation(x, y):+.2f}  "
                   f"(probes {min(x):.1f}-{max(x):.1f} ms)")
    return out


def main() -> None:
    rows = probed_rows()
    whole = defaultdict(list)
    for r in rows:
        whole[(r["file"], r.get("device_call"))].append(te_probe_ms(r["result"]))
    ways = {"the job's probe alone": lambda r: [],
            "with the machine's earlier probes": lambda r: r["machine_probes_ms"],
            "every probe of the machine": lambda r: _without_one(whole[(r["file"], r.get("device_call"))], te_probe_ms(r["result"])),
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
    lines += _error_against_probe(rows)
    lines += ["", "per row (step error %, same order as above; probe ms and the earlier probes of its machine)"]
    for r in rows:
        errs = " ".join(f"{v:+6.1f}" for v in r["errs"].values())
        lines.append(f"{r['name'][:40]:40s} {r['file'][4:24]:20s} {'held' if r.get('held_out') else '    '} {errs}  "
                     f"{te_probe_ms(r['result']):5.2f} {[round(x, 2) for x in r['machine_probes_ms']]}")
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:12]))


if __name__ == "__main__":
    main()
