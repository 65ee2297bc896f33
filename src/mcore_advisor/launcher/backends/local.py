"""Local backend: run the job on this host under a detached supervisor (see supervisor.py).

The server starts `python -I supervisor.py JOB_DIR` in a new session; the supervisor starts the
job command, so the job survives the server exiting. The job row keeps the supervisor's pid, its
start time in clock ticks and the boot id: together they identify the process even after the pid
is reused, and a reboot is recognised as "lost". How the job ended comes from the supervisor's
exit_code.json; whether it produced a result comes from the job directory (base.read_outcome).

When the supervisor itself was killed (kill -9), the job's processes keep running. They are found
by the process group the supervisor recorded in job.json and by the job's environment marker: the
job stays RUNNING while any of them lives, the server enforces its wall-clock limit, cancel stops
them, and when they are gone the job directory says how it ended.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from . import supervisor as sv
from .base import (
    JOB_ENV_MARKER,
    STDERR_FILE,
    STDOUT_FILE,
    Backend,
    BackendError,
    BackendStatus,
    JobArtifact,
    JobRef,
    TooLarge,
    check_safe_path,
    read_json,
    torchrun_argv,
)

log = logging.getLogger("mcore_advisor.launcher")

SUPERVISOR_LOG = "supervisor.log"
SMALL_JSON_BYTES = 64 * 1024  # the supervisor's exit_code.json and job.json are a few hundred bytes
_DEV_GPU_RE = re.compile(r"nvidia\d+")


def local_gpu_count() -> int:
    """GPUs a job started here can see: CUDA_VISIBLE_DEVICES if set, else /dev/nvidiaN device files."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = 0
        for item in visible.split(","):
            item = item.strip()
            # CUDA stops enumerating at the first invalid entry (e.g. "-1" hides every GPU).
            if not item or item.startswith("-"):
                break
            count += 1
        return count
    try:
        return sum(1 for name in os.listdir("/dev") if _DEV_GPU_RE.fullmatch(name))
    except OSError:
        return 0


def local_command(artifact: JobArtifact) -> list[str]:
    """`python PROGRAM` for one process; `torchrun --standalone --nproc_per_node N PROGRAM` for more.

    --standalone: a private c10d rendezvous on a free local port, so concurrent local jobs never clash.
    """
    n = artifact.gpus_per_node
    if n == 1:
        return [artifact.python, *artifact.program]
    return [*torchrun_argv(artifact.python), "--standalone", "--nnodes", "1", "--nproc_per_node", str(n), *artifact.program]


