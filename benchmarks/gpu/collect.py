"""Merge what the device calls brought back into benchmarks/results/ (run here, after the calls).

    python3 benchmarks/gpu/collect.py /work/.device/6 /work/.device/10 ...

Writes gpu_h200_runs.jsonl (issue-7 targets), gpu_memory_sweep.jsonl, gpu_recommend_sweep.jsonl
(one JSON line per run: plan, measured figures, train.log text, error if any), gpu_h200_env.json,
gpu_logs/<run>/ (train.log, error.json, output tail), gpu_traces/ (a few rank-0 traces) and
gpu_h200_summary.md (the table). Figures are copied, never recomputed or extrapolated.
"""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results"
KEEP_TRACES = ("t_gpt1.3b_te_bf16_mbs8", "m_gpt1.3b_dp2_distopt_mbs4")
FILES = {"target": "gpu_h200_runs.jsonl", "memory": "gpu_memory_sweep.jsonl", "recommend": "gpu_recommend_sweep.jsonl"}
# Published Megatron-LM pretrain_gpt.py figures on this machine type (shared reference TE-on-gpu.md)
# and the SDPA probe (shared data device-measurements-h200.jsonl): the issue-7 targets.
TARGETS = {
    "t_gpt1.3b_te_bf16_mbs8": ("tflops_per_gpu_causal", 507.0),
    "t_gpt1.3b_te_fp8_mbs8": ("tflops_per_gpu_causal", 657.0),
    "t_gpt2.7b_te_tp2sp_mbs8": ("tflops_per_gpu_causal", 417.0),
    "t_gpt1.3b_sdpa_mbs8": ("tflops_per_gpu_full", 441.0),
    "t_gpt1.3b_te_bf16_mbs8_nogaf": ("tflops_per_gpu_causal", 507.0),
    "t_gpt1.3b_te_fp8_mbs8_nogaf": ("tflops_per_gpu_causal", 657.0),
    "t_gpt2.7b_te_tp2sp_mbs8_nogaf": ("tflops_per_gpu_causal", 417.0),
}


NOTES = """
## Notes (read with the table)

- Device: 2x NVIDIA H200 (143771 MiB, 700 W limit, kernel 6.18.44-fc-v657-gpu), torch 2.11.0+cu130,
  CUDA 13.0, Python 3.12.3, megatron-core 0.19.2, Transformer Engine 2.20.2 (core cu13 wheel + torch
  extension built on the machine with NVTE_CUDA_ARCHS=90; reassembly + install + build took 110 s).
  The Megatron-LM argument check (megatron_args_check.txt) ran in the first call, before TE was installed. Git state of each call: `git_state` in each row
  (HEAD e56df3d5, working tree dirty: the entry files were not yet committed).
- Attention kernels seen in the traces: TE picked cuDNN fused attention (cudnn_generated_fort_native_sdpa_sm90_flash_*);
  torch SDPA in the local spec also ran cuDNN's flash kernels.
- Targets missed by 1-2 %: FP8 hybrid 646.2 vs 657 and 2.7B TP2+SP 412.5 vs 417 TFLOP/s (causal). No device time was
  left to investigate or rerun. The 2.7B trace shows 0.31 s/iteration of exposed TP communication (all-gather /
  reduce-scatter, no TE comm overlap in either run); Megatron-LM's published run was 2612 ms vs our 2639 ms.
- Small micro-batches are host-bound: GPT 1.3B TE at mbs 4 gives 359 TFLOP/s (Megatron-LM published 463 at mbs 4),
  mbs 1 gives 116; mbs 8 matches (506.6-510.7 vs 507). 1.3B with TP2(+SP) at mbs 4 is also host-bound (tp2sp trace:
  696 ms of kernels in a 2476 ms profiled step). Cause not established (candidates: per-micro-batch Python/TE
  launch cost on this VM's CPUs, the plan-default overlap_grad_reduce hooks, the concurrent run on the other GPU).
- Sweep runs ran two at a time (one per GPU), see 'ran alongside'; the BF16 1.3B target and all 2-GPU runs ran alone.
- Not run (device budget spent): m_gqa1.5b_pp2vp2_mbs1, m_gpt1.3b_dp2_nodistopt_mbs4. Failed:
  m_gpt1.3b_unfused_mbs4 (ModuleNotFoundError: scaled_masked_softmax_cuda: the entry asked for Megatron's fused
  masked softmax, which needs Apex-built kernels; fixed afterwards in the entry, not re-run on a GPU).
- No OOM occurred: GPT 1.3B at mbs 16 without recompute peaks at 80.9 GiB of 139 GiB.
- bf16 8192^3 matmul, two calls: 783.3 / 796.9 and 782.1 / 810.5 TFLOP/s (GPU 0 / GPU 1).
"""


