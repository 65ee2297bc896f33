"""How fast this machine's host launches a transformer layer: the step-time model's host speed, measured.

The step-time model times the host with one figure per machine: the milliseconds its CPU takes to
issue one reference layer's forward + backward for one micro-batch (GPT-3 1.3B's layer, Transformer
Engine, bf16; physics.step_time.host_reference_kernels). Hosts differ by 2x and more (a VM's vCPUs
against bare metal, other ranks' processes on the same CPUs), so the profile job measures it on the
machine it runs on, after training, on every local rank at once (the same CPU contention as the
training loop), and get_job / the benchmarks predict with it (launcher/as_ran.py).

The probe runs Transformer Engine's own TransformerLayer at the reference layer's sizes on a tiny
batch, so its GPU work (well under the host's) never holds the host back: the CPU time of the timed
loop is the host's time to issue the layer's work. Megatron's layer adds its own Python around the
same TE modules; physics.step_time.HOST_PROBE_TO_LAYER converts (measured on the GPU lease that
introduced the probe). Without TE, torch modules of the same sizes stand in, labelled 'torch'.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

#: GPT-3 1.3B's layer: hidden 2048, 16 heads, FFN 8192 (physics.step_time.host_reference_kernels)
HIDDEN, HEADS, FFN = 2048, 16, 8192
#: tokens of the probe's micro-batch: the GPU finishes each kernel long before the host issues the next
TOKENS = 128
WARMUP, ITERATIONS = 5, 30


def _te_layer(torch):
    import transformer_engine.pytorch as te

    layer = te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                                self_attn_mask_type="causal", params_dtype=torch.bfloat16, device="cuda")
    return layer, "transformer_engine"


def _torch_layer(torch):
    nn = torch.nn

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
            self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
            self.fc1, self.fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

        def forward(self, x):
            s, b, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(s, b, 3, HEADS, -1).permute(2, 1, 3, 0, 4)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.permute(2, 0, 1, 3).reshape(s, b, HIDDEN))
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))

    return Layer().to(device="cuda", dtype=torch.bfloat16), "torch"


def measure(use_cuda: bool) -> dict[str, Any] | None:
    """Host milliseconds per reference-layer forward + backward on this rank (None without CUDA). A probe
    that fails reports why and leaves the job's result as it was."""
    if not use_cuda:
        return None
    try:
        return _measure()
    except Exception as exc:  # the probe is an extra; training already succeeded
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def _measure() -> dict[str, Any]:
    import torch

    try:
        layer, impl = _te_layer(torch)
    except ImportError:
        layer, impl = _torch_layer(torch)
    x = torch.randn(TOKENS, 1, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.ones_like(x)
    for _ in range(WARMUP):
        layer(x).backward(grad)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    wall, cpu = [], []
    for _ in range(ITERATIONS):
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        layer(x).backward(grad)
        wall.append(time.perf_counter() - wall0)
        cpu.append(time.thread_time() - cpu0)
    end.record()
    torch.cuda.synchronize()
    gpu_s = start.elapsed_time(end) / 1e3
    del layer, x, grad
    torch.cuda.empty_cache()
    # The median: a few stalled passes (an allocation, another process on the CPU) move a mean by 2x
    # between jobs on one machine (sessions s6-s7: means of 4.1-9.8 ms on one H100 VM).
    return {"ms_per_layer": 1e3 * statistics.median(wall), "statistic": "median",
            "mean_ms_per_layer": 1e3 * statistics.fmean(wall), "cpu_ms_per_layer": 1e3 * statistics.median(cpu),
            "gpu_ms_per_layer": 1e3 * gpu_s / ITERATIONS, "per_iteration_ms": [round(1e3 * w, 3) for w in wall],
            "impl": impl, "tokens": TOKENS, "iterations": ITERATIONS}


def summary(per_rank: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The slowest rank's figure (the step waits for it) and every rank's, for result.json's host report."""
    got = [p for p in per_rank if p and "ms_per_layer" in p]
    if not got:
        errors = [p["error"] for p in per_rank if p and "error" in p]
        return {"error": errors[0]} if errors else None
    worst = max(got, key=lambda p: p["ms_per_layer"])
    return {**worst, "ms_per_layer_per_rank": [round(p["ms_per_layer"], 3) if p and "ms_per_layer" in p else None
                                               for p in per_rank],
            "source": "launcher/entry/host_probe.py: host time to issue TE TransformerLayer(2048, 8192, 16) "
                      f"forward + backward on {TOKENS} tokens, {ITERATIONS} times, all local ranks at once after "
                      "training; the slowest rank"}
