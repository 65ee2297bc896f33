"""Speed of evaluate_plan and of the vectorised step-time path (target: evaluate_plan < 5 ms on 405B).

    .venv/bin/python benchmarks/evaluate_speed.py      # writes benchmarks/results/evaluate_speed.txt
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics.layouts import LayoutBatch
from mcore_advisor.physics.memory import memory_breakdown
from mcore_advisor.physics.step_time import hardware_params, step_time, step_time_arrays
from mcore_advisor.schemas import ClusterSpec, ModelSpec, ParallelismSpec, Plan, TrainingSpec
from mcore_advisor.tools.evaluate import evaluate_plan
from mcore_advisor.validators import validate

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"

PLAN_405B = Plan(
    model=ModelSpec(name="llama3.1-405b"),
    cluster=ClusterSpec(gpu="h100-sxm", num_gpus=2048),
    training=TrainingSpec(seq_length=8192, global_batch_size=2048, micro_batch_size=1),
    parallelism=ParallelismSpec(tensor_model_parallel_size=8, pipeline_model_parallel_size=8,
                                virtual_pipeline_model_parallel_size=2, context_parallel_size=2,
                                sequence_parallel=True, tp_comm_overlap=True),
)


def timed(fn, n: int) -> tuple[float, float]:
    """(median, p95) milliseconds per call over n calls after a warm-up."""
    for _ in range(5):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return statistics.median(ts), ts[int(0.95 * (len(ts) - 1))]


def main() -> int:
    lines = [f"evaluate_plan speed (python {platform.python_version()}, {platform.machine()}, numpy {np.__version__})", ""]
    for name, fn in [
        ("evaluate_plan(Llama-3.1-405B, TP8 PP8 VP2 CP2, 2048 H100)", lambda: evaluate_plan(PLAN_405B)),
        ("  validators.validate", lambda: validate(PLAN_405B)),
        ("  memory.memory_breakdown", lambda: memory_breakdown(PLAN_405B)),
        ("  perf.step_time", lambda: step_time(PLAN_405B)),
    ]:
        med, p95 = timed(fn, 300)
        lines.append(f"{name:60s} median {med:6.3f} ms   p95 {p95:6.3f} ms")
    ok = timed(lambda: evaluate_plan(PLAN_405B), 300)[0] < 5.0

    # Vectorised path: every (TP, PP, VP, CP, mbs, SP, recompute) candidate on 2048 GPUs at once.
    shape = resolve_model(PLAN_405B.model)
    hw = hardware_params(PLAN_405B.cluster)
    grid = np.array(np.meshgrid([1, 2, 4, 8], [1, 2, 4, 8, 16], [1, 2], [1, 2, 4], [1, 2], [0, 1], [0, 1, 2], indexing="ij")).reshape(7, -1)
    tp, pp, vp, cp, mbs, sp, rc = grid
    dp = 2048 // (tp * pp * cp)
    n = tp.size
    t0 = time.perf_counter()
    reps = 20
    for _ in range(reps):
        batch = LayoutBatch(shape, 8192, 2048, tp=tp, pp=pp, dp=dp, cp=cp, vp=vp, micro_batch_size=mbs,
                            sequence_parallel=sp, recompute=rc)
        r = step_time_arrays(batch, hw)
    dt = (time.perf_counter() - t0) / reps
    lines += [
        "",
        f"step_time_arrays: {n} layouts in {dt * 1e3:.2f} ms = {n / dt:,.0f} layouts/s "
        f"(best predicted {np.nanmax(r['tokens_per_s_per_gpu']):.0f} tokens/s/GPU, before memory/validity filtering)",
        "",
        f"target evaluate_plan < 5 ms: {'met' if ok else 'NOT met'}",
    ]
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "evaluate_speed.txt").write_text(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
