"""Host cost of a GEMM shape the BLAS library has not met before (issue 15's as-is-routing MoE rows).

Run on a GPU machine:  python3 benchmarks/gpu/gemm_shape_probe.py [TAG]  (writes $OUT/gemm_shape_probe[_TAG].json)

The traces of MoE rows with as-is routing show 1.5-12 ms host gaps inside Transformer Engine's grouped GEMM
with no CUDA call under them, where each expert's row count changes from call to call; with forced
balancing (nearly fixed counts) they are small. This probe times the host side of bf16 GEMMs at an expert's
shape (rows m x hidden k -> ffn n) through cuBLASLt and cuBLAS: the same m again and again, a new m every
call, and the same new m values a second time (now met before). Host time = the call's wall time without
a device sync (the launch is asynchronous), median over the calls; the GPU is kept busy enough that the
host never waits for it. Each of an expert's three GEMM problems: 'fwd' (m rows x k -> n), 'dgrad' (m x n ->
k) and 'wgrad' (k x m times m x n: the row count is the reduction dimension). Session s10 ran it alone on one
GPU and as four processes at once, one per GPU (the training ranks' contention), with a TAG each.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

SHAPES = ((2048, 1408), (2048, 2816), (1408, 2048), (4096, 1536))  # (k, n): the L set 64-expert MoE fc1 (and with SwiGLU), fc2; Qwen3-235B-A22B
CALLS = 300


def host_ms(fn, ms: list[int]) -> list[float]:
    out = []
    for m in ms:
        t0 = time.perf_counter()
        fn(m)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _gemm(problem: str, k: int, n: int):
    dev = torch.device("cuda")
    if problem == "wgrad":
        a = torch.randn(k, 8192, device=dev, dtype=torch.bfloat16)
        b = torch.randn(8192, n, device=dev, dtype=torch.bfloat16)
        return lambda m: torch.mm(a[:, :m], b[:m])
    rows, out = (k, n) if problem == "fwd" else (n, k)
    x = torch.randn(8192, rows, device=dev, dtype=torch.bfloat16)
    w = torch.randn(rows, out, device=dev, dtype=torch.bfloat16)
    return lambda m: torch.mm(x[:m], w)


def probe(lib: str, k: int, n: int, problem: str = "fwd") -> dict:
    torch.backends.cuda.preferred_blas_library(lib)
    gemm = _gemm(problem, k, n)

    for _ in range(20):
        gemm(2048)
    torch.cuda.synchronize()
    same = host_ms(gemm, [2048] * CALLS)
    torch.cuda.synchronize()
    base = 1000 + 97 * (sum(map(ord, f"{lib}{k}{n}{problem}")) % 50)
    fresh_m = [base + 3 * i for i in range(CALLS)]  # never met before in this process
    fresh = host_ms(gemm, fresh_m)
    torch.cuda.synchronize()
    again = host_ms(gemm, fresh_m)
    torch.cuda.synchronize()
    return {"lib": lib, "k": k, "n": n, "problem": problem, "calls": CALLS,
            "same_m_host_ms_median": statistics.median(same), "new_m_host_ms_median": statistics.median(fresh),
            "new_m_host_ms_mean": statistics.fmean(fresh), "new_m_host_ms_p90": sorted(fresh)[int(0.9 * CALLS)],
            "new_m_over_1ms": sum(t > 1.0 for t in fresh), "met_before_host_ms_median": statistics.median(again)}


def main() -> None:
    tag = sys.argv[1] if len(sys.argv) > 1 else ""
    rows = [probe(lib, k, n, problem) for lib in ("cublaslt", "cublas") for k, n in SHAPES
            for problem in ("fwd", "dgrad", "wgrad")]
    env = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda, "tag": tag,
           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    out = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"gemm_shape_probe{'_' + tag if tag else ''}.json"), "w") as f:
        json.dump({"env": env, "rows": rows, "source": __doc__.split("\n\n")[0]}, f, indent=1)
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
