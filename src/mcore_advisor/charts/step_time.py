"""Where one training step's time goes: the step-time model's terms (they sum to the step)."""

from __future__ import annotations

from typing import Any

from mcore_advisor.charts._figure import COLORS, figure, png


def step_time_png(evaluation: Any, title: str = "") -> bytes:
    """`evaluation`: evaluate_plan's Evaluation (or a PerfEstimate)."""
    perf = getattr(evaluation, "performance", evaluation)
    if perf is None:
        raise ValueError("plan: no step-time prediction for a plan the validators reject; fix its error findings first")
    terms = [(k.removesuffix("_s"), v) for k, v in perf.breakdown.model_dump().items() if v > 0]
    terms.sort(key=lambda kv: kv[1])
    step = perf.iteration_time_s
    fig, ax = figure()
    names = [k.replace("_", " ") for k, _ in terms]
    vals = [v for _, v in terms]
    ax.barh(names, vals, color=[COLORS[i % len(COLORS)] for i in range(len(vals))])
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.3f} s ({100 * v / step:.0f}%)", va="center", fontsize=8)
    ax.set_xlim(0, max(vals) * 1.3)
    ax.set_xlabel("seconds per step")
    ax.set_title(title or f"step {step:.3f} s: {perf.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
                 f"{perf.model_tflops_per_gpu_causal:.0f} TFLOP/s/GPU causal, MFU {perf.mfu_bf16_causal_pct:.1f}%")
    return png(fig)
