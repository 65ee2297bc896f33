"""One place for the matplotlib set-up: the Agg backend (no display), a fixed size, PNG bytes out."""

from __future__ import annotations

import io
from typing import Any

import matplotlib

matplotlib.use("Agg", force=True)

import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

WIDTH_IN, HEIGHT_IN, DPI = 9.0, 5.0, 100
COLORS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
          "#9c755f", "#bab0ac", "#86bcb6", "#d37295", "#8cd17d")


def figure(nrows: int = 1, ncols: int = 1, **kw: Any):
    return plt.subplots(nrows, ncols, figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI, **kw)


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()
