"""Per-call host time of TE's GroupedLinear forward and backward (and the FP8 padding around it) in rank-0
torch.profiler traces of Megatron-LM's own loop: what FP8 adds per local expert over bf16, in the step-time
model's host units at each row's own host probe (issue 15; physics/moe.FP8_*_PER_EXPERT_HOST_KERNELS).

    python3 benchmarks/gpu/grouped_linear_trace.py RESULTS_JSONL LOCAL_EXPERTS NAME=TRACE [NAME=TRACE ...] > out.json

The first NAME is the bf16 baseline; each trace is the row's rank-0 trace (.json.gz).
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys

sys.path.insert(0, "src")
from mcore_advisor.physics import step_time as stm  # noqa: E402

OPS = {"forward": "_GroupedLinear", "backward": "autograd::engine::evaluate_function: _GroupedLinearBackward"}


def per_call_us(trace: str) -> dict[str, float]:
    ev = [e for e in json.load(gzip.open(trace))["traceEvents"] if e.get("ph") == "X"]
    return {k: statistics.mean(e["dur"] for e in ev if e.get("name") == n) for k, n in OPS.items()}


def unit_ms(probe_ms: float) -> dict[str, float]:
    """One host unit's milliseconds at this probe (step_time.host_unit_s)."""
    unit_f, unit_b = stm.host_unit_s(stm.host_floor_from_probe(probe_ms))
    return {"forward": unit_f, "backward": unit_b}


def main(argv: list[str]) -> int:
    results, local = argv[0], int(argv[1])
    probes = {r["name"]: r["result"]["host"]["probe"]["ms_per_layer"] for r in map(json.loads, open(results))
              if (r.get("result") or {}).get("host")}
    rows = {}
    for pair in argv[2:]:
        name, trace = pair.split("=", 1)
        calls, unit = per_call_us(trace), unit_ms(probes[name])
        rows[name] = {"probe_ms": probes[name], "per_call_us": calls,
                      "per_call_units": {k: calls[k] / 1e3 / unit[k] for k in OPS}}
    base = next(iter(rows.values()))["per_call_units"]
    for r in rows.values():  # two GroupedLinear calls (fc1, fc2) per layer and micro-batch
        r["extra_units_per_expert"] = {k: 2.0 * (r["per_call_units"][k] - base[k]) / local for k in OPS}
    json.dump({"local_experts": local, "rows": rows, "source": __doc__.split("\n\n")[0]}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
