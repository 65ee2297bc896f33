"""Kernel-level measurements behind the efficiency parameters of physics/step_time.py (runs on a GPU machine).

Measures, on the GPU it runs on, with torch only (no Transformer Engine, no Megatron):
  - bf16 GEMM rate over transformer-shaped (M, N, K) problems (TP splits, small token counts),
  - fp8 (e4m3, per-tensor scaled) GEMM rate through torch._scaled_mm,
  - causal SDPA attention forward + backward (flash and cuDNN backends), head dim 128,
  - Megatron's unfused local-spec attention (baddbmm, fp32 softmax with masked_fill, bmm) forward + backward,
  - elementwise bandwidth (copy, LayerNorm fwd+bwd, GeLU fwd+bwd), cross-entropy over a large vocab, AdamW step,
  - MoE parts (section `moe`, issue 15; needs megatron-core, and Transformer Engine for the fused and
    grouped kernels): the experts' grouped GEMM at real per-expert shapes (tokens per expert =
    tokens * topk / E) through TE's GroupedLinear (what Megatron's TEGroupedMLP runs), torch._grouped_mm
    and a per-expert loop (SequentialMLP); token permute/unpermute (megatron moe_utils, fused and unfused);
    the router (gating GEMM + top-k, fused and unfused, with and without the aux-loss scores); and one MoE
    layer's local work (router, permute, experts, unpermute) eager and as a CUDA graph (launch cost).
Prints one JSON line per measurement and writes all of them to $OUT/kernel_probe.jsonl.

    python3 benchmarks/kernel_probe.py [SECTION ...]     # on the device machine; default: every section
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
    kw = {k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in kw.items()}  # 4 significant digits: kernel times are ~1e-5 s
    records.append(kw)
    print(json.dumps(kw), flush=True)
    with open(os.path.join(OUT, "kernel_probe.partial.jsonl"), "a") as fh:  # what a timeout leaves behind
        fh.write(json.dumps(kw) + "\n")


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


# --------------------------------------------------------------------------- MoE parts (issue 15)
#: (hidden, expert ffn), most-wanted first: catalog models' experts (Qwen3-30B-A3B, Qwen3-235B-A22B, GPT-OSS,
#: DeepSeek-V3, DeepSeek-V2-Lite / Moonlight), the probe runs' 64- and 8-expert models, Mixtral 8x7B
MOE_EXPERT_SHAPES = ((2048, 768), (4096, 1536), (2880, 2880), (7168, 2048), (2048, 1408), (1024, 704),
                     (1024, 2816), (4096, 14336))
#: local experts per rank (E / EP); Mixtral's 8 experts give at most 8, and its wide experts fill memory sooner
MOE_LOCAL_EXPERTS = (4, 8, 16, 32)
MOE_LOCAL_EXPERTS_WIDE = (1, 2, 4)
MOE_TOKENS_PER_EXPERT = (64, 256, 512, 1024, 4096)
#: Megatron's SequentialMLP (one GEMM pair per expert) is timed up to this many local experts
MOE_LOOP_MAX_EXPERTS = 8
#: one MoE layer's local work at 4096 tokens: (hidden, expert ffn, experts, topk)
MOE_LAYERS = ((1024, 2816, 8, 2), (1024, 704, 64, 8), (2048, 768, 128, 8))
MOE_TOKENS = (4096, 16384)
MOE_REP_MS = 60
#: the grouped-GEMM grid stops starting cases after this many seconds (the other MoE parts still run)
MOE_GRID_BUDGET_S = float(os.environ.get("MOE_GRID_BUDGET_S", "420"))


def _swiglu(x):
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


def _te():
    try:
        import transformer_engine.pytorch as te

        return te
    except Exception as e:  # the torch-only parts still run
        emit(kind="moe_note", note=f"transformer_engine not importable: {e!r}"[:300])
        return None


def _expert_impls(h, f, e, t, te):
    """name -> forward of e SwiGLU experts (fc1 h->2f, fc2 f->h) on e*t tokens, t per expert; TE first (what
    Megatron's TEGroupedMLP runs: a cuBLAS GEMM per expert), so a grid cut short by its budget still has it."""
    x = torch.randn(e * t, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    impls = {}
    if te is not None:
        fc1 = te.GroupedLinear(e, h, 2 * f, bias=False, params_dtype=torch.bfloat16, device="cuda")
        fc2 = te.GroupedLinear(e, f, h, bias=False, params_dtype=torch.bfloat16, device="cuda")
        splits = [t] * e
        impls["te_grouped_linear"] = lambda: fc2(_swiglu(fc1(x, splits)), splits)
    w1 = (0.02 * torch.randn(e, 2 * f, h, device=dev, dtype=torch.bfloat16)).requires_grad_()
    w2 = (0.02 * torch.randn(e, h, f, device=dev, dtype=torch.bfloat16)).requires_grad_()
    # one expert's weights on all e*t tokens: the dense rate at the same total work
    impls["dense_same_tokens"] = lambda: _swiglu(x @ w1[0].t()) @ w2[0].t()
    if hasattr(torch, "_grouped_mm"):
        offs = torch.arange(t, e * t + 1, t, device=dev, dtype=torch.int32)
        impls["torch_grouped_mm"] = lambda: torch._grouped_mm(
            _swiglu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)), w2.transpose(-2, -1), offs=offs)
    if e <= MOE_LOOP_MAX_EXPERTS:  # Megatron's SequentialMLP: one GEMM pair per local expert
        impls["loop"] = lambda: torch.cat([_swiglu(xe @ w1[i].t()) @ w2[i].t() for i, xe in enumerate(x.split(t))])
    return impls


