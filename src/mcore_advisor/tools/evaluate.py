"""Tool evaluate_plan(plan): validation + memory + performance of one plan (physics/evaluate.py)."""

from __future__ import annotations

from mcore_advisor.physics.evaluate import Evaluation, ParallelSummary, evaluate_plan

__all__ = ["Evaluation", "ParallelSummary", "evaluate_plan"]
