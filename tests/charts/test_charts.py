"""The charts: PNG bytes that decode, at the stated size, with something drawn; the pipeline
simulation reproduces the bubble formula the step-time model uses."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from mcore_advisor.charts import job_png, memory_png, pipeline_png, schedule, step_time_png
from mcore_advisor.charts.pipeline import bubble_fraction
from mcore_advisor.physics.step_time import pipeline_bubble_fraction
from mcore_advisor.schemas import Plan
from mcore_advisor.tools.estimate_memory import estimate_memory
from mcore_advisor.tools.evaluate import evaluate_plan

PLAN = Plan.model_validate({
    "model": {"name": "llama3-8b"}, "cluster": {"num_gpus": 16},
    "training": {"seq_length": 4096, "global_batch_size": 64},
    "parallelism": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4,
                    "virtual_pipeline_model_parallel_size": 2, "sequence_parallel": True},
})


def _drawn(png: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(png))
    assert im.format == "PNG" and im.size == (900, 500)
    colors = im.convert("RGB").getcolors(maxcolors=100_000)
    assert colors is not None and len(colors) > 50  # more than a blank canvas with a frame
    return im


@pytest.mark.parametrize(("pp", "vp", "m"), [(2, 1, 1), (4, 1, 8), (4, 1, 3), (8, 1, 64), (4, 2, 8), (8, 5, 16), (4, 3, 12)])
def test_the_simulated_schedule_idles_exactly_the_bubble_formula(pp, vp, m):
    # equal stages, free communication: idle = (pp - 1) / (vp * m) of the ideal time (Narayanan et al. 2021)
    ops = schedule(pp, vp, m, forward_s=1.0, backward_s=2.0)
    assert len(ops) == 2 * pp * vp * m
    assert bubble_fraction(ops, m, 1.0, 2.0) == pytest.approx(pipeline_bubble_fraction(pp, vp, m))


def test_1f1b_runs_pp_minus_rank_minus_1_warmup_forwards_then_alternates():
    ops = schedule(4, 1, 8, 1.0, 2.0)
    for rank in range(4):
        kinds = "".join(o.kind for o in sorted((o for o in ops if o.rank == rank), key=lambda o: o.start))
        warm = 4 - rank - 1
        assert kinds == "F" * warm + "FB" * (8 - warm) + "B" * warm
    with pytest.raises(ValueError, match="divisible by pp"):
        schedule(4, 2, 6, 1.0, 2.0)


def test_charts_of_a_plan_are_drawn():
    ev = evaluate_plan(PLAN)
    _drawn(memory_png(estimate_memory(PLAN)))
    _drawn(step_time_png(ev))
    _drawn(pipeline_png(ev))
    with pytest.raises(ValueError, match="pp=1"):
        pipeline_png(evaluate_plan(PLAN.model_copy(update={"parallelism": PLAN.parallelism.model_copy(
            update={"pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None})})))


def test_job_chart_needs_measured_figures():
    rows = [{"figure": "iteration_time_s", "measured": 1.25, "predicted": 1.20, "error_pct": -4.0},
            {"figure": "tokens_per_s_per_gpu", "measured": 800.0, "predicted": 833.3, "error_pct": 4.2},
            {"figure": "peak_allocated_gib", "measured": None, "predicted": 30.0, "error_pct": None}]
    _drawn(job_png(rows, [1.4, 1.26, 1.25, 1.24], 1.2, "job abc"))
    with pytest.raises(ValueError, match="no measured figures"):
        job_png([], [])
