"""Run profile-job configurations on the GPU machine, each in a fresh process, through our entry point
(Megatron-LM's own training loop on the rendered argv).

    python3 benchmarks/gpu/runner.py --out DIR [--names a,b] [--groups target,memory] [--deadline-s 420]

Standard library only (the GPU image has no pydantic). Reads benchmarks/gpu/specs.jsonl (written by
configs.py), schedules one-GPU runs on free GPUs side by side (one process per GPU; every row records
which runs shared the machine) and two-GPU runs alone, and appends one JSON line per run to
DIR/results.jsonl as soon as it ends, so a call cut short still returns what finished. Stops
launching new runs once `--deadline-s` has passed. At the end it packs the train logs, the error
files and the last lines of each run's output into DIR/logs.tar.gz and the rank-0 traces named in --traces into
DIR/traces.tar.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
# NVLink multicast off (KINDS.md: a program that uses it can take the host's GPUs out of service);
# UB_SKIPMC: TE's userbuffers (--tp-comm-overlap) would otherwise call cuMulticastCreate on Hopper.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1", "UB_SKIPMC": "1"}


def load_specs(paths: str, names: list[str] | None, groups: list[str] | None) -> list[dict]:
    """Rows of one or more spec files (comma-separated paths), in file order."""
    rows = [json.loads(x) for path in paths.split(",") for x in Path(path).read_text().splitlines() if x.strip()]
    if names:
        by = {r["name"]: r for r in rows}
        missing = [n for n in names if n not in by]
        if missing:
            raise SystemExit(f"unknown run names: {missing}")
        return [by[n] for n in names]
    if groups:
        rows = [r for r in rows if r["group"] in groups]
    return rows


class Running:
    def __init__(self, row: dict, gpus: list[int], work: Path, proc: subprocess.Popen, started: float, peers: list[str]):
        self.row, self.gpus, self.work, self.proc, self.started, self.peers = row, gpus, work, proc, started, peers


def launch(row: dict, gpus: list[int], work_root: Path, port: int, device: str = "cuda") -> tuple[subprocess.Popen, Path]:
    work = work_root / (row["name"] + (f"_gpu{row['pin']}" if "pin" in row else ""))
    if work.exists():
        shutil.rmtree(work)
    (work / "out").mkdir(parents=True)
    (work / "spec.json").write_text(json.dumps(row["spec"]))
    env = dict(os.environ)
    env.update(SAFE_ENV)
    env["PYTHONUNBUFFERED"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update({str(k): str(v) for k, v in (row.get("env") or {}).items()})  # a row's own switches (MCORE_ADVISOR_*)
    entry = ["-m", "mcore_advisor.launcher.entry.profile", "--spec", str(work / "spec.json"),
             "--out-dir", str(work / "out"), "--device", device]
    if row["nproc"] == 1:
        cmd = [sys.executable, *entry]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(row["nproc"]),
               "--master_port", str(port), *entry]
    log = open(work / "stdout.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO), start_new_session=True)
    return proc, work


def collect(r: Running, rc: int | None, timed_out: bool, git_state: str) -> dict:
    out = r.work / "out"
    res = err = None
    if (out / "result.json").exists():
        res = json.loads((out / "result.json").read_text())
        res.pop("spec", None)
    if (out / "error.json").exists():
        err = json.loads((out / "error.json").read_text())
    other_errors = [json.loads(p.read_text()) for p in sorted(out.glob("error_rank*.json"))]
    status = "ok" if res and rc == 0 else ("timeout" if timed_out else ("failed" if err else "no_result"))
    train_log = (out / "train.log").read_text() if (out / "train.log").exists() else None
    tail = (r.work / "stdout.log").read_text(errors="replace").splitlines()[-40:]
    return {
        "name": r.row["name"],
        "group": r.row["group"],
        "nproc": r.row["nproc"],
        "gpus": r.gpus,
        "ran_alongside": r.peers,
        "status": status,
        "rc": rc,
        "wall_s": round(time.time() - r.started, 1),
        "plan": r.row["spec"]["plan"],
        "run_settings": r.row["spec"]["run"],
        "result": res,
        "error": err,
        "other_rank_errors": other_errors,
        "train_log": train_log,
        "stdout_tail": tail if status != "ok" else tail[-5:],
        "git_state": git_state,
        "work_dir": r.work.name,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--specs", default=str(HERE / "specs.jsonl"), help="spec file(s), comma-separated")
    ap.add_argument("--names", default="")
    ap.add_argument("--groups", default="")
    ap.add_argument("--deadline-s", type=float, default=420.0)
    ap.add_argument("--run-timeout-s", type=float, default=240.0)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--solo", default="", help="runs to execute with no other run beside them")
    ap.add_argument("--share-multi", action="store_true",
                    help="let several-GPU runs share the machine (two 2-GPU runs on 4 GPUs); ran_alongside records it")
    ap.add_argument("--each-gpu", default="",
                    help="one-GPU runs to repeat alone on every GPU in turn (GPUs of one machine differ by ~2%% in matmul rate)")
    ap.add_argument("--work", default="/tmp/mcore_runs")
    ap.add_argument("--device", default="cuda", help="cpu: dry run of the runner itself")
    ap.add_argument("--traces", default="", help="runs whose rank-0 trace comes back (default: none)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work_root = Path(a.work)
    work_root.mkdir(parents=True, exist_ok=True)
    names = [x for x in a.names.split(",") if x]
    groups = [x for x in a.groups.split(",") if x]
    solo = set(x for x in a.solo.split(",") if x)
    queue = load_specs(a.specs, names, groups)
    each_gpu = set(x for x in a.each_gpu.split(",") if x)
    expanded = []
    for row in queue:
        if row["name"] in each_gpu and row["nproc"] == 1:
            expanded.extend({**row, "pin": g} for g in range(a.gpus))
            solo.add(row["name"])
        else:
            expanded.append(row)
    queue = expanded
    git_file = HERE / "git_state.txt"
    git_state = git_file.read_text().strip() if git_file.exists() else "unknown"
    t_start = time.time()
    free = list(range(a.gpus))
    running: list[Running] = []
    done: list[dict] = []
    not_started: list[str] = []
    port = 29400
    results = open(out / "results.jsonl", "a")

    def reap(block: bool) -> None:
        while True:
            for r in list(running):
                rc = r.proc.poll()
                timed_out = False
                if rc is None and time.time() - r.started > a.run_timeout_s:
                    os.killpg(r.proc.pid, signal.SIGKILL)
                    rc = r.proc.wait()
                    timed_out = True
                if rc is not None:
                    running.remove(r)
                    free.extend(r.gpus)
                    free.sort()
                    row = collect(r, rc, timed_out, git_state)
                    done.append(row)
                    results.write(json.dumps(row) + "\n")
                    results.flush()
                    res = row["result"] or {}
                    print(f"[{time.time() - t_start:6.1f}s] {row['name']}: {row['status']} wall {row['wall_s']}s "
                          f"iter {res.get('iter_s', float('nan')):.4f}s tflops causal {res.get('tflops_per_gpu_causal', float('nan')):.1f} "
                          f"full {res.get('tflops_per_gpu_full', float('nan')):.1f} alloc {res.get('peak_allocated_gib')} "
                          f"{(row['error'] or {}).get('error_type', '')}", flush=True)
            if not block or not running:
                return
            time.sleep(0.5)

    while queue:
        row = queue[0]
        if time.time() - t_start > a.deadline_s:
            not_started.extend(r["name"] for r in queue)
            break
        need = row["nproc"]
        exclusive = (need > 1 and not a.share_multi) or row["name"] in solo
        # wait while: an exclusive run has company, GPUs are short (or the pinned one is busy), or a
        # solo run already on the machine keeps others off it
        if ((exclusive and running) or len(free) < need or ("pin" in row and row["pin"] not in free)
                or any(r.row["name"] in solo for r in running)):
            reap(block=False)
            time.sleep(0.5)
            continue
        queue.pop(0)
        if "pin" in row:
            free.remove(row["pin"])
            gpus = [row["pin"]]
        else:
            gpus = [free.pop(0) for _ in range(need)]
        port += 1
        proc, work = launch(row, gpus, work_root, port, a.device)
        peers = [r.row["name"] for r in running]
        for r in running:
            r.peers.append(row["name"])
        running.append(Running(row, gpus, work, proc, time.time(), peers))
    reap(block=True)
    results.close()
    summary = {"not_started_deadline": not_started, "elapsed_s": round(time.time() - t_start, 1),
               "finished": [d["name"] for d in done]}
    print(json.dumps(summary), flush=True)

    with tarfile.open(out / "logs.tar.gz", "w:gz") as tf:
        for d in done:
            w = work_root / d["work_dir"]
            for p in [w / "out" / "train.log", *sorted((w / "out").glob("error*.json"))]:
                if p.exists():
                    tf.add(p, arcname=f"{d['work_dir']}/{p.name}")
            lines = (w / "stdout.log").read_text(errors="replace").splitlines()[-300:]
            data = ("\n".join(lines) + "\n").encode()
            info = tarfile.TarInfo(f"{d['work_dir']}/stdout_tail.log")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    want = [x for x in a.traces.split(",") if x]
    if want:
        budget = 15 * 2**20
        with tarfile.open(out / "traces.tar", "w") as tf:
            for name in [d["work_dir"] for d in done if d["name"] in want]:
                # Megatron's torch profiler writes it gzipped (entry/profile.py TRACE_FILE)
                p = work_root / name / "out" / "torch_profile" / "rank-0.json.gz"
                if not p.exists():
                    continue
                data = p.read_bytes()
                if len(data) > budget:
                    print(f"trace of {name} skipped: {len(data)} B compressed", flush=True)
                    continue
                budget -= len(data)
                info = tarfile.TarInfo(f"{name}.trace_rank0.json.gz")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
