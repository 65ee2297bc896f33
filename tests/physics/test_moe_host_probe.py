"""The MoE per-expert host constants against the one-H100 probe of Megatron's own TEGroupedMLP (issue 15)."""

import importlib.util
import sys
from pathlib import Path

import pytest

from mcore_advisor.physics import moe

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_host_accuracy.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPT.parent))  # its sibling moe_kernel_accuracy, as when run as a script
    spec = importlib.util.spec_from_file_location("moe_host_accuracy", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _within(value: float, runs: tuple[float, float], slack: float = 0.2) -> bool:
    """value inside the plain and DDP runs' range widened by `slack` of it (the VM host's run-to-run spread)."""
    lo, hi = min(runs), max(runs)
    return lo * (1 - slack) <= value <= hi * (1 + slack)


def test_per_expert_host_constants_sit_inside_the_probe_runs(bench):
    rs = bench.cases()
    assert len(rs) == 155 and {r["run"] for r in rs} >= {"lease1/call2/plain", "lease2/call1/ddp"}
    sl = bench.per_expert_slopes(rs)
    for i in (0, 1):
        assert _within(moe.PER_EXPERT_HOST_KERNELS[True][i], (sl["bf16", False][i], sl["bf16", True][i]))
        delayed = tuple(sl["fp8_delayed", d][i] - sl["bf16", d][i] for d in (False, True))
        current = tuple(sl["fp8_tensorwise", d][i] - sl["bf16", d][i] for d in (False, True))
        assert _within(moe.FP8_PER_EXPERT_HOST_KERNELS[i], delayed)
        # the module's tight loop under-reads current scaling's forward; the training loop's trace is the source
        assert _within(moe.FP8_PER_EXPERT_HOST_KERNELS[i] + moe.FP8_CURRENT_SCALING_PER_EXPERT_HOST_KERNELS[i], current, slack=0.5)
    # current scaling costs more than delayed scaling per expert, forward and backward, in every run kind
    for d in (False, True):
        assert all(sl["fp8_tensorwise", d][i] > sl["fp8_delayed", d][i] for i in (0, 1))


def test_the_model_prices_a_probe_case_at_its_runs_host_speed(bench):
    # a 128-expert FP8-CS TEGroupedMLP at a 6 ms host probe: the expert block's fixed units, the per-expert ones
    # (bf16 + every FP8 recipe's cast + current scaling's amax) and the FP8 padding, at host_floor_from_probe's prices
    case = {"kind": "moe_experts", "precision": "fp8_tensorwise", "local_experts": 128, "hidden": 2048, "ffn": 768}
    f, b = bench.predicted_ms(case, 6.0)
    from mcore_advisor.physics import step_time as st

    kf, kb = st.host_reference_kernels()
    per_f = moe.PER_EXPERT_HOST_KERNELS[True][0] + moe.FP8_PER_EXPERT_HOST_KERNELS[0] + moe.FP8_CURRENT_SCALING_PER_EXPERT_HOST_KERNELS[0]
    units_f = moe.GROUPED_EXPERTS_HOST_KERNELS[0] + moe.FP8_EXPERT_PADDING_HOST_KERNELS[0] + 128 * per_f
    assert f == pytest.approx(units_f * 6.0 * st.HOST_FORWARD_SHARE / kf, rel=1e-6)
    per_b = moe.PER_EXPERT_HOST_KERNELS[True][1] + moe.FP8_PER_EXPERT_HOST_KERNELS[1] + moe.FP8_CURRENT_SCALING_PER_EXPERT_HOST_KERNELS[1]
    units_b = moe.GROUPED_EXPERTS_HOST_KERNELS[1] + moe.FP8_EXPERT_PADDING_HOST_KERNELS[1] + 128 * per_b
    assert b == pytest.approx(units_b * 6.0 * (1.0 - st.HOST_FORWARD_SHARE) / kb, rel=1e-6)


def test_fp8_per_expert_host_constants_are_the_training_loops_trace():
    import json

    trace = json.loads((SCRIPT.parent / "results" / "gpu_h100_H2_grouped_linear_trace.json").read_text())
    rows = trace["rows"]
    assert trace["local_experts"] == 32
    delayed = rows["H_q30rank_ep1_forced_fp8delayed"]["extra_units_per_expert"]
    current = rows["H_q30rank_ep1_forced_fp8cs"]["extra_units_per_expert"]
    cs_total = [a + b for a, b in zip(moe.FP8_PER_EXPERT_HOST_KERNELS, moe.FP8_CURRENT_SCALING_PER_EXPERT_HOST_KERNELS, strict=True)]
    assert cs_total == pytest.approx([current["forward"], current["backward"]], abs=0.02)
    # every recipe's per-expert cast: the module probe's means, which the loop's delayed row bears out within 0.1 / 0.35
    assert moe.FP8_PER_EXPERT_HOST_KERNELS == pytest.approx((delayed["forward"], delayed["backward"]), abs=0.35)
