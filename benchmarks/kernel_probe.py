"""Kernel-level measurements behind the efficiency parameters of physics/step_time.py (runs on a GPU machine).

Measures, on the GPU it runs on, with torch only (no Transformer Engine, no Megatron):
  - bf16 GEMM rate over transformer-shaped (M, N, K) problems (TP splits, small token counts),
  - fp8 (e4m3, per-tensor scaled) GEMM rate through torch._scaled_mm,
  - causal SDPA attention forward + backward (flash and cuDNN backends), head dim 128,
  - Megatron's unfused local-spec attention (baddbmm, fp32 softmax with masked_fill, bmm) forward + backward,
  - elementwise bandwidth (copy, LayerNorm fwd+bwd, GeLU fwd+bwd), cross-entropy over a large vocab, AdamW step.
Prints one JSON line per measurement and writes all of them to $OUT/kernel_probe.jsonl.

    python3 benchmarks/kernel_probe.py            # on the device machine
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

OUT = os.environ.get("OUT", ".")
dev = torch.device("cuda")
records: list[dict] = []


def emit(**kw):
    kw = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in kw.items()}
    records.append(kw)
    print(json.dumps(kw), flush=True)


def bench(fn, rep=200):
    return do_bench(fn, warmup=25, rep=rep, return_mode="median") / 1e3  # seconds


def gemm_sweep():
    shapes = []
    # square references
    for n in (8192, 4096, 2048, 1024):
        shapes.append(("square", n, n, n))
    # forward GEMMs of a layer: M = tokens, (N, K) from hidden h, ffn 4h, split by TP
    for h in (2048, 4096, 8192, 12288):
        for t in (1, 2, 4, 8):
            for tokens in (2048, 8192):
                shapes.append((f"qkv h{h} t{t}", tokens, 3 * h // t, h))
                shapes.append((f"proj h{h} t{t}", tokens, h, h // t))
                shapes.append((f"fc1 h{h} t{t}", tokens, 4 * h // t, h))
                shapes.append((f"fc2 h{h} t{t}", tokens, h, 4 * h // t))
    # weight-gradient shapes: reduction over tokens
    for h in (2048, 8192):
        for t in (1, 8):
            shapes.append((f"wgrad_fc1 h{h} t{t}", h, 4 * h // t, 8192))
    seen = set()
    for name, m, n, k in shapes:
        if (m, n, k) in seen:
            continue
        seen.add((m, n, k))
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        s = bench(lambda a=a, b=b: a @ b)
        emit(kind="gemm_bf16", name=name, m=m, n=n, k=k, time_s=s, tflops=2 * m * n * k / s / 1e12)


def fp8_sweep():
    if not hasattr(torch, "float8_e4m3fn"):
        return
    shapes = [(8192, 8192, 8192), (4096, 4096, 4096), (8192, 12288, 4096), (8192, 4096, 4096),
              (8192, 4096, 16384), (8192, 2048, 8192), (2048, 1536, 2048), (8192, 36864, 12288), (8192, 12288, 12288)]
    for m, n, k in shapes:
        try:
            a = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
            b = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn).t()  # column-major B as _scaled_mm wants
            one = torch.tensor(1.0, device=dev)
            f = lambda a=a, b=b, one=one: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
            s = bench(f)
            emit(kind="gemm_fp8", m=m, n=n, k=k, time_s=s, tflops=2 * m * n * k / s / 1e12)
        except Exception as e:  # report and go on
            emit(kind="gemm_fp8", m=m, n=n, k=k, error=repr(e)[:300])


def attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cases = [(4, 16, 2048, 16), (8, 16, 2048, 16), (4, 16, 4096, 16), (1, 32, 4096, 32), (1, 32, 8192, 8),
             (1, 64, 4096, 8), (2, 8, 4096, 8), (1, 8, 8192, 8), (1, 16, 16384, 16)]
    for backend in ("flash", "cudnn"):
        be = SDPBackend.FLASH_ATTENTION if backend == "flash" else SDPBackend.CUDNN_ATTENTION
        for b, n, s, g in cases:
            try:
                _one_sdpa(sdpa_kernel, be, backend, b, n, s, g)
            except Exception as e:
                emit(kind="attn_sdpa", backend=backend, b=b, n=n, s=s, error=repr(e)[:300])


def _one_sdpa(sdpa_kernel, be, backend, b, n, s, g, d=128):
    q = torch.randn(b, n, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, g, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, g, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(b, n, s, d, device=dev, dtype=torch.bfloat16)

    def fwd():
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=g != n)

    def fb():
        fwd().backward(do)

    tf = bench(fwd)
    tfb = bench(fb)
    fl = 4 * b * n * s * s * d * 0.5  # causal forward: QK^T and PV over the lower triangle
    emit(kind="attn_sdpa", backend=backend, b=b, n=n, g=g, s=s, d=d, fwd_s=tf, fwd_bwd_s=tfb,
         fwd_tflops=fl / tf / 1e12, bwd_tflops_2_5x=2.5 * fl / (tfb - tf) / 1e12,
         fwd_bwd_tflops_3_5x=3.5 * fl / tfb / 1e12)


def unfused_attention():
    """Megatron local-spec DotProductAttention without masked_softmax_fusion (as the device probe ran it)."""
    for b, n, s in ((4, 16, 2048), (8, 16, 2048), (2, 16, 4096), (1, 32, 4096)):
        try:
            _one_unfused(b, n, s)
        except Exception as e:
            emit(kind="attn_unfused", b=b, n=n, s=s, error=repr(e)[:300])


def _one_unfused(b, n, s, d=128):
    q = torch.randn(s, b * n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(s, b * n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(s, b * n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    mask = torch.triu(torch.ones(s, s, device=dev, dtype=torch.bool), diagonal=1)
    buf = torch.empty(b * n, s, s, device=dev, dtype=torch.bfloat16)
    do = torch.randn(s, b * n, d, device=dev, dtype=torch.bfloat16)

    def fwd():
        scores = torch.baddbmm(buf, q.transpose(0, 1), k.transpose(0, 1).transpose(1, 2), beta=0.0, alpha=d**-0.5)
        x = scores.view(b, n, s, s).float()
        x = x.masked_fill(mask, -10000.0)
        p = torch.softmax(x, dim=-1).to(torch.bfloat16)
        ctx = torch.bmm(p.view(b * n, s, s), v.transpose(0, 1))
        return ctx.transpose(0, 1)

    def fb():
        fwd().backward(do)

    tf = bench(fwd, rep=100)
    tfb = bench(fb, rep=100)
    elems = b * n * s * s
    emit(kind="attn_unfused", b=b, n=n, s=s, d=d, fwd_s=tf, fwd_bwd_s=tfb, score_elems=elems,
         fwd_ns_per_elem=tf / elems * 1e9, fwd_bwd_ns_per_elem=tfb / elems * 1e9)


def elementwise():
    n_tok, h = 16384, 4096
    x = torch.randn(n_tok, h, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    s = bench(lambda: y.copy_(x))
    emit(kind="copy", bytes=2 * x.numel() * 2, time_s=s, gbps=4 * x.numel() / s / 1e9)
    s = bench(lambda: torch.add(x, x, out=y))
    emit(kind="add", bytes=3 * x.numel() * 2, time_s=s, gbps=6 * x.numel() / s / 1e9)
    ln = torch.nn.LayerNorm(h, device=dev, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    g = torch.randn_like(x)
    s_f = bench(lambda: ln(xg))
    s_fb = bench(lambda: ln(xg).backward(g))
    emit(kind="layernorm", elems=x.numel(), fwd_s=s_f, fwd_bwd_s=s_fb, fwd_gbps=4 * x.numel() / s_f / 1e9)
    f = 4 * h
    z = torch.randn(n_tok, f, device=dev, dtype=torch.bfloat16, requires_grad=True)
    gz = torch.randn_like(z)
    s_f = bench(lambda: F.gelu(z))
    s_fb = bench(lambda: F.gelu(z).backward(gz))
    emit(kind="gelu", elems=z.numel(), fwd_s=s_f, fwd_bwd_s=s_fb, fwd_gbps=4 * z.numel() / s_f / 1e9)


def cross_entropy():
    for tokens, vocab in ((8192, 32768), (4096, 128256)):
        logits = torch.randn(tokens, vocab, device=dev, dtype=torch.bfloat16, requires_grad=True)
        tgt = torch.randint(0, vocab, (tokens,), device=dev)
        s = bench(lambda logits=logits, tgt=tgt: F.cross_entropy(logits.float(), tgt).backward(), rep=100)
        emit(kind="cross_entropy_fp32", tokens=tokens, vocab=vocab, fwd_bwd_s=s, ns_per_logit=s / (tokens * vocab) * 1e9)


def adam():
    n = 256 * 2**20
    p = torch.nn.Parameter(torch.randn(n, device=dev))
    p.grad = torch.randn(n, device=dev)
    for fused in (True, False):
        opt = torch.optim.AdamW([p], lr=1e-4, fused=fused, foreach=None if fused else True)
        opt.step()
        s = bench(opt.step, rep=100)
        emit(kind="adamw", fused=fused, params=n, time_s=s, ns_per_param=s / n * 1e9)


def main():
    props = torch.cuda.get_device_properties(0)
    emit(kind="device", name=props.name, sms=props.multi_processor_count, torch=torch.__version__,
         mem_gib=props.total_memory / 2**30)
    for f in (gemm_sweep, fp8_sweep, attention, unfused_attention, elementwise, cross_entropy, adam):
        try:
            f()
        except Exception as e:
            emit(kind="section_error", section=f.__name__, error=repr(e)[:500])
        torch.cuda.empty_cache()
    with open(os.path.join(OUT, "kernel_probe.jsonl"), "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
