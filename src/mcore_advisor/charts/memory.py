"""Per-GPU memory by term for each pipeline stage the memory model evaluates, against capacity."""

from __future__ import annotations

from typing import Any

from mcore_advisor.charts._figure import COLORS, figure, png

GIB = 2**30
# StageMemory's byte terms, bottom to top
TERMS = ("weights", "gradients", "optimizer", "activations", "transient", "buffers")


def memory_png(report: Any, title: str = "") -> bytes:
    """`report`: estimate_memory's MemoryReport (or evaluate_plan's MemoryBreakdown)."""
    bd = getattr(report, "breakdown", report)
    stages = sorted(bd.stages, key=lambda s: s.pipeline_rank)
    fig, ax = figure()
    labels = [f"rank {s.pipeline_rank}\n({s.role}, {s.num_layers} layers)" for s in stages]
    bottoms = [0.0] * len(stages)
    for term, color in zip(TERMS, COLORS, strict=False):
        vals = [getattr(s, f"{term}_bytes") / GIB for s in stages]
        ax.bar(labels, vals, bottom=bottoms, color=color, label=term)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    # fragmentation and CUDA context + NCCL are modelled for the most-loaded rank only
    top = next(i for i, s in enumerate(stages) if s.pipeline_rank == bd.most_loaded_pipeline_rank)
    peak = stages[top].peak_allocated_bytes / GIB
    for name, val, color in (("fragmentation", bd.fragmentation_gib, COLORS[6]),
                             ("CUDA context + NCCL", bd.non_pytorch_gib, COLORS[7])):
        ax.bar([labels[top]], [val], bottom=[peak], color=color, hatch="//", label=name)
        peak += val
    ax.axhline(bd.capacity_gib, color="black", linestyle="--", linewidth=1)
    ax.text(len(stages) - 0.5, bd.capacity_gib, f"capacity {bd.capacity_gib:.0f} GiB", ha="right", va="bottom")
    verdict = "fits" if bd.fits else "DOES NOT FIT"
    ax.set_title(title or f"per-GPU memory: {bd.total_gib:.1f} of {bd.capacity_gib:.1f} GiB on pipeline rank "
                 f"{bd.most_loaded_pipeline_rank} ({verdict})")
    ax.set_ylabel("GiB")
    ax.set_ylim(0, max(bd.capacity_gib, peak) * 1.12)
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    return png(fig)
