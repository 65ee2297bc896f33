"""NCCL collective bandwidth and latency between the GPUs of one node (evidence for the step-time
model's NVLink terms: perf.NVLINK_EFFICIENCY and the collectives' latency).

    torchrun --nproc_per_node=N benchmarks/nccl_probe.py      # on a multi-GPU device machine

Times, on bf16 tensors from 64 KiB to 1 GiB (full size S), the collectives Megatron's layouts send:
all-reduce (TP without SP, DDP), all-gather and reduce-scatter (SP, distributed optimizer), all-to-all
(the MoE alltoall dispatcher) and a paired send/recv (PP stages, CP's ring), and prints nccl-tests'
bus bandwidth: all-reduce 2(n-1)/n * S / t; all-gather, reduce-scatter and all-to-all (n-1)/n * S / t;
send/recv S / t. Sizes bracket what the multi-GPU plans send per call (benchmarks/gpu/configs_multi.py:
SP activations 16-32 MiB, EP dispatch 16-64 MiB, DP buckets ~40M fp32 params). The median of
`REPS` timed calls after warm-up; `latency_us` = the time at the smallest size. Writes
$OUT/nccl_probe.jsonl from rank 0. NVLink multicast (NVLS) must stay off: the caller exports
NCCL_NVLS_ENABLE=0.
"""

from __future__ import annotations

import json
import os
import statistics

import torch
import torch.distributed as dist

SIZES_KIB = (64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
REPS = 20


def _time(fn, reps: int) -> float:
    """Median seconds of one call, each timed with CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) / 1e3)
    return statistics.median(out)


def _ops(full: torch.Tensor, shard: torch.Tensor, out: torch.Tensor, rank: int, n: int) -> dict:
    """name -> (callable, bus-bandwidth factor on S / t)."""
    peer = (rank + 1) % n
    src = (rank - 1) % n

    def sendrecv():
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, full, peer), dist.P2POp(dist.irecv, out, src)])
        for r in reqs:
            r.wait()

    return {
        "all_reduce": (lambda: dist.all_reduce(full), 2.0 * (n - 1) / n),
        "all_gather": (lambda: dist.all_gather_into_tensor(full, shard), (n - 1) / n),
        "reduce_scatter": (lambda: dist.reduce_scatter_tensor(shard, full), (n - 1) / n),
        "all_to_all": (lambda: dist.all_to_all_single(out, full), (n - 1) / n),
        "sendrecv": (sendrecv, 1.0),
    }


def main() -> None:
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rows = []
    for kib in SIZES_KIB:
        S = kib * 1024
        full = torch.randn(S // 2, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(full)
        shard = torch.empty(S // 2 // n, device="cuda", dtype=torch.bfloat16)
        for name, (fn, factor) in _ops(full, shard, out, rank, n).items():
            t = _time(fn, REPS)
            r = {"op": name, "ranks": n, "bytes": S, "time_us": round(t * 1e6, 1),
                 "algbw_gbps": round(S / t / 1e9, 1), "busbw_gbps": round(factor * S / t / 1e9, 1)}
            rows.append(r)
            if rank == 0:
                print(json.dumps(r), flush=True)
        del full, out, shard
    if rank == 0:
        meta = {"op": "device", "name": torch.cuda.get_device_name(), "torch": torch.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())), "ranks": n,
                "nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
        with open(os.path.join(os.environ.get("OUT", "."), "nccl_probe.jsonl"), "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in [meta, *rows])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
