"""Host cost of a GEMM shape the BLAS library has not met before (issue 15's as-is-routing MoE rows).

Run on a GPU machine:  python3 benchmarks/gpu/gemm_shape_probe.py  (writes $OUT/gemm_shape_probe.json)

The traces of MoE rows with as-is routing show 1.5-12 ms host gaps inside Transformer Engine's grouped GEMM
with no CUDA call under them, where each expert's row count changes from call to call; with forced
balancing (nearly fixed counts) they are small. This probe times the host side of bf16 GEMMs at an expert's
shape (rows m x hidden k -> ffn n) through cuBLASLt and cuBLAS: the same m again and again, a new m every
call, and the same new m values a second time (now met before). Host time = the call's wall time without
a device sync (the launch is asynchronous), median over the calls; the GPU is kept busy enough that the
host never waits for it.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

SHAPES = ((2048, 1408), (4096, 1536))  # (hidden k, expert ffn n): the L set's 64-expert MoE, Qwen3-235B-A22B
CALLS = 300


def host_ms(fn, ms: list[int]) -> list[float]:
    out = []
    for m in ms:
        t0 = time.perf_counter()
        fn(m)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def probe(lib: str, k: int, n: int) -> dict:
    torch.backends.cuda.preferred_blas_library(lib)
    dev = torch.device("cuda")
    x = torch.randn(8192, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(k, n, device=dev, dtype=torch.bfloat16)

    def gemm(m):
        return torch.mm(x[:m], w)

    for _ in range(20):
        gemm(2048)
    torch.cuda.synchronize()
    same = host_ms(gemm, [2048] * CALLS)
    torch.cuda.synchronize()
    base = 1000 + 97 * (hash((lib, k, n)) % 50)
    fresh_m = [base + 3 * i for i in range(CALLS)]  # never met before in this process
    fresh = host_ms(gemm, fresh_m)
    torch.cuda.synchronize()
    again = host_ms(gemm, fresh_m)
    torch.cuda.synchronize()
    return {"lib": lib, "k": k, "n": n, "calls": CALLS,
            "same_m_host_ms_median": statistics.median(same), "new_m_host_ms_median": statistics.median(fresh),
            "new_m_host_ms_mean": statistics.fmean(fresh), "met_before_host_ms_median": statistics.median(again)}


def main() -> None:
    rows = [probe(lib, k, n) for lib in ("cublaslt", "cublas") for k, n in SHAPES]
    env = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda}
    out = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gemm_shape_probe.json"), "w") as f:
        json.dump({"env": env, "rows": rows, "source": __doc__.split("\n\n")[0]}, f, indent=1)
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
