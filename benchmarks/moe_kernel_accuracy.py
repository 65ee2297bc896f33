"""The routed experts' GEMMs as TE runs them on H100 against the step-time model (issue 15).

Reads benchmarks/results/gpu_h100_F_kernel_moe.jsonl (benchmarks/kernel_probe.py moe on one H100 with
Transformer Engine: TE GroupedLinear fc1 -> SwiGLU -> GroupedLinear fc2, what Megatron's TEGroupedMLP
runs, at 4-32 local experts x 64-4,096 tokens each over eight expert shapes) and compares, per case:
- the GPU's own time (CUDA-graph replay of forward + backward: no host in it) with physics.moe's
  experts part for the same shape (GEMMs, SwiGLU, no weight-gradient accumulation: the probe has none);
- the host's time to issue the same forward + backward (CPU seconds, the GPU drained before and after)
  with the host units physics.moe charges (GROUPED_EXPERTS_HOST_KERNELS + PER_EXPERT_HOST_KERNELS x
  local experts), priced with the reference layer's host time from the same lease's host probe.
Held out, fixed before any fit: a case whose key crc32 % 3 == 0. Rerun:

    .venv/bin/python benchmarks/moe_kernel_accuracy.py        # -> benchmarks/results/moe_kernel_accuracy.txt
    .venv/bin/python benchmarks/moe_kernel_accuracy.py --fit  # the grid the constants came from
"""

from __future__ import annotations

import json
import statistics
import sys
import zlib
from pathlib import Path

import numpy as np

from mcore_advisor.physics import moe, step_time
from mcore_advisor.physics.step_time import _gemm_s, _linear_s, hardware_params
from mcore_advisor.schemas import ClusterSpec

RESULTS = Path(__file__).resolve().parent / "results"
KERNELS = RESULTS / "gpu_h100_F_kernel_moe.jsonl"
DENSE = RESULTS / "kernel_probe_h100.jsonl"  # the dense bf16 GEMMs the rate was fitted on (session s1)
OUT = RESULTS / "moe_kernel_accuracy.txt"
#: autograd adds each backward's gradients into the probe's existing bf16 .grad (read both, write one);
#: Megatron's runs have their own accumulation term (step_time._wgrad_accumulation_s)
PROBE_GRAD_ADD_BYTES = 6.0


def key(r: dict) -> str:
    return f"h{r['hidden']}_f{r['ffn']}_e{r['local_experts']}_t{r['tokens_per_expert']}"


def held_out(r: dict) -> bool:
    return zlib.crc32(key(r).encode()) % 3 == 0


def model_gpu_s(r: dict, hw) -> float:
    """Forward + backward GPU seconds of the probe's expert block in physics.moe's terms."""
    h, f, e, t = (float(r[k]) for k in ("hidden", "ffn", "local_experts", "tokens_per_expert"))
    rate = hw.peak_bf16_tflops * 1e12 * hw.gemm_bf16_fraction * moe.GROUPED_GEMM_RELATIVE_RATE
    bw = hw.hbm_bandwidth_gbps * 1e9
    fc1 = _linear_s(t, 2 * f, h, rate, bw, float(hw.num_sms), e)
    fc2 = _linear_s(t, h, f, rate, bw, float(hw.num_sms), e)
    ew = bw * hw.elementwise_fraction
    act = e * t * 3.0 * f * 2 / ew
    grad_add = PROBE_GRAD_ADD_BYTES * (e * 3.0 * h * f + e * t * h) / ew
    return sum(fc1) + sum(fc2) + 3.0 * act + grad_add


def dense_errors(hw) -> list[float]:
    """The dense bf16 GEMM probe rows (M >= 1,024) against _gemm_s: the roofline must leave them be."""
    out = []
    rate = hw.peak_bf16_tflops * 1e12 * hw.gemm_bf16_fraction
    for line in DENSE.read_text().splitlines() if DENSE.exists() else []:
        r = json.loads(line) if line.strip() else {}
        if r.get("kind") == "gemm_bf16":
            pred = _gemm_s(r["m"], r["n"], r["k"], rate, hw.hbm_bandwidth_gbps * 1e9, float(hw.num_sms))
            measured = 2.0 * r["m"] * r["n"] * r["k"] / (r["tflops"] * 1e12)  # time_s is rounded to 0.1 ms there
            out.append(_pct(float(pred), measured))
    return out


