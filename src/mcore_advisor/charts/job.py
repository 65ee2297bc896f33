"""A profile job's measured figures next to the prediction, and its step times."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mcore_advisor.charts._figure import COLORS, figure, png


def job_png(comparison: Sequence[Mapping[str, Any]], step_times_s: Sequence[float] = (),
            predicted_step_s: float | None = None, title: str = "") -> bytes:
    """`comparison`: get_job's rows {figure, measured, predicted, error_pct}; `step_times_s`: every
    iteration's time (result.json's step_times_s)."""
    rows = [r for r in comparison if r.get("measured") is not None and r.get("predicted") is not None]
    if not rows and not step_times_s:
        raise ValueError("job_id: the job has no measured figures yet; wait until get_job shows it COMPLETED")
    fig, (left, right) = figure(1, 2)
    for i, r in enumerate(rows):
        # each figure on its own scale: measured = 1
        left.bar(i - 0.2, 1.0, 0.4, color=COLORS[0], label="measured" if i == 0 else None)
        left.bar(i + 0.2, r["predicted"] / r["measured"], 0.4, color=COLORS[1], label="predicted" if i == 0 else None)
        err = r.get("error_pct")
        left.text(i + 0.2, r["predicted"] / r["measured"], f"{err:+.1f}%" if err is not None else "", ha="center", va="bottom", fontsize=8)
    left.set_xticks(range(len(rows)), [r["figure"].replace("_", " ") for r in rows], rotation=20, fontsize=8)
    top = max([1.0] + [r["predicted"] / r["measured"] for r in rows])
    left.set_ylim(0, top * 1.3)  # room for the legend above the bars
    left.set_ylabel("predicted / measured")
    left.set_title("measured vs predicted")
    if rows:
        left.legend(fontsize=8, loc="upper left", ncol=2)
    if step_times_s:
        right.plot(range(1, len(step_times_s) + 1), list(step_times_s), marker="o", color=COLORS[0], label="measured")
        if predicted_step_s is not None:
            right.axhline(predicted_step_s, color=COLORS[1], linestyle="--", label=f"predicted {predicted_step_s:.3f} s")
        right.set_xlabel("iteration")
        right.set_ylabel("step time, s")
        right.legend(fontsize=8)
    right.set_title("step times")
    if title:
        fig.suptitle(title)
    return png(fig)
