"""The expert-load spread a prediction assumes is stated with it, and the stated range of measured untrained spreads
holds every as-routed run the profile job recorded (benchmarks/results/gpu_*_runs.jsonl)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcore_advisor.physics.evaluate import evaluate_plan
from mcore_advisor.physics.moe import UNTRAINED_LOAD_CV_RANGE
from mcore_advisor.physics.step_time import step_time
from mcore_advisor.schemas import Plan

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
# the O set's OLMoE-like layers (benchmarks/gpu/configs_multi.py OLMOE): 64 experts top-8, no shared expert
OLMOE = {"num_layers": 4, "hidden_size": 2048, "num_attention_heads": 16, "num_query_groups": 16, "ffn_hidden_size": 1024,
         "vocab_size": 50304, "swiglu": True, "normalization": "RMSNorm", "add_bias_linear": False,
         "untie_embeddings_and_output_weights": True, "position_embedding_type": "rope", "qk_layernorm": True,
         "num_experts": 64, "moe_router_topk": 8, "moe_ffn_hidden_size": 1024}


def _plan(model: dict, **impl) -> Plan:
    return Plan(model=model, cluster={"gpu": "h100-sxm", "num_gpus": 1},
                training={"seq_length": 4096, "global_batch_size": 8, "micro_batch_size": 1},
                implementation={"moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall", **impl})


def _spread_line(model: dict, **impl) -> str:
    lines = [a for a in step_time(_plan(model, **impl)).assumptions if "spread" in a or "balanced" in a]
    assert len(lines) == 1, lines
    return lines[0]


def test_as_routed_without_shared_expert_states_the_measured_range_and_the_step_gap():
    line = _spread_line(OLMOE)
    assert "spread 0.21" in line and "without a shared expert measured 0.84-2.82" in line
    assert "14-30%" in line and "moe_expert_load_cv" in line and "moe_router_force_load_balancing" in line


def test_as_routed_with_shared_expert_states_its_own_range_only():
    line = _spread_line({**OLMOE, "moe_shared_expert_intermediate_size": 5632})
    assert "with a shared expert measured 0.12-0.85" in line and "14-30%" not in line


def test_forced_and_measured_spreads_are_named():
    assert "balanced" in _spread_line(OLMOE, moe_router_force_load_balancing=True)
    assert "spread 1.8 " in _spread_line(OLMOE, moe_expert_load_cv=1.8)


def _as_routed_spreads() -> list[tuple[str, bool, float]]:
    out = []
    for path in sorted(RESULTS.glob("gpu_*_runs.jsonl")):
        for row in map(json.loads, path.read_text().splitlines()):
            req = row.get("plan_requested") or {}
            cv = [d for d in row.get("differences") or [] if d.startswith("moe_expert_load_cv ")]
            impl = req.get("implementation", {})
            if not cv or impl.get("moe_router_force_load_balancing") or impl.get("moe_pad_expert_input_to_capacity"):
                continue
            shared = bool(req["model"].get("moe_shared_expert_intermediate_size"))
            out.append((row["name"], shared, float(cv[0].split()[1])))
    return out


def test_stated_ranges_hold_every_recorded_as_routed_run():
    rows = _as_routed_spreads()
    assert sum(not s for _, s, _ in rows) >= 5 and sum(s for _, s, _ in rows) >= 20
    for name, shared, cv in rows:
        lo, hi = UNTRAINED_LOAD_CV_RANGE[shared]
        assert lo <= round(cv, 2) <= hi, (name, shared, cv)


@pytest.mark.parametrize("shared", [True, False])
def test_each_range_is_reached(shared):
    """The ranges are the records' extremes, not padded guesses."""
    cvs = [round(cv, 2) for _, s, cv in _as_routed_spreads() if s == shared]
    assert min(cvs) == UNTRAINED_LOAD_CV_RANGE[shared][0] and max(cvs) == pytest.approx(UNTRAINED_LOAD_CV_RANGE[shared][1], abs=0.01)


def _codes(model: dict, **impl) -> list[str]:
    return [f.code for f in evaluate_plan(_plan(model, **impl)).findings]


def test_as_routed_plan_without_shared_expert_is_warned_with_the_fix():
    f = next(f for f in evaluate_plan(_plan(OLMOE)).findings if f.code == "moe_untrained_load_spread")
    assert f.severity == "warning" and "0.84-2.82" in f.message and "moe_expert_load_cv" in f.fix
    assert "implementation.moe_router_force_load_balancing" in f.fields


@pytest.mark.parametrize("model, impl", [
    ({**OLMOE, "moe_shared_expert_intermediate_size": 5632}, {}),
    (OLMOE, {"moe_router_force_load_balancing": True}),
    (OLMOE, {"moe_expert_load_cv": 1.8}),
    (OLMOE, {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}),
])
def test_no_spread_warning_where_the_spread_is_known_or_harmless(model, impl):
    assert "moe_untrained_load_spread" not in _codes(model, **impl)