def moe_grouped_gemm(te):
    import time

    t0 = time.perf_counter()
    for h, f in MOE_EXPERT_SHAPES:
        for e in (MOE_LOCAL_EXPERTS_WIDE if f > 8192 else MOE_LOCAL_EXPERTS):
            for t in MOE_TOKENS_PER_EXPERT:
                if time.perf_counter() - t0 > MOE_GRID_BUDGET_S:
                    emit(kind="moe_note", note=f"grouped-GEMM grid stopped at its budget before h{h} f{f} e{e} t{t}")
                    return
                _grouped_case(h, f, e, t, te)
                torch.cuda.empty_cache()


def _host_issue_s(fn, n=10):
    """CPU seconds to issue fn's kernels (no sync inside), the GPU drained before and after."""
    import time

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    return t


_GRAPH_FAILED: list = []  # a failed capture can leave the stream unusable: capture no more after one


def _grouped_case(h, f, e, t, te):
    fl = 6.0 * e * t * h * f  # SwiGLU expert forward: 2*t*h*2f + 2*t*f*h per expert
    gy = torch.randn(e * t, h, device=dev, dtype=torch.bfloat16)
    for name, fwd in _expert_impls(h, f, e, t, te).items():
        rec = {"impl": name, "hidden": h, "ffn": f, "local_experts": e, "tokens_per_expert": t}
        try:
            step = lambda fwd=fwd: fwd().backward(gy)  # noqa: E731
            tf = bench(fwd, rep=MOE_REP_MS)
            tfb = bench(step, rep=MOE_REP_MS)
            extra = {}
            if name == "te_grouped_linear":  # the GPU's own time (graph replay) and the host's issue time
                extra = {"host_issue_fwd_bwd_s": _host_issue_s(step)}
                if not _GRAPH_FAILED:
                    extra.update(_graphed(fwd, step))
                    _GRAPH_FAILED.extend(k for k in extra if k.endswith("_error"))
            emit(kind="moe_grouped_gemm", **rec, fwd_s=tf, fwd_bwd_s=tfb, fwd_tflops=fl / tf / 1e12,
                 fwd_bwd_tflops=3 * fl / tfb / 1e12, **extra)
        except Exception as exc:
            emit(kind="moe_grouped_gemm", **rec, error=repr(exc)[:300])


def _routing(T, E, k):
    """A top-k routing of T tokens over E experts: (bool map [T, E], bf16 probs [T, E])."""
    scores = torch.randn(T, E, device=dev).softmax(-1)
    p, idx = torch.topk(scores, k)
    rmap = torch.zeros(T, E, dtype=torch.bool, device=dev).scatter_(1, idx, True)
    probs = torch.zeros(T, E, device=dev).scatter_(1, idx, p).to(torch.bfloat16)
    return rmap, probs


def moe_permute():
    for T in MOE_TOKENS:
        for h, _, E, k in (*MOE_LAYERS, (4096, 0, 64, 8), (4096, 0, 128, 8), (7168, 0, 256, 8)):
            for fused in (False, True):
                _permute_case(T, h, E, k, fused)


