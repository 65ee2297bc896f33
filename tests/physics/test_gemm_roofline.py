"""The GEMM model's operand-bytes roofline (physics/step_time._gemm_s), against hand-derived figures."""

from __future__ import annotations

import pytest

from mcore_advisor.physics import step_time as st

RATE, BW, SMS = 700e12, 3.35e12, 132.0


def _without_epilogue_and_launch(m, n, k, groups=1.0, elem=2.0):
    return (st._gemm_s(m, n, k, RATE, BW, SMS, groups, elem) - st.GEMM_EPILOGUE_EXPOSED * 2.0 * m * n * groups / BW
            - st.KERNEL_LAUNCH_S * groups)


def test_experts_with_64_tokens_run_at_the_speed_of_reading_their_weights():
    # 16 experts, 64 tokens each, through 7168 x 4096 weights: 60 GFLOP (88 us at 700 TFLOP/s; 512 tiles of
    # 128 x 128 fill 3.9 waves of 132 SMs) but 16 x 59 MB of weights (287 us at 3.35 TB/s)
    m, n, k, g = 64.0, 4096.0, 7168.0, 16.0
    t_bytes = 2.0 * (m * k + k * n + m * n) * g / (BW * st.GEMM_OPERAND_BW_FRACTION)
    assert t_bytes == pytest.approx(287e-6, rel=0.01)
    got = _without_epilogue_and_launch(m, n, k, groups=g)
    assert t_bytes <= got <= 1.02 * t_bytes  # the soft maximum: barely above the bytes' time


def test_a_large_gemm_keeps_its_flop_time():
    m = n = k = 8192.0
    t_flops = 2.0 * m * n * k / (RATE * st._wave_efficiency(m, n, 1.0, SMS))
    assert _without_epilogue_and_launch(m, n, k) == pytest.approx(t_flops, rel=1e-3)


def test_fp8_operands_halve_the_bytes_time_and_each_expert_is_its_own_kernel():
    m, n, k = 64.0, 4096.0, 7168.0
    # 1-byte operands: 143 us of bytes against 88 us of FLOPs, still bytes-bound (soft max +3.5%)
    assert _without_epilogue_and_launch(m, n, k, 16.0, elem=1.0) == pytest.approx(
        _without_epilogue_and_launch(m, n, k, 16.0) / 2.0, rel=0.05)
    sixteen = st._gemm_s(m, n, k, RATE, BW, SMS, 16.0)
    thirty_two = st._gemm_s(m, n, k, RATE, BW, SMS, 32.0)
    assert thirty_two == pytest.approx(2.0 * sixteen, rel=0.02)  # twice the weights read, twice the launches
