"""The plan as a profile job actually ran it.

The profile entry falls back where the machine lacks a feature (the local layer spec without
Transformer Engine, Megatron's own output layer without Apex's fused weight-gradient GEMM) and records
what it used in result.json (`transformer_impl`, `settings`). Measured figures are only comparable
with a prediction for that plan, so get_job and the accuracy benchmarks predict for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mcore_advisor.schemas import Plan, with_changes


@dataclass(frozen=True)
class AsRan:
    plan: Plan
    output_layer_wgrad_fusion: bool | None = None
    """None: as the plan says (Megatron-LM); False: only the TE layers fused (no Apex where it ran)."""
    differences: list[str] = field(default_factory=list)


def as_ran(plan: Plan, result: Mapping[str, Any] | None) -> AsRan:
    """`plan` with the implementation choices the job's result.json says it used."""
    if not result:
        return AsRan(plan)
    im = plan.implementation
    changes: dict[str, Any] = {}
    diffs: list[str] = []
    ran_impl = result.get("transformer_impl")
    if ran_impl in ("local", "transformer_engine") and ran_impl != im.transformer_impl:
        changes["transformer_impl"] = ran_impl
        diffs.append(f"transformer_impl {ran_impl} (the plan asked for {im.transformer_impl})")
    settings = result.get("settings") or {}
    ce = settings.get("cross_entropy_loss_fusion")
    if isinstance(ce, bool) and ce != im.cross_entropy_loss_fusion:
        changes["cross_entropy_loss_fusion"] = ce
        diffs.append(f"cross_entropy_loss_fusion {ce}")
    if isinstance(ce, bool) and ce and im.cross_entropy_fusion_impl != "native":
        changes["cross_entropy_fusion_impl"] = "native"  # the entry always uses Megatron's own
        diffs.append("cross_entropy_fusion_impl native")
    out_fused: bool | None = None
    if "gradient_accumulation_fusion" in settings:
        gaf = settings["gradient_accumulation_fusion"]
        if bool(gaf) != im.gradient_accumulation_fusion:
            changes["gradient_accumulation_fusion"] = bool(gaf)
            diffs.append(f"gradient_accumulation_fusion {bool(gaf)}")
        if gaf == "TE layers":
            out_fused = False
            diffs.append("output layer without wgrad fusion (no Apex where the job ran)")
    return AsRan(with_changes(plan, "implementation", **changes) if changes else plan, out_fused, diffs)
