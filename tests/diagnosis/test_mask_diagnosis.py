"""check_mfu on a real Megatron-LM log of a CP4 16k run with the data loader's default attention mask.

The log is the profile job's train.log of M_cp4_s16k on 4 x H100 (session s8); its twin without the mask
(M_cp4_s16k_nomask, same lease) ran 0.357 s per step against 0.574 s: 60.8% more throughput.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcore_advisor.diagnosis.mfu import MfuRequest, check_mfu

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
LOGS = RESULTS / "gpu_logs" / "s8_multi"


def _measured(name: str) -> float:
    for line in (RESULTS / "gpu_h100x4_M_runs.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["name"] == name:
            return row["result"]["iter_s"]
    raise KeyError(name)


def test_the_mask_is_read_from_the_log_and_ranked_first():
    r = check_mfu(MfuRequest(log_text=(LOGS / "M_cp4_s16k" / "train.log").read_text(), gpu="h100-sxm"))
    assert r.plan_source == "log_arguments" and r.plan.implementation.create_attention_mask_in_dataloader
    d = r.diagnosis
    assert "data loader's attention masks" in [c.name for c in d.components[:2]]
    top = d.fixes[0]
    assert top.fields == ["implementation.create_attention_mask_in_dataloader"]
    measured_gain = 100 * (_measured("M_cp4_s16k") / _measured("M_cp4_s16k_nomask") - 1)
    assert measured_gain == pytest.approx(60.8, abs=0.5)
    assert top.predicted_throughput_change_pct == pytest.approx(measured_gain, abs=10)


def test_the_twin_without_the_mask_has_no_mask_term():
    r = check_mfu(MfuRequest(log_text=(LOGS / "M_cp4_s16k_nomask" / "train.log").read_text(), gpu="h100-sxm"))
    assert r.plan.implementation.create_attention_mask_in_dataloader is False
    assert "data loader's attention masks" not in [c.name for c in r.diagnosis.components]
    assert all(f.fields != ["implementation.create_attention_mask_in_dataloader"] for f in r.diagnosis.fixes)
