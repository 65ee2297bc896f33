"""check_mfu on real profile-job logs: is the top-ranked fix a measured improvement?

For every measured GPU run (benchmarks/results/gpu_*.jsonl: plan + Megatron-format train.log, H200,
megatron-core 0.19.2), run check_mfu on its log and plan, take the top-ranked speed fix, and look
for a measured run of exactly the fixed plan in the same files. Where one exists, print predicted
vs measured gain. Rerun: `.venv/bin/python benchmarks/diagnose_gpu_logs.py`; writes
benchmarks/results/diagnose_gpu_logs.txt.
"""

from __future__ import annotations

import json
from pathlib import Path

from mcore_advisor.schemas import Plan
from mcore_advisor.tools.mfu import MfuRequest, check_mfu

RESULTS = Path(__file__).parent / "results"
FILES = ("gpu_h200_runs.jsonl", "gpu_memory_sweep.jsonl", "gpu_recommend_sweep.jsonl")


def _key(plan: Plan) -> str:
    d = plan.model_dump(mode="json")
    d["model"].pop("name", None)
    return json.dumps(d, sort_keys=True)


def main() -> None:
    runs = []
    for name in FILES:
        path = RESULTS / name
        if path.exists():
            runs += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    ok = [r for r in runs if r.get("status") == "ok" and r.get("train_log")]
    measured = {_key(Plan.model_validate(r["plan"])): r for r in ok}
    lines = ["check_mfu's top-ranked fix on real H200 profile-job logs, vs a measured run of the fixed plan", ""]
    checked = improved = 0
    for r in ok:
        plan = Plan.model_validate(r["plan"])
        rep = check_mfu(MfuRequest(plan=plan, log_text=r["train_log"], gpu="h200"))
        diag = rep.diagnosis
        if diag is None or not diag.fixes:
            continue
        top = diag.fixes[0]
        target = measured.get(_key(top.plan))
        tok_before = r["result"]["tokens_per_s_per_gpu"]
        label = f"{r['name']:32} MFU {rep.mfu_causal_pct:5.1f}% (causal)  top fix: {top.change}"
        if target is None:
            lines.append(f"{label}\n    predicted {top.predicted_throughput_change_pct:+.1f}% tokens/s; no measured run of the fixed plan")
            continue
        tok_after = target["result"]["tokens_per_s_per_gpu"]
        gain = 100 * (tok_after / tok_before - 1)
        checked += 1
        improved += gain > 0
        lines.append(f"{label}\n    predicted {top.predicted_throughput_change_pct:+.1f}% tokens/s, measured {gain:+.1f}% "
                     f"({tok_before:,.0f} -> {tok_after:,.0f} tokens/s/GPU, run {target['name']})")
    lines += ["", f"top fixes with a measured counterpart: {checked}; measured improvement in {improved} of them"]
    text = "\n".join(lines) + "\n"
    (RESULTS / "diagnose_gpu_logs.txt").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