def rows() -> list[dict]:
    out = []
    for line in KERNELS.read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        if r.get("kind") == "moe_grouped_gemm" and r.get("impl") == "te_grouped_linear" and "graph_fwd_bwd_s" in r:
            out.append(r)
    return out


def _pct(a: float, b: float) -> float:
    return 100.0 * (a / b - 1.0)


def _summary(label: str, errs: list[float]) -> str:
    if not errs:
        return f"  {label:<34} n=  0"
    a = [abs(x) for x in errs]
    return (f"  {label:<34} n={len(errs):3d}  median |err| {statistics.median(a):5.1f}%  max {max(a):5.1f}%  "
            f"mean signed {statistics.fmean(errs):+5.1f}%")


def report() -> str:
    hw = hardware_params(ClusterSpec(gpu="h100-sxm", num_gpus=1))
    rs = rows()
    lines = [__doc__.split("\n\n")[0], "", f"cases: {len(rs)} ({sum(map(held_out, rs))} held out)", "",
             f"{'case':<26} held  GPU meas ms  model ms  err %   host issue ms   TFLOP/s (GPU)"]
    gpu_err = {True: [], False: []}
    for r in rs:
        pred = model_gpu_s(r, hw)
        meas = r["graph_fwd_bwd_s"]
        err = _pct(pred, meas)
        gpu_err[held_out(r)].append(err)
        fl = 18.0 * r["local_experts"] * r["tokens_per_expert"] * r["hidden"] * r["ffn"]
        lines.append(f"{key(r):<26} {'yes' if held_out(r) else '   '}  {1e3 * meas:10.3f}  {1e3 * pred:8.3f}  {err:+6.1f}"
                     f"  {1e3 * r['host_issue_fwd_bwd_s']:12.3f}   {fl / meas / 1e12:8.1f}")
    lines += ["", "GPU time (graph replay) against the model's experts part:",
              _summary("fitted cases", gpu_err[False]), _summary("held-out cases", gpu_err[True]),
              "", "Dense bf16 GEMMs of kernel_probe_h100.jsonl (M >= 1,024) against the same GEMM model:",
              _summary("every row", dense_errors(hw))]
    return "\n".join(lines) + "\n"


GRID = {"rel_rate": np.arange(0.80, 1.01, 0.02), "bw_fraction": (0.6, 0.7, 0.8, 0.9, 1.0), "exponent": (2.0, 3.0, 4.0)}


def fit() -> str:
    """Grid over GROUPED_GEMM_RELATIVE_RATE, GEMM_OPERAND_BW_FRACTION and GEMM_ROOFLINE_EXPONENT on the cases
    outside the held-out third (median |error| of the GPU time); the held-out cases are scored, never fitted."""
    hw = hardware_params(ClusterSpec(gpu="h100-sxm", num_gpus=1))
    rs = rows()
    saved = (moe.GROUPED_GEMM_RELATIVE_RATE, step_time.GEMM_OPERAND_BW_FRACTION, step_time.GEMM_ROOFLINE_EXPONENT)
    scores = []
    try:
        for g in GRID["rel_rate"]:
            for b in GRID["bw_fraction"]:
                for p in GRID["exponent"]:
                    moe.GROUPED_GEMM_RELATIVE_RATE, step_time.GEMM_OPERAND_BW_FRACTION = float(g), b
                    step_time.GEMM_ROOFLINE_EXPONENT = p
                    errs = {h: [abs(_pct(model_gpu_s(r, hw), r["graph_fwd_bwd_s"])) for r in rs if held_out(r) == h]
                            for h in (False, True)}
                    scores.append((statistics.median(errs[False]), round(float(g), 2), b, p, statistics.median(errs[True])))
    finally:
        moe.GROUPED_GEMM_RELATIVE_RATE, step_time.GEMM_OPERAND_BW_FRACTION, step_time.GEMM_ROOFLINE_EXPONENT = saved
    scores.sort()
    head = "fitted median |err|, GROUPED_GEMM_RELATIVE_RATE, GEMM_OPERAND_BW_FRACTION, GEMM_ROOFLINE_EXPONENT, held-out median |err|"
    return head + "\n" + "\n".join(f"{s[0]:5.1f}%  {s[1]:.2f}  {s[2]:.1f}  {s[3]:.0f}   held-out {s[4]:5.1f}%" for s in scores[:10]) + "\n"


def main(argv: list[str]) -> int:
    if "--fit" in argv:
        print(fit())
        return 0
    text = report()
    OUT.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
