"""Tool recommend_parallelism(request): searched, ranked and explained layouts (planning/recommend.py)."""

from __future__ import annotations

from mcore_advisor.planning.recommend import (
    FixedParallelism,
    Recommendation,
    RecommendRequest,
    default_global_batch_size,
    format_recommendation,
    layout_summary,
    recommend_parallelism,
    request_from_options,
)

__all__ = [
    "FixedParallelism", "RecommendRequest", "Recommendation", "default_global_batch_size", "format_recommendation",
    "layout_summary", "recommend_parallelism", "request_from_options",
]
