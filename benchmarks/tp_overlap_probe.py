"""TP-communication overlap probe on one multi-GPU node (evidence for physics/step_time's TP terms
with tp_comm_overlap: the userbuffers ring exchange's bandwidth, NCCL's all-gather / reduce-scatter at
the SP activation sizes of large models, and what a collective running beside a GEMM costs the GEMM).

    python benchmarks/tp_overlap_probe.py p2p                      # one process, every GPU
    torchrun --nproc_per_node=N benchmarks/tp_overlap_probe.py nccl

'p2p': Transformer Engine's ring-exchange overlap (UbufP2PCommOverlap, the default method of qkv_fprop,
fc1_fprop, proj_dgrad and fc2_dgrad in TE's initialize_ub) sends 1/tp of the activation to the next
rank at each of tp - 1 steps with copy-engine peer copies while the GEMM of the chunk in hand runs.
Timed here: every GPU copying a chunk to its ring neighbour at once (cudaMemcpyPeerAsync through
torch), chunk sizes 2-64 MiB; then a bf16 GEMM of transformer shape alone, and beside those copies.
'nccl': all-gather and reduce-scatter of 16-512 MiB tensors (bus bandwidth as nccl-tests), and the
same GEMM alone and beside an all-gather on another stream (the SM share NCCL's kernels take).
Writes $OUT/tp_overlap_<mode>.jsonl (rank 0). NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nccl_probe import _time as _nccl_time  # noqa: E402  (benchmarks/ is not a package)

REPS = 10
GEMM = (8192, 8192, 8192)  # M, N, K of the GEMM timed beside communication


def _time(fn, reps: int = REPS) -> float:
    """Median seconds of one call (CUDA events): nccl_probe's timer."""
    return _nccl_time(fn, reps)


def _wall(fn, reps: int = REPS) -> float:
    """Median wall seconds of fn() followed by a synchronize of every GPU."""
    import time
    for _ in range(2):
        fn()
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _write(rows: list, name: str) -> None:
    with open(os.path.join(os.environ.get("OUT", "."), name), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


def p2p() -> None:
    n = torch.cuda.device_count()
    rows = [{"op": "device", "name": torch.cuda.get_device_name(0), "gpus": n, "torch": torch.__version__}]
    for i in range(n):
        for j in range(n):
            if i != j:
                rows.append({"op": "can_access_peer", "src": i, "dst": j, "ok": torch.cuda.can_device_access_peer(i, j)})
    streams = [torch.cuda.Stream(device=d) for d in range(n)]
    for mib in (2, 8, 16, 32, 64):
        elems = mib * 2**20 // 2
        src = [torch.randn(elems, device=f"cuda:{d}", dtype=torch.bfloat16) for d in range(n)]
        dst = [torch.empty(elems, device=f"cuda:{d}", dtype=torch.bfloat16) for d in range(n)]

        def ring(src=src, dst=dst):
            for d in range(n):
                with torch.cuda.stream(streams[d]):
                    dst[(d + 1) % n].copy_(src[d], non_blocking=True)

        t = _wall(ring)
        rows.append({"op": "ring_p2p_copy", "gpus": n, "chunk_bytes": mib * 2**20, "time_us": round(t * 1e6, 1),
                     "per_link_gbps": round(mib * 2**20 / t / 1e9, 1)})
        print(json.dumps(rows[-1]), flush=True)
    # GEMM on GPU 0 alone and beside a stream of ring copies into and out of it.
    m, nn, k = GEMM
    a = torch.randn(m, k, device="cuda:0", dtype=torch.bfloat16)
    b = torch.randn(k, nn, device="cuda:0", dtype=torch.bfloat16)
    torch.cuda.set_device(0)
    t_gemm = _time(lambda: a @ b)
    elems = 64 * 2**20 // 2
    src = [torch.randn(elems, device=f"cuda:{d}", dtype=torch.bfloat16) for d in range(n)]
    dst = [torch.empty(elems, device=f"cuda:{d}", dtype=torch.bfloat16) for d in range(n)]
    copies = 12

    def both():
        for _ in range(copies):
            for d in range(n):
                with torch.cuda.stream(streams[d]):
                    dst[(d + 1) % n].copy_(src[d], non_blocking=True)
        for _ in range(4):
            a @ b

    def copies_only():
        for _ in range(copies):
            for d in range(n):
                with torch.cuda.stream(streams[d]):
                    dst[(d + 1) % n].copy_(src[d], non_blocking=True)

    t_both, t_copy = _wall(both), _wall(copies_only)
    rows.append({"op": "gemm_beside_p2p", "gemm_mnk": GEMM, "gemm_alone_us": round(t_gemm * 1e6, 1),
                 "four_gemms_and_copies_us": round(t_both * 1e6, 1), "copies_alone_us": round(t_copy * 1e6, 1),
                 "four_gemms_alone_us": round(4 * t_gemm * 1e6, 1)})
    print(json.dumps(rows[-1]), flush=True)
    _write(rows, "tp_overlap_p2p.jsonl")


def nccl() -> None:
    import torch.distributed as dist
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rows = [{"op": "device", "name": torch.cuda.get_device_name(), "ranks": n, "torch": torch.__version__,
             "nccl": ".".join(map(str, torch.cuda.nccl.version())), "nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}]
    for mib in (16, 32, 64, 128, 256, 512):
        S = mib * 2**20
        full = torch.randn(S // 2, device="cuda", dtype=torch.bfloat16)
        shard = torch.empty(S // 2 // n, device="cuda", dtype=torch.bfloat16)
        for name, fn in (("all_gather", lambda full=full, shard=shard: dist.all_gather_into_tensor(full, shard)),
                         ("reduce_scatter", lambda full=full, shard=shard: dist.reduce_scatter_tensor(shard, full))):
            t = _time(fn)
            rows.append({"op": name, "ranks": n, "bytes": S, "time_us": round(t * 1e6, 1),
                         "busbw_gbps": round((n - 1) / n * S / t / 1e9, 1)})
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
        del full, shard
    m, nn, k = GEMM
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, nn, device="cuda", dtype=torch.bfloat16)
    S = 128 * 2**20
    full = torch.empty(S // 2, device="cuda", dtype=torch.bfloat16)
    shard = torch.randn(S // 2 // n, device="cuda", dtype=torch.bfloat16)
    comm = torch.cuda.Stream()
    t_gemm = _time(lambda: a @ b)
    t_ag = _time(lambda: dist.all_gather_into_tensor(full, shard))
    gemms = max(1, round(t_ag / t_gemm))

    def both():
        with torch.cuda.stream(comm):
            dist.all_gather_into_tensor(full, shard)
        for _ in range(gemms):
            a @ b
        torch.cuda.current_stream().wait_stream(comm)

    t_both = _time(both)
    rows.append({"op": "gemm_beside_all_gather", "ranks": n, "gemm_mnk": GEMM, "gemm_alone_us": round(t_gemm * 1e6, 1),
                 "gemms": gemms, "all_gather_bytes": S, "all_gather_alone_us": round(t_ag * 1e6, 1),
                 "both_us": round(t_both * 1e6, 1)})
    if rank == 0:
        print(json.dumps(rows[-1]), flush=True)
        _write(rows, "tp_overlap_nccl.jsonl")
    dist.destroy_process_group()


if __name__ == "__main__":
    {"p2p": p2p, "nccl": nccl}[sys.argv[1]]()