def main(dirs: list[str]) -> None:
    rows: list[dict] = []
    env: dict = {}
    for d in map(Path, dirs):
        call = d.name
        if (d / "results.jsonl").exists():
            for line in (d / "results.jsonl").read_text().splitlines():
                r = json.loads(line)
                r["device_call"] = call
                rows.append(r)
        if (d / "env.json").exists():
            env[f"call_{call}"] = json.loads((d / "env.json").read_text())
        for extra in ("te_build.log", "setup.log"):
            if (d / extra).exists():
                env.setdefault("logs", {})[f"{call}/{extra}"] = (d / extra).read_text()[-3000:]
        if (d / "megatron_args_check.txt").exists():
            shutil.copy(d / "megatron_args_check.txt", RESULTS / "megatron_args_check.txt")
        logs = RESULTS / "gpu_logs"
        if (d / "logs.tar.gz").exists():
            with tarfile.open(d / "logs.tar.gz") as tf:
                tf.extractall(logs, filter="data")
        if (d / "traces.tar").exists():
            with tarfile.open(d / "traces.tar") as tf:
                for m in tf.getmembers():
                    if m.name.split(".trace_rank0")[0] in KEEP_TRACES:
                        tf.extract(m, RESULTS / "gpu_traces", filter="data")
    for group, fname in FILES.items():
        with open(RESULTS / fname, "w") as f:
            for r in rows:
                if r["group"] == group:
                    f.write(json.dumps(r) + "\n")
    (RESULTS / "gpu_h200_env.json").write_text(json.dumps(env, indent=1))
    (RESULTS / "gpu_h200_summary.md").write_text(summary(rows, env))
    print(f"{len(rows)} runs merged")


def summary(rows: list[dict], env: dict) -> str:
    lines = [
        "# GPU evidence: H200 runs of the profile entry point",
        "",
        "Every figure below was measured by `python -m mcore_advisor.launcher.entry.profile` on an",
        "`nvidia-h200-x2` device machine (per-row device, versions and git state in the JSONL files).",
        "iter_s = median of the measured iterations; TFLOP/s per GPU in Megatron's causal convention and",
        "the full-s^2 convention; peak memory = torch.cuda max_memory_allocated / max_memory_reserved per rank.",
        "'ran alongside' = another one-GPU run on the other GPU at the same time.",
        "",
        "| run | group | GPUs | status | iter_s | TFLOP/s causal | TFLOP/s full | MFU causal % | peak alloc GiB | peak reserved GiB | exposed comm s | ran alongside |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        res = r.get("result") or {}

        def f(key, fmt="{:.1f}", res=res):
            v = res.get(key)
            return fmt.format(v) if isinstance(v, (int, float)) else "-"

        def mem(key, res=res):
            return ", ".join(f"{x:.1f}" for x in res.get(key) or []) or "-"

        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {(r.get('error') or {}).get('error_type', '')}"
        lines.append(
            f"| {r['name']} | {r['group']} | {r['nproc']} | {status} | {f('iter_s', '{:.3f}')} | {f('tflops_per_gpu_causal')} | "
            f"{f('tflops_per_gpu_full')} | {f('mfu_pct_causal')} | {mem('peak_allocated_gib')} | {mem('peak_reserved_gib')} | "
            f"{f('exposed_comm_s', '{:.3f}')} | {', '.join(r.get('ran_alongside') or []) or '-'} |"
        )
    lines += ["", "## Issue-7 targets", ""]
    by = {r["name"]: r for r in rows}
    for name, (key, want) in TARGETS.items():
        r = by.get(name)
        got = (r.get("result") or {}).get(key) if r else None
        verdict = "not run" if got is None else ("met" if got >= want else f"NOT met ({100 * (got / want - 1):+.1f}%)")
        lines.append(f"- {name}: {key} = {got if got is None else round(got, 1)} vs target {want}: {verdict}")
    mm = [m for v in env.values() if isinstance(v, dict) for m in v.get("matmul", [])]
    if mm:
        lines += ["", "## bf16 8192^3 matmul (random data, mean of 20 after 3 warm-ups)", ""]
        lines += [f"- GPU {m['gpu']} {m['name']}: {m['bf16_8192_matmul_tflops']} TFLOP/s" for m in mm]
    return "\n".join(lines) + "\n" + NOTES


if __name__ == "__main__":
    main(sys.argv[1:])