def _permute_case(T, h, E, k, fused):
    """Megatron's permute (tokens and probs, as the alltoall dispatcher calls it) and unpermute."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    rmap, probs = _routing(T, E, k)
    x = torch.randn(T, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, h, device=dev, dtype=torch.bfloat16)
    rec = {"fused": fused, "tokens": T, "hidden": h, "experts": E, "topk": k}

    def fwd():
        out, _, idx, _, _ = permute(x, rmap, probs=probs, num_out_tokens=T * k, fused=fused)
        return out, idx

    def back():
        return unpermute(*fwd(), x.shape, routing_map=rmap, fused=fused)

    try:
        out, idx = fwd()
        tp = bench(fwd, rep=MOE_REP_MS)
        tu = bench(lambda: unpermute(out, idx, x.shape, routing_map=rmap, fused=fused), rep=MOE_REP_MS)
        tfb = bench(lambda: back().backward(g), rep=MOE_REP_MS)
        emit(kind="moe_permute", **rec, permute_fwd_s=tp, unpermute_fwd_s=tu, roundtrip_fwd_bwd_s=tfb,
             permute_gbps=2 * T * k * h * 2 / tp / 1e9)
    except Exception as exc:
        emit(kind="moe_permute", **rec, error=repr(exc)[:300])


def moe_router():
    for T in MOE_TOKENS:
        for h, _, E, k in MOE_LAYERS:
            for fused in (False, True):
                for aux in (False, True):
                    _router_case(T, h, E, k, fused, aux)


def _router_case(T, h, E, k, fused, aux):
    from megatron.core.transformer.moe.moe_utils import (
        compute_routing_scores_for_aux_loss,
        switch_load_balancing_loss_func,
        topk_routing_with_score_function,
    )

    x = torch.randn(T, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (0.02 * torch.randn(E, h, device=dev, dtype=torch.bfloat16)).requires_grad_()
    rec = {"fused": fused, "aux_loss": aux, "tokens": T, "hidden": h, "experts": E, "topk": k}

    def run():
        logits = F.linear(x, w)  # router_gating_linear in the input dtype
        probs, _ = topk_routing_with_score_function(logits, k, fused=fused)
        loss = probs.float().sum()
        if aux:  # --moe-aux-loss-coeff > 0: the scores and the switch loss
            rmap, scores = compute_routing_scores_for_aux_loss(logits, k, "softmax", fused=fused)
            loss = loss + switch_load_balancing_loss_func(scores, rmap.sum(0), T, k, E, 1e-2, fused=fused)
        loss.backward()

    try:
        emit(kind="moe_router", **rec, fwd_bwd_s=bench(run, rep=MOE_REP_MS))
    except Exception as exc:
        emit(kind="moe_router", **rec, error=repr(exc)[:300])


def _moe_layer(h, f, E, k, T, te):
    """One MoE layer's local work (no dispatcher communication): router, fused permute, TE grouped
    experts, fused unpermute; balanced routing (T*k/E tokens per expert), as a forward callable."""
    from megatron.core.transformer.moe.moe_utils import permute, topk_routing_with_score_function, unpermute

    x = torch.randn(T, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (0.02 * torch.randn(E, h, device=dev, dtype=torch.bfloat16)).requires_grad_()
    fc1 = te.GroupedLinear(E, h, 2 * f, bias=False, params_dtype=torch.bfloat16, device="cuda")
    fc2 = te.GroupedLinear(E, f, h, bias=False, params_dtype=torch.bfloat16, device="cuda")
    rmap, _ = _routing(T, E, k)
    splits = [T * k // E] * E  # a fixed split keeps the host list static, as graphs need

    def fwd():
        probs, _ = topk_routing_with_score_function(F.linear(x, w), k, fused=True)
        out, pprobs, idx, _, _ = permute(x, rmap, probs=probs, num_out_tokens=T * k, fused=True)
        y = fc2(_swiglu(fc1(out, splits)) * pprobs.unsqueeze(-1).to(out.dtype), splits)
        return unpermute(y, idx, x.shape, routing_map=rmap, fused=True)

    return x, fwd


def moe_layer_graph(te):
    """Eager vs CUDA-graph replay of one MoE layer's forward and forward+backward; host_issue_s is the
    CPU time to launch one eager forward+backward (the GPU waits when it exceeds the kernels' time)."""
    for h, f, E, k in MOE_LAYERS:
        rec = {"hidden": h, "ffn": f, "experts": E, "topk": k, "tokens": 4096}
        try:
            emit(kind="moe_layer_graph", **rec, **_layer_case(h, f, E, k, 4096, te))
        except Exception as exc:
            emit(kind="moe_layer_graph", **rec, error=repr(exc)[:300])
        torch.cuda.empty_cache()


def _layer_case(h, f, E, k, T, te) -> dict:
    import time

    _, fwd = _moe_layer(h, f, E, k, T, te)
    g = torch.randn(T, h, device=dev, dtype=torch.bfloat16)

    def step():
        fwd().backward(g)

    rec = {"eager_fwd_s": bench(fwd, rep=MOE_REP_MS), "eager_fwd_bwd_s": bench(step, rep=MOE_REP_MS)}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        step()
    rec["host_issue_s"] = (time.perf_counter() - t0) / 10
    torch.cuda.synchronize()
    return {**rec, **_graphed(fwd, step)}


def _graphed(fwd, step) -> dict:
    out = {}
    for name, fn in (("fwd", fwd), ("fwd_bwd", step)):
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            out[f"graph_{name}_s"] = bench(graph.replay, rep=MOE_REP_MS)
        except Exception as exc:
            out[f"graph_{name}_error"] = repr(exc)[:300]
    return out


def moe():
    te = _te()
    moe_grouped_gemm(te)
    for part in (moe_permute, moe_router):
        try:
            part()
        except Exception as exc:
            emit(kind="section_error", section=part.__name__, error=repr(exc)[:500])
    if te is not None:
        moe_layer_graph(te)


def main():
    props = torch.cuda.get_device_properties(0)
    emit(kind="device", name=props.name, sms=props.multi_processor_count, torch=torch.__version__,
         mem_gib=props.total_memory / 2**30)
    sections = [gemm_sweep, fp8_sweep, attention, unfused_attention, elementwise, cross_entropy, adam, moe]
    wanted = set(sys.argv[1:])
    unknown = wanted - {f.__name__ for f in sections}
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {[f.__name__ for f in sections]}")
    for f in [f for f in sections if not wanted or f.__name__ in wanted]:
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
