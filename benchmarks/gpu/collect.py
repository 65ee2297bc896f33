"""Merge what device calls brought back into benchmarks/results/ (run here, after the calls).

    python3 benchmarks/gpu/collect.py --session s2 /work/.device/6 /work/.device/12 ...

Appends each call's rows to the file of their group (FILES: the H200 runs of the earlier bespoke
profile job in gpu_h200_runs.jsonl (issue-7 targets), gpu_memory_sweep.jsonl,
gpu_recommend_sweep.jsonl, gpu_gc_runs.jsonl; the H100 runs through Megatron-LM's own loop, groups
'megatron' and 'at_scale', in gpu_h100_megatron_runs.jsonl), tagged `device_call` = SESSION/CALL
(call folders are numbered per session, so the tag keeps sessions apart; re-merging a call replaces
its rows). 'smoke' rows are not kept. Adds each call's env.json (per-GPU matmul rate) to the env file
(--env-file), train logs to gpu_logs/SESSION/, a few rank-0 traces to gpu_traces/, and regenerates
gpu_h200_table.md, gpu_h200_targets.md and gpu_h100_megatron_table.md. gpu_h200_summary.md is the
hand-kept narrative. Figures are copied, never recomputed or extrapolated.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results"
KEEP_TRACES = ("t_gpt1.3b_te_bf16_mbs8", "m_gpt1.3b_dp2_distopt_mbs4", "d13_te_s2k_mbs4")
FILES = {"target": "gpu_h200_runs.jsonl", "memory": "gpu_memory_sweep.jsonl", "recommend": "gpu_recommend_sweep.jsonl",
         "gc": "gpu_gc_runs.jsonl", "megatron": "gpu_h100_megatron_runs.jsonl", "at_scale": "gpu_h100_megatron_runs.jsonl"}
MEGATRON_FILE = "gpu_h100_megatron_runs.jsonl"
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




def _base(work_dir: str) -> str:
    """Run name of a work folder (runner.py --each-gpu appends _gpuN)."""
    head, _, tail = work_dir.rpartition("_gpu")
    return head if head and tail.isdigit() else work_dir


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--session", required=True, help="tag of this session's calls, e.g. s2")
    ap.add_argument("--env-file", default="gpu_h200_env.json", help="where the calls' env.json go (e.g. gpu_h100_env.json)")
    ap.add_argument("dirs", nargs="+")
    a = ap.parse_args(argv)
    by_file: dict[str, list[dict]] = {f: [json.loads(x) for x in (RESULTS / f).read_text().splitlines() if x.strip()]
                                      if (RESULTS / f).exists() else [] for f in set(FILES.values())}
    env_path = RESULTS / a.env_file
    env: dict = json.loads(env_path.read_text()) if env_path.exists() else {}
    added = 0
    for d in map(Path, a.dirs):
        call = f"{a.session}/{d.name}"
        if (d / "results.jsonl").exists():
            new = [json.loads(x) for x in (d / "results.jsonl").read_text().splitlines() if x.strip()]
            for f in by_file:
                by_file[f] = [r for r in by_file[f] if r.get("device_call") != call]
            for r in new:
                if r["group"] not in FILES:
                    continue  # smoke checks of the entry on the machine
                r["device_call"] = call
                by_file[FILES[r["group"]]].append(r)
                added += 1
        if (d / "env.json").exists():
            env[f"call_{call}"] = json.loads((d / "env.json").read_text())
        for extra in ("te_build.log", "setup.log"):
            if (d / extra).exists():
                env.setdefault("logs", {})[f"{call}/{extra}"] = (d / extra).read_text()[-3000:]
        if (d / "megatron_args_check.txt").exists():
            shutil.copy(d / "megatron_args_check.txt", RESULTS / "megatron_args_check.txt")
        if (d / "logs.tar.gz").exists():
            with tarfile.open(d / "logs.tar.gz") as tf:
                tf.extractall(RESULTS / "gpu_logs" / a.session, filter="data")
        if (d / "traces.tar").exists():
            with tarfile.open(d / "traces.tar") as tf:
                for m in tf.getmembers():
                    work = m.name.split(".trace_rank0")[0]
                    if _base(work) in KEEP_TRACES:
                        m.name = f"{a.session}_{d.name}_{m.name}"
                        tf.extract(m, RESULTS / "gpu_traces", filter="data")
    for fname, file_rows in by_file.items():
        (RESULTS / fname).write_text("".join(json.dumps(r) + "\n" for r in file_rows))
    env_path.write_text(json.dumps(env, indent=1))
    h200 = [r for f in dict.fromkeys(FILES.values()) if f != MEGATRON_FILE for r in by_file[f]]
    (RESULTS / "gpu_h200_table.md").write_text(table(h200))
    h200_env = json.loads((RESULTS / "gpu_h200_env.json").read_text()) if (RESULTS / "gpu_h200_env.json").exists() else {}
    (RESULTS / "gpu_h200_targets.md").write_text(targets(by_file[FILES["target"]], h200_env))
    (RESULTS / "gpu_h100_megatron_table.md").write_text(megatron_table(by_file[MEGATRON_FILE]))
    print(f"{added} runs merged")


def _matmul(env: dict, call: str, gpu: int) -> float | None:
    for m in (env.get(f"call_{call}") or {}).get("matmul", []):
        if m.get("gpu") == gpu:
            return m.get("bf16_8192_matmul_tflops")
    return None


def _machine_env(env: dict, call: str) -> str | None:
    """The env call of the same machine: the latest env call of the session at or before this one."""
    sess, _, num = call.rpartition("/")
    best = None
    for k in env:
        if not k.startswith(f"call_{sess}/"):
            continue
        n = k.rsplit("/", 1)[1]
        if n.isdigit() and num.isdigit() and int(n) <= int(num) and (best is None or int(n) > int(best.rsplit("/", 1)[1])):
            best = k
    return best[len("call_"):] if best else None


def targets(rows: list[dict], env: dict) -> str:
    lines = [
        "# Issue-7 targets: every measured run",
        "",
        "Megatron-LM pretrain_gpt.py on an H200 (shared reference TE-on-gpu.md; no Apex, so",
        "--no-gradient-accumulation-fusion) and the SDPA probe (device-measurements-h200.jsonl) set the targets.",
        "`_nogaf` rows are like-for-like with those runs; the others use the plan default",
        "gradient_accumulation_fusion (TE layers accumulate wgrad into main_grad in the GEMM).",
        "matmul = that GPU's bf16 8192^3 rate measured on the same machine (calls of one machine share a session",
        "tag and the env call before them); GPUs of one machine differed by up to 2%.",
        "",
        "| call | run | GPU(s) | matmul TFLOP/s | grad-acc fusion | iter_s (median of n) | TFLOP/s | target | verdict | git |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = r["name"]
        if name not in TARGETS:
            continue
        key, want = TARGETS[name]
        res = r.get("result") or {}
        got = res.get(key)
        call = str(r.get("device_call", "?"))
        # session calls: the machine's env call; session-1 rows: their own call's env, if any
        mcall = _machine_env(env, call) if "/" in call else (call if f"call_{call}" in env else None)
        mm = [_matmul(env, mcall, g) for g in r.get("gpus", [])] if mcall else []
        mm_s = ", ".join(f"{x:.0f}" for x in mm if x) or "-"
        gaf = (res.get("settings") or {}).get("gradient_accumulation_fusion")
        n = len(res.get("measured_step_times_s") or [])
        verdict = "-" if got is None else ("met" if got >= want else f"short {100 * (got / want - 1):+.1f}%")
        git = (r.get("git_state") or "?").split()[0][:8]
        conv = "causal" if key.endswith("causal") else "full"
        lines.append(f"| {call} | {name} | {','.join(map(str, r.get('gpus', [])))} | {mm_s} | {gaf or 'off'} | "
                     f"{res.get('iter_s', float('nan')):.4f} ({n}) | {got if got is None else round(got, 1)} {conv} | {want} | {verdict} | {git} |")
    return "\n".join(lines) + "\n"


def megatron_table(rows: list[dict]) -> str:
    """The runs of Megatron-LM's own loop (profile job since issue 14), one row each."""
    lines = [
        "# GPU evidence: Megatron-LM's own training loop on H100 (profile job, issue 14)",
        "",
        "Each row ran `python -m mcore_advisor.launcher.entry.profile` = megatron.training.pretrain on the argv",
        "render_launch_script renders for the plan (gpu_h100_megatron_runs.jsonl holds the plan, the argv as run and",
        "every adjustment, Megatron's own iteration/memory lines, versions, device and git state). Step time =",
        "median of the measured iterations' 'elapsed time per iteration' (Megatron's timer); TFLOP/s per GPU with",
        "Megatron's num_floating_point_operations (causal convention); peak = torch.cuda max_memory_allocated /",
        "max_memory_reserved. at_scale rows: one rank of the plan's world with --fake-process-group, memory after",
        "iteration 2 (their step times are one rank's compute without communication, not the plan's step time).",
        "",
        "| call | run | group | device | TE | rank | step s | TFLOP/s causal | peak alloc GiB | peak reserved GiB | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        res = r.get("result") or {}
        te = (res.get("versions") or {}).get("transformer_engine") or "-"
        impl = res.get("transformer_impl") or "-"
        step = res.get("iter_s")
        tfl = res.get("tflops_per_gpu_causal")
        alloc = ", ".join(f"{x:.2f}" for x in res.get("peak_allocated_gib") or []) or "-"
        resv = ", ".join(f"{x:.2f}" for x in res.get("peak_reserved_gib") or []) or "-"
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {(r.get('error') or {}).get('error_type', '')}"
        rank = res.get("measured_rank")
        lines.append(f"| {r.get('device_call', '?')} | {r['name']} | {r['group']} | {res.get('device', '-')} | {impl} {te} | "
                     f"{'-' if rank is None else rank} | {'-' if step is None else f'{step:.4f}'} | "
                     f"{'-' if tfl is None else f'{tfl:.1f}'} | {alloc} | {resv} | {status} |")
    return "\n".join(lines) + "\n"


def table(rows: list[dict]) -> str:
    lines = [
        "# GPU evidence: every H200 run of the profile entry point",
        "",
        "Measured by `python -m mcore_advisor.launcher.entry.profile` on `nvidia-h200-x2` device machines",
        "(per-row device, versions and git state in the JSONL files; `call` = session/device call).",
        "iter_s = median of the measured iterations; TFLOP/s per GPU in Megatron's causal convention and",
        "the full-s^2 convention; peak memory = torch.cuda max_memory_allocated / max_memory_reserved per rank.",
        "'ran alongside' = another one-GPU run on the other GPU at the same time.",
        "",
        "| call | run | group | GPUs | status | iter_s | TFLOP/s causal | TFLOP/s full | MFU causal % | peak alloc GiB | peak reserved GiB | exposed comm s | ran alongside |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
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
            f"| {r.get('device_call', '?')} | {r['name']} | {r['group']} | {','.join(map(str, r.get('gpus', [])))} | {status} | "
            f"{f('iter_s', '{:.3f}')} | {f('tflops_per_gpu_causal')} | {f('tflops_per_gpu_full')} | {f('mfu_pct_causal')} | "
            f"{mem('peak_allocated_gib')} | {mem('peak_reserved_gib')} | {f('exposed_comm_s', '{:.3f}')} | "
            f"{', '.join(r.get('ran_alongside') or []) or '-'} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(sys.argv[1:])
