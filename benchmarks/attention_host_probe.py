"""Measurements behind issue 14's local-spec attention, dropout and host-cost terms (runs on a GPU machine).

torch only (no Megatron, no Transformer Engine); each section prints JSON lines and all of them go to
$OUT/attention_host_probe.jsonl:
  - dpa:      Megatron's DotProductAttention as megatron-core 0.19.2 runs it without the compiled
              masked-softmax kernel (baddbmm into the global buffer, masked_fill_ with the data loader's
              [b, 1, s, s] mask, PyTorch softmax in bf16 or fp32, optional dropout, bmm, permute),
              forward + backward, and the same with the softmax removed (the two batched GEMMs), so
              the softmax path's time per score is the difference;
  - sdpa:     causal torch SDPA (cuDNN and flash backends) forward + backward with dropout 0 and 0.1;
  - dropout:  hidden dropout (F.dropout p=0.1) forward + backward over an s*b x h bf16 tensor vs p=0;
  - norms:    torch LayerNorm / RMSNorm forward + backward (the local spec's WrappedTorchNorm);
  - host:     CPU time per eager op launch from Python (no autograd, with autograd through small
              Linear layers) and the round trip of a host sync (.item()).

    python3 benchmarks/attention_host_probe.py [SECTION ...]     # default: every section
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

OUT = os.environ.get("OUT", ".")
dev = torch.device("cuda")
records: list[dict] = []


def emit(**kw):
    kw = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in kw.items()}
    records.append(kw)
    print(json.dumps(kw), flush=True)


def bench(fn, rep=100):
    return do_bench(fn, warmup=10, rep=rep, return_mode="median") / 1e3


def _dpa_case(b, n, s, d, softmax, p):
    q = torch.randn(s, b, n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(s, b, n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(s, b, n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    mask = torch.triu(torch.ones(s, s, device=dev, dtype=torch.bool), diagonal=1).expand(b, 1, s, s).contiguous()
    buf = torch.empty(b * n, s, s, device=dev, dtype=torch.bfloat16)
    do = torch.randn(s, b, n * d, device=dev, dtype=torch.bfloat16)

    def fwd():
        qq = q.reshape(s, b * n, d)
        kk = k.view(s, b * n, d)
        scores = torch.baddbmm(buf, qq.transpose(0, 1), kk.transpose(0, 1).transpose(1, 2), beta=0.0, alpha=d**-0.5)
        x = scores.view(b, n, s, s)
        if softmax != "none":
            if softmax == "fp32":
                x = x.float()
            x.masked_fill_(mask, -10000.0)
            x = torch.softmax(x, dim=-1)
            if softmax == "fp32":
                x = x.bfloat16()
            if p > 0:
                x = F.dropout(x, p, training=True)
        ctx = torch.bmm(x.reshape(b * n, s, s), v.view(s, b * n, d).transpose(0, 1))
        return ctx.view(b, n, s, d).permute(2, 0, 1, 3).contiguous().view(s, b, n * d)

    tf = bench(fwd)
    tfb = bench(lambda: fwd().backward(do))
    return tf, tfb


def dpa():
    for b, n, s in ((4, 16, 2048), (2, 16, 2048), (1, 16, 4096), (8, 16, 1024)):
        base = None
        for softmax, p in (("none", 0.0), ("bf16", 0.0), ("fp32", 0.0), ("bf16", 0.1), ("fp32", 0.1)):
            try:
                tf, tfb = _dpa_case(b, n, s, 128, softmax, p)
            except Exception as e:  # noqa: BLE001 (report and go on)
                emit(kind="dpa", b=b, n=n, s=s, softmax=softmax, dropout=p, error=repr(e)[:300])
                continue
            elems = b * n * s * s
            if softmax == "none":
                base = (tf, tfb)
            extra = {} if base is None or softmax == "none" else {
                "softmax_fwd_ns_per_score": (tf - base[0]) / elems * 1e9,
                "softmax_fwd_bwd_ns_per_score": (tfb - base[1]) / elems * 1e9}
            emit(kind="dpa", b=b, n=n, s=s, d=128, softmax=softmax, dropout=p, fwd_s=tf, fwd_bwd_s=tfb,
                 score_elems=elems, **extra)
            torch.cuda.empty_cache()


def _sdpa_case(b, n, s, name, be, p):
    from torch.nn.attention import sdpa_kernel

    q, k, v = (torch.randn(b, n, s, 128, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(b, n, s, 128, device=dev, dtype=torch.bfloat16)

    def fb():
        with sdpa_kernel(be):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p).backward(do)
    try:
        t = bench(fb)
        emit(kind="sdpa", backend=name, b=b, n=n, s=s, dropout=p, fwd_bwd_s=t,
             tflops_causal=3.5 * 2 * 2 * b * n * s * s * 128 * 0.5 / t / 1e12)
    except Exception as e:  # noqa: BLE001
        emit(kind="sdpa", backend=name, b=b, n=n, s=s, dropout=p, error=repr(e)[:300])


def sdpa():
    from torch.nn.attention import SDPBackend

    for b, n, s in ((4, 16, 2048), (2, 16, 4096), (1, 16, 8192)):
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            for p in (0.0, 0.1):
                _sdpa_case(b, n, s, name, be, p)


def _dropout_case(rows, h, p):
    x = torch.randn(rows, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    res = torch.randn_like(x)
    t = bench(lambda: (F.dropout(x, p, training=True) + res).backward(g))
    emit(kind="hidden_dropout_add", rows=rows, h=h, dropout=p, fwd_bwd_s=t, elems=rows * h)


def dropout():
    for rows, h in ((8192, 2048), (16384, 4096)):
        for p in (0.0, 0.1):
            _dropout_case(rows, h, p)


def _norm_case(rows, h):
    x = torch.randn(rows, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    w = torch.ones(h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    bb = torch.zeros(h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    tl = bench(lambda: F.layer_norm(x, (h,), w, bb).backward(g))
    tr = bench(lambda: F.rms_norm(x, (h,), w).backward(g))
    emit(kind="torch_norm", rows=rows, h=h, layernorm_fwd_bwd_s=tl, rmsnorm_fwd_bwd_s=tr, bytes_fwd_bwd=5 * 2 * rows * h)


def norms():
    for rows, h in ((8192, 2048), (16384, 4096)):
        _norm_case(rows, h)


def host():
    x = torch.zeros(1, device=dev)
    torch.cuda.synchronize()
    for n in (2000, 20000):
        t0 = time.perf_counter()
        for _ in range(n):
            x.add_(1.0)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        emit(kind="host_launch", ops=n, cpu_s_per_op=(t1 - t0) / n)
    layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64, device=dev, dtype=torch.bfloat16) for _ in range(16)])
    inp = torch.randn(8, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(5):
        layers(inp).sum().backward()
    torch.cuda.synchronize()
    reps = 200
    t0 = time.perf_counter()
    for _ in range(reps):
        layers(inp).sum().backward()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        layers(inp).sum().backward()
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    emit(kind="host_autograd", cpu_s_per_step=(t1 - t0) / reps, kernels_per_step=kernels,
         cpu_s_per_kernel=(t1 - t0) / reps / max(kernels, 1))
    y = torch.ones(1, device=dev)
    ts = []
    for _ in range(200):
        t0 = time.perf_counter()
        y.item()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    emit(kind="host_sync", item_round_trip_s_median=ts[len(ts) // 2])
    big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    gaps = []
    for _ in range(20):
        big @ big
        (big[0, 0] * 0).item()  # the host waits for the GPU to drain
        s0 = torch.cuda.Event(enable_timing=True)
        s1 = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        s0.record()
        x.add_(1.0)
        s1.record()
        torch.cuda.synchronize()
        gaps.append(e.elapsed_time(s1) / 1e3)
    gaps.sort()
    emit(kind="host_resume", first_op_after_sync_s_median=gaps[len(gaps) // 2])


SECTIONS = {"dpa": dpa, "sdpa": sdpa, "dropout": dropout, "norms": norms, "host": host}


def main(argv: list[str]) -> None:
    emit(kind="env", device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
         cpu_count=os.cpu_count())
    for name in argv or list(SECTIONS):
        SECTIONS[name]()
    with open(os.path.join(OUT, "attention_host_probe.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    main(sys.argv[1:])
