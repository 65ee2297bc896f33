"""NCCL collective bandwidth between the GPUs of one node (evidence for perf.NVLINK_EFFICIENCY).

    torchrun --nproc_per_node=N benchmarks/nccl_probe.py      # on a multi-GPU device machine

Times all-reduce, all-gather and reduce-scatter of bf16 tensors from 1 MiB to 1 GiB (full size)
and prints nccl-tests' bus bandwidth: all-reduce 2(n-1)/n * S / t, all-gather and reduce-scatter
(n-1)/n * S / t. Writes $OUT/nccl_probe.jsonl from rank 0.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rows = []
    for mib in (1, 4, 16, 64, 256, 1024):
        S = mib * 2**20
        full = torch.randn(S // 2, device="cuda", dtype=torch.bfloat16)
        shard = torch.empty(S // 2 // n, device="cuda", dtype=torch.bfloat16)
        ops = {
            "all_reduce": (lambda full=full: dist.all_reduce(full), 2.0),
            "all_gather": (lambda full=full, shard=shard: dist.all_gather_into_tensor(full, shard), 1.0),
            "reduce_scatter": (lambda full=full, shard=shard: dist.reduce_scatter_tensor(shard, full), 1.0),
        }
        for name, (fn, factor) in ops.items():
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            reps = 20
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(reps):
                fn()
            e.record()
            torch.cuda.synchronize()
            t = s.elapsed_time(e) / 1e3 / reps
            r = dict(op=name, ranks=n, bytes=S, time_us=round(t * 1e6, 1), busbw_gbps=round(factor * (n - 1) / n * S / t / 1e9, 1))
            rows.append(r)
            if rank == 0:
                print(json.dumps(r), flush=True)
    if rank == 0:
        with open(os.path.join(os.environ.get("OUT", "."), "nccl_probe.jsonl"), "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