class LocalBackend(Backend):
    """Jobs as detached processes on this host."""

    name = "local"
    option_prefix = None

    def __init__(self, *, grace_s: float = 10.0, cancel_wait_s: float = 3.0, python: str = sys.executable):
        self.grace_s = grace_s
        self.cancel_wait_s = cancel_wait_s
        self.python = python
        # Supervisors we started in this process: polled so they do not linger as zombies.
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    def check(self, artifact: JobArtifact) -> None:
        super().check(artifact)
        if artifact.nodes != 1:
            raise ValueError(
                f"resources.nodes: the local backend runs on this host only, but the job needs {artifact.nodes} "
                "nodes; use backend='slurm' (or 'slurm_rest'), or a plan with cluster.num_gpus <= GPUs on one node"
            )
        if artifact.use_gpus:
            have = local_gpu_count()
            if artifact.gpus_per_node > have:
                raise ValueError(
                    f"cluster.num_gpus: the job needs {artifact.gpus_per_node} GPUs but this host has {have} visible "
                    "(CUDA_VISIBLE_DEVICES or /dev/nvidiaN); reduce cluster.num_gpus or use a Slurm backend"
                )
        check_safe_path(artifact.job_dir, "job_dir")

    def launch_text(self, artifact: JobArtifact) -> tuple[list[str], str | None]:
        return local_command(artifact), None

    # -- submit ------------------------------------------------------------------------------

    def submit(self, artifact: JobArtifact) -> JobRef:
        job_dir = artifact.job_dir
        launch = {
            "command": local_command(artifact),
            "env": {**artifact.env, JOB_ENV_MARKER: artifact.job_id},
            "time_limit_s": artifact.resources.time_limit_min * 60.0,
            "grace_s": self.grace_s,
            "stdout": STDOUT_FILE,
            "stderr": STDERR_FILE,
        }
        (job_dir / sv.LAUNCH_FILE).write_text(json.dumps(launch, indent=1))
        argv = [self.python, "-I", str(Path(sv.__file__).resolve()), str(job_dir)]
        try:
            with open(job_dir / SUPERVISOR_LOG, "ab") as log:
                proc = subprocess.Popen(
                    argv,
                    cwd=job_dir,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # own session and process group: detached from the server
                    close_fds=True,
                )
        except OSError as exc:
            raise BackendError(f"local backend could not start the job supervisor: {exc}") from exc
        # The pid cannot vanish yet: until we reap it, even an exited child keeps its /proc entry.
        stat = sv.proc_stat(proc.pid)
        self._children[proc.pid] = proc
        return JobRef(
            backend=self.name,
            native_id=str(proc.pid),
            data={
                "job_id": artifact.job_id,
                "pid": proc.pid,
                "pgid": proc.pid,
                "start_ticks": stat["start_ticks"] if stat else None,
                "boot_id": sv.boot_id(),
                "host": socket.gethostname(),
                "job_dir": str(job_dir),
                "started_at": time.time(),
                "time_limit_min": artifact.resources.time_limit_min,
            },
        )

    # -- status ------------------------------------------------------------------------------

    def _reap(self) -> None:
        for pid, proc in list(self._children.items()):
            if proc.poll() is not None:
                self._children.pop(pid, None)

    def _alive(self, ref: JobRef) -> bool:
        d = ref.data
        if d.get("boot_id") and d["boot_id"] != sv.boot_id():
            return False  # the machine rebooted since: the process is certainly gone
        return sv.is_running(int(d["pid"]), d.get("start_ticks"))

    def _exit_record(self, ref: JobRef) -> dict | None:
        try:
            return read_json(Path(ref.data["job_dir"]) / sv.EXIT_FILE, SMALL_JSON_BYTES)
        except TooLarge:
            return {"exit_code": None, "error": f"{sv.EXIT_FILE} is not the supervisor's (too large)"}

    def status(self, refs: Mapping[str, JobRef]) -> dict[str, BackendStatus]:
        self._reap()
        out: dict[str, BackendStatus] = {}
        for key, ref in refs.items():
            record = self._exit_record(ref)
            if record is None:
                if ref.data.get("host") not in (None, socket.gethostname()):
                    continue  # another host's job: /proc here says nothing about it
                if self._alive(ref):
                    out[key] = BackendStatus(state="RUNNING", native_state="running", started_at=ref.data.get("started_at"))
                    continue
                record = self._exit_record(ref)  # it may have finished between the two looks
                if record is None:
                    orphan = self._unsupervised(ref)
                    if orphan is not None:
                        out[key] = orphan
                        continue
                    record = self._exit_record(ref)
            out[key] = self._from_exit_record(ref, record)
        return out

    def _job_processes(self, ref: JobRef) -> list[int]:
        """Live processes of the job: its recorded process group, and anything carrying its marker."""
        pids = set(sv.processes_with_env(JOB_ENV_MARKER, str(ref.data["job_id"])))
        job = self._job_file(ref)
        if job and sv.is_running(int(job["pid"]), job.get("start_ticks")):
            pids.add(int(job["pid"]))
        return sorted(p for p in pids if sv.is_running(p, None))

    def _job_file(self, ref: JobRef) -> dict | None:
        try:
            data = read_json(Path(ref.data["job_dir"]) / sv.JOB_FILE, SMALL_JSON_BYTES)
        except TooLarge:
            return None
        return data if data is not None and isinstance(data.get("pid"), int) else None

    def _unsupervised(self, ref: JobRef) -> BackendStatus | None:
        """The supervisor is gone without an exit record: RUNNING while the job's processes live
        (the server then enforces the time limit), else None (the exit is decided as 'lost')."""
        pids = self._job_processes(ref)
        if not pids:
            return None
        started = ref.data.get("started_at")
        limit_min = ref.data.get("time_limit_min")
        supervisor = ref.data.get("pid")
        if started is not None and limit_min is not None and time.time() - float(started) > float(limit_min) * 60.0:
            self._stop(ref, pids)
            self._write_exit(ref, {"exit_code": -signal.SIGKILL, "timed_out": True, "cancelled": False, "terminated": True,
                                   "error": f"the job supervisor (pid {supervisor}) was killed; the server stopped the job "
                                            f"at its wall-clock limit of {float(limit_min):g} min"})
            return self._from_exit_record(ref, self._exit_record(ref))
        return BackendStatus(state="RUNNING", native_state="running (supervisor gone)", started_at=started,
                             reason=f"the job supervisor (pid {supervisor}) was killed; the job's processes "
                                    f"({', '.join(map(str, pids[:8]))}) still run and the server watches them")

    def _stop(self, ref: JobRef, pids: list[int]) -> None:
        """SIGTERM to the job's group and marked processes, SIGKILL to whatever is left after cancel_wait_s."""
        job = self._job_file(ref)
        if job and sv.is_running(int(job["pid"]), job.get("start_ticks")):
            sv.signal_group(int(job.get("pgid", job["pid"])), signal.SIGTERM)
        sv.signal_all(pids, signal.SIGTERM)
        deadline = time.monotonic() + self.cancel_wait_s
        while time.monotonic() < deadline and self._job_processes(ref):
            time.sleep(0.02)
        sv.signal_all(self._job_processes(ref), signal.SIGKILL)

    def _write_exit(self, ref: JobRef, record: dict) -> None:
        """The exit record the killed supervisor could not write, so every later poll agrees."""
        now = time.time()
        try:
            sv.write_json_atomic(Path(ref.data["job_dir"]) / sv.EXIT_FILE,
                                 {"started_at": ref.data.get("started_at"), "ended_at": now, **record})
        except OSError as exc:
            log.warning("cannot write the exit record of job %s: %s", ref.data.get("job_id"), exc)

    def _from_exit_record(self, ref: JobRef, record: dict | None) -> BackendStatus:
        pid = ref.data.get("pid")
        if record is None and (Path(ref.data["job_dir"]) / sv.CANCEL_FILE).exists():
            # Cancelled so early that the supervisor had not yet installed its SIGTERM handler.
            return BackendStatus(state="CANCELLED", native_state="cancelled", reason="cancelled by request")
        if record is None:
            return BackendStatus(
                state="FAILED", native_state="lost", lost=True,
                reason=f"lost: process {pid} exited without result (no exit record; killed or host rebooted)",
            )
        code = record.get("exit_code")
        common = {"exit_code": code, "started_at": record.get("started_at"), "ended_at": record.get("ended_at")}
        if record.get("timed_out"):
            limit = ref.data.get("time_limit_min")
            reason = record.get("error") or (f"wall-clock limit of {limit:g} min reached" if isinstance(limit, int | float)
                                             else "wall-clock limit reached")
            return BackendStatus(state="TIMEOUT", native_state="timeout", reason=reason, **common)
        if record.get("cancelled"):
            return BackendStatus(state="CANCELLED", native_state="cancelled", reason="cancelled by request", **common)
        if code == 0:
            return BackendStatus(state="COMPLETED", native_state="exited", **common)
        if record.get("error"):
            reason = str(record["error"])
        elif isinstance(code, int) and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            reason = f"killed by {name}" + (" (supervisor was terminated outside mcore-advisor)" if record.get("terminated") else "")
        else:
            reason = f"exited with code {code}"
        return BackendStatus(state="FAILED", native_state="exited", reason=reason, **common)

    # -- cancel ------------------------------------------------------------------------------

    def cancel(self, ref: JobRef) -> None:
        job_dir = Path(ref.data["job_dir"])
        try:
            (job_dir / sv.CANCEL_FILE).touch()
        except OSError:
            pass
        if self._exit_record(ref) is not None:
            return
        if ref.data.get("host") not in (None, socket.gethostname()):
            raise BackendError(f"job was started on host {ref.data['host']!r}; cancel it from there")
        pid = int(ref.data["pid"])
        if self._alive(ref):
            # The supervisor stops the command (SIGTERM, then SIGKILL to the tree after grace_s).
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + self.cancel_wait_s
            while time.monotonic() < deadline and self._alive(ref):
                self._reap()
                time.sleep(0.02)
            if self._alive(ref) or self._exit_record(ref) is not None:
                return  # stopped cleanly, or still stopping: the supervisor escalates on its own
        # Supervisor gone without a record (killed): stop the job it left behind, record the cancel as it would have.
        pids = self._job_processes(ref)
        if pids:
            self._stop(ref, pids)
            self._write_exit(ref, {"exit_code": None, "timed_out": False, "cancelled": True, "terminated": True})
        self._reap()
