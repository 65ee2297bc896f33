"""The MoE alltoall dispatcher's all-to-all as Megatron issues it, against the even all-to-all the NCCL
probe times (evidence for physics/moe.py's dispatch term).

    torchrun --nproc_per_node=N benchmarks/a2a_probe.py      # on a multi-GPU device machine

Megatron's MoEAlltoAllTokenDispatcher always passes input/output split sizes to all_to_all_single (the
rows each rank routes to each peer), so torch takes its unequal-split path; benchmarks/nccl_probe.py
times the equal split only. For each total size S a rank sends (bf16 rows of hidden 2048; sizes bracket
the multi-GPU rows: 16-512 MiB), in EP groups of 2 and of N ranks (the groups of one size run at once,
as EP2 x DP2 does on 4 GPUs), this times:
- even:          all_to_all_single without split sizes;
- even_splits:   the same bytes with explicit equal split sizes (the path Megatron takes, no imbalance);
- routed:        split sizes drawn as a router spreads T*k rows over E experts whose popularity follows
                 a gamma law of coefficient of variation CV (the profile jobs measured 0.2), a fresh draw
                 per call: every rank sends S, receives what its experts drew;
- skew:          even_splits after a per-rank GPU busy-wait of r * SKEW_MS (rank r), which shows that a
                 rank's NCCL kernel time includes waiting for its slowest peer.
Each call starts after a barrier and a device sync; CUDA events time it on every rank; rows report the
slowest rank's time (what the step waits for), rank 0's and the mean. Writes $OUT/a2a_probe.jsonl.
NVLink multicast stays off (the caller exports NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import json
import os
import statistics

import numpy as np
import torch
import torch.distributed as dist

HIDDEN = 2048
SIZES_MIB = (16, 64, 128, 256, 512)
EXPERTS = 64
CV = 0.2
REPS = 12
SKEW_MS = 1.0


def _row_splits(rows: int, ep: int, rng: np.random.Generator, routed: bool) -> list[list[int]]:
    """[src][dst] rows: each source sends `rows`; routed draws expert popularity then a multinomial."""
    if not routed:
        base = [rows // ep] * ep
        base[-1] += rows - sum(base)
        return [list(base) for _ in range(ep)]
    shape = 1.0 / CV**2
    out = []
    for _ in range(ep):
        p = rng.gamma(shape, 1.0 / shape, EXPERTS)
        per_expert = rng.multinomial(rows, p / p.sum())
        out.append([int(x) for x in per_expert.reshape(ep, -1).sum(axis=1)])
    return out


def _spin(ms: float) -> None:
    if ms > 0:
        torch.cuda._sleep(int(ms * 1e-3 * 1.98e9))  # clock cycles at the H100's boost clock (1.98 GHz)


def _one(group, me: int, splits: list[list[int]], explicit: bool, spin_ms: float) -> float:
    send = splits[me]
    recv = [splits[s][me] for s in range(len(splits))]
    inp = torch.empty(sum(send), HIDDEN, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(sum(recv), HIDDEN, device="cuda", dtype=torch.bfloat16)
    dist.barrier()
    torch.cuda.synchronize()
    _spin(spin_ms)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    if explicit:
        dist.all_to_all_single(out, inp, recv, send, group=group)
    else:
        dist.all_to_all_single(out, inp, group=group)
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / 1e3


def _case(group, ep: int, me: int, rows: int, case: str, rng) -> list[float]:
    times = []
    for i in range(REPS + 2):
        splits = _row_splits(rows, ep, rng, routed=case == "routed")
        t = _one(group, me, splits, explicit=case != "even", spin_ms=SKEW_MS * me if case == "skew" else 0.0)
        if i >= 2:
            times.append(t)
    return times


def main() -> None:
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rows_out = []
    for ep in sorted({2, n}):
        groups = [dist.new_group(list(range(g, g + ep))) for g in range(0, n, ep)]
        group, me = groups[rank // ep], rank % ep
        # the same draws on every rank of a group: seed by the group's first rank
        rng = np.random.default_rng(1234 + rank // ep)
        for mib in SIZES_MIB:
            rows = mib * 2**20 // (HIDDEN * 2)
            for case in ("even", "even_splits", "routed", "skew"):
                mine = torch.tensor(statistics.median(_case(group, ep, me, rows, case, rng)), device="cuda")
                every = [torch.zeros_like(mine) for _ in range(n)]
                dist.all_gather(every, mine)
                ts = [float(x) for x in every]
                r = {"op": "all_to_all", "case": case, "ep": ep, "groups_at_once": n // ep, "bytes_sent_per_rank": rows * HIDDEN * 2,
                     "rank_median_us": [round(1e6 * t, 1) for t in ts], "slowest_us": round(1e6 * max(ts), 1),
                     "rank0_us": round(1e6 * ts[0], 1), "mean_us": round(1e6 * sum(ts) / n, 1),
                     "algbw_slowest_gbps": round(rows * HIDDEN * 2 / max(ts) / 1e9, 1)}
                if case == "routed":
                    r["cv"] = CV
                    r["experts"] = EXPERTS
                if case == "skew":
                    r["skew_ms_per_rank_index"] = SKEW_MS
                rows_out.append(r)
                if rank == 0:
                    print(json.dumps(r), flush=True)
    if rank == 0:
        meta = {"op": "device", "name": torch.cuda.get_device_name(), "torch": torch.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())), "ranks": n, "nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
                "reps": REPS, "statistic": "median per rank of REPS calls, each after a barrier"}
        with open(os.path.join(os.environ.get("OUT", "."), "a2a_probe.jsonl"), "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in [meta, *rows_out])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
