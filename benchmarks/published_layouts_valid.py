"""Is every published layout that ran on 80 GB H100s valid and predicted to fit? (issue 16, part 3)

For each row of ../shared/data/published-runs-dev.csv on an 80 GB H100 (the same rows as the packaged
knowledge/data/published_runs.csv, matched by source, model and layout), the plan that
knowledge.runs.plan_for_run builds is validated (validators.validate: its errors) and its memory
predicted (physics.memory.memory_breakdown: fits, headroom). A layout that ran is never invalid, so
every error listed here is a bug in the validators or in the plan the row becomes. Settings the row's
recipe states but its table leaves out (knowledge/data/run_recipes.json, each with its citation) are
listed under the row.

    .venv/bin/python benchmarks/published_layouts_valid.py   # writes benchmarks/results/published_layouts_valid.txt
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from mcore_advisor.knowledge.hardware import gpu
from mcore_advisor.knowledge.runs import plan_for_run, published_runs, run_recipes
from mcore_advisor.physics.memory import memory_breakdown
from mcore_advisor.validators import validate

ROOT = Path(__file__).resolve().parent
DEV_CSV = ROOT.parent.parent / "shared" / "data" / "published-runs-dev.csv"
OUT = ROOT / "results" / "published_layouts_valid.txt"
# Columns that identify a row in both tables (the packaged one adds flop_convention).
_KEY = ("source", "model", "num_gpus", "tp", "pp", "cp", "ep", "vp", "mbs", "gbs", "recompute", "seq_len")


def _dev_keys(path: Path) -> list[tuple[str, ...]]:
    with path.open(encoding="utf-8") as f:
        return [tuple(r[k] for k in _KEY) for r in csv.DictReader(f)]


def _run_key(run) -> tuple[str, ...]:
    vals = (run.source, run.model, run.num_gpus, run.tensor_model_parallel_size, run.pipeline_model_parallel_size,
            run.context_parallel_size, run.expert_model_parallel_size, run.virtual_pipeline_model_parallel_size,
            run.micro_batch_size, run.global_batch_size, run.recompute, run.seq_length)
    return tuple("" if v is None else str(v) for v in vals)


def _is_h100_80gb(run) -> bool:
    return run.gpu is not None and run.gpu.startswith("h100") and gpu(run.gpu).hbm_capacity_gib > 70


def _row_lines(run) -> tuple[list[str], str, bool]:
    """Report lines for one row, its status ('no plan', 'rejected' or 'valid') and whether it fits."""
    head = (f"{run.source} | {run.model} | {run.num_gpus} GPUs TP{run.tensor_model_parallel_size} "
            f"PP{run.pipeline_model_parallel_size} CP{run.context_parallel_size} EP{run.expert_model_parallel_size} "
            f"VP{run.virtual_pipeline_model_parallel_size} mbs{run.micro_batch_size} gbs{run.global_batch_size} "
            f"recompute={run.recompute!r}")
    rp = plan_for_run(run)
    if rp is None:
        return [head, "    no plan: the row lacks what a Plan needs"], "no plan", False
    errors = [f for f in validate(rp.plan) if f.severity == "error"]
    mem = memory_breakdown(rp.plan)
    lines = [head, f"    memory: {mem.total_gib:.1f} GiB of {mem.capacity_gib:.1f} "
                   f"({'fits' if mem.fits else 'OVER'}, headroom {mem.headroom_gib:+.1f} GiB)"]
    # what the row's recipe adds to its table (knowledge/data/run_recipes.json), so a reader sees why it fits
    recipe = {k: v for r in run_recipes() if r.applies(run) for k, v in r.args.items()}
    lines += [f"    recipe: {', '.join(f'{k}={v}' for k, v in recipe.items())}"] if recipe else []
    lines += [f"    ERROR {f.code}: {f.message}" for f in errors]
    return lines, "rejected" if errors else "valid", mem.fits


def main() -> int:
    dev = set(_dev_keys(DEV_CSV)) if DEV_CSV.exists() else None
    runs = [r for r in published_runs() if _is_h100_80gb(r) and (dev is None or _run_key(r) in dev)]
    out, status, over = [], {"valid": 0, "rejected": 0, "no plan": 0}, 0
    for run in runs:
        lines, st, fits = _row_lines(run)
        status[st] += 1
        over += st != "no plan" and not fits
        out += lines
    src = "../shared/data/published-runs-dev.csv" if dev is not None else "knowledge/data/published_runs.csv"
    summary = [f"Published layouts on 80 GB H100 ({src}): {len(runs)} rows",
               f"valid: {status['valid']}; rejected by the validators: {status['rejected']}; no plan (the row "
               f"publishes no layout or shape): {status['no plan']}; planned but predicted not to fit: {over}", ""]
    text = "\n".join(summary + out) + "\n"
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text, encoding="utf-8")
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
