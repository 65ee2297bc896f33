"""PNG charts of the core's answers (matplotlib, Agg): data in, PNG bytes out, no files, no I/O.

- memory_png(report): per-GPU memory by term for each pipeline stage, against the GPU's capacity
- step_time_png(evaluation): where one training step's time goes
- job_png(comparison, step_times_s, predicted_step_s): a profile job's measured vs predicted figures
- pipeline_png(plan, evaluation): the pipeline schedule (1F1B or interleaved) with its bubble

Imported by the MCP server (image content) and the CLI (`--png FILE`); imports only the core.
"""

from mcore_advisor.charts.job import job_png
from mcore_advisor.charts.memory import memory_png
from mcore_advisor.charts.pipeline import pipeline_png, schedule
from mcore_advisor.charts.step_time import step_time_png

__all__ = ["job_png", "memory_png", "pipeline_png", "schedule", "step_time_png"]
