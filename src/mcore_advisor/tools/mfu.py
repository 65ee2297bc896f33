"""Tool check_mfu(request): MFU/HFU from a log or figures, and the low-MFU / OOM diagnoses (diagnosis/mfu.py)."""

from __future__ import annotations

from mcore_advisor.diagnosis.mfu import MfuReport, MfuRequest, check_mfu

__all__ = ["MfuReport", "MfuRequest", "check_mfu"]
