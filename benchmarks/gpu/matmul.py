"""bf16 8192^3 matrix-product rate on each GPU of the machine (one line of JSON).

Random data (never zeros: METHOD.md), 3 warm-ups, then the mean of 20 timed products with CUDA
events, per GPU; the same measurement as KINDS.md's ceiling.
"""

import json
import sys

import torch


def rate(dev: int, n: int = 8192, reps: int = 20) -> float:
    torch.cuda.set_device(dev)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        a @ b
    e.record()
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (s.elapsed_time(e) / 1e3) / 1e12


if __name__ == "__main__":
    rows = [{"gpu": d, "name": torch.cuda.get_device_name(d), "bf16_8192_matmul_tflops": round(rate(d), 1)}
            for d in range(torch.cuda.device_count())]
    print(json.dumps({"matmul": rows, "torch": torch.__version__, "cuda": torch.version.cuda,
                      "python": sys.version.split()[0]}))
