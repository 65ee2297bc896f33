"""Slurm through its command-line tools on this host: sbatch --parsable, squeue / sacct, scancel.

Every call is an argv list (no shell). State comes from squeue while slurmctld still holds the
job (it keeps finished jobs for MinJobAge, 300 s by default), then from sacct when accounting is
configured, and finally from the job directory (result.json / error.json).

A controller that does not answer (down, or slower than `timeout_s`) makes queries and scancel
retry a bounded number of times and then raise BackendUnavailable: the job's state is unknown,
not failed. sbatch is never retried: a submit that timed out may have been accepted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from .base import (
    STDERR_FILE,
    STDOUT_FILE,
    Backend,
    BackendError,
    BackendStatus,
    BackendUnavailable,
    JobArtifact,
    JobRef,
    retrying,
)
from .slurm_common import (
    BATCH_SCRIPT,
    batch_script,
    check_slurm_artifact,
    map_slurm_state,
    parse_slurm_time,
    unknown_job_status,
)

SUBMIT_TIMEOUT_S = 60.0
QUERY_TIMEOUT_S = 10.0  # Slurm's own MessageTimeout default: a healthy controller answers well within it
QUERY_ATTEMPTS = 2
RETRY_WAIT_S = 1.0
# What the Slurm client tools print when slurmctld is down or too busy to answer (slurm_errno.h texts).
_UNAVAILABLE = ("Unable to contact slurm controller", "Socket timed out", "Connection refused", "Connection timed out",
                "Zero Bytes were transmitted", "backup controller in standby mode", "Transport endpoint is not connected",
                "Resource temporarily unavailable")


def sbatch_options(artifact: JobArtifact) -> list[str]:
    """Resource options as separate argv elements (values already validated by check_slurm_artifact)."""
    r = artifact.resources
    opts = [
        f"--job-name={artifact.name}",
        f"--nodes={artifact.nodes}",
        "--ntasks-per-node=1",
        f"--time={r.slurm_time_limit_min}",
        f"--chdir={artifact.job_dir}",
        f"--output={artifact.job_dir / STDOUT_FILE}",
        f"--error={artifact.job_dir / STDERR_FILE}",
    ]
    if artifact.use_gpus:
        opts.append(f"--gpus-per-node={artifact.gpus_per_node}")
    if r.slurm_partition:
        opts.append(f"--partition={r.slurm_partition}")
    if r.slurm_account:
        opts.append(f"--account={r.slurm_account}")
    return opts


class SlurmCliBackend(Backend):
    """sbatch / squeue / sacct / scancel found on PATH (SLURM_CONF from the environment)."""

    name = "slurm"
    option_prefix = "slurm_"

    def __init__(self, *, bin_dir: str | None = None, env: Mapping[str, str] | None = None,
                 timeout_s: float = QUERY_TIMEOUT_S, attempts: int = QUERY_ATTEMPTS, retry_wait_s: float = RETRY_WAIT_S):
        self.bin_dir = bin_dir
        self.env = dict(env) if env is not None else None
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.retry_wait_s = retry_wait_s

    def _tool(self, name: str) -> str:
        if self.bin_dir:
            return str(Path(self.bin_dir) / name)
        found = shutil.which(name)
        if not found:
            raise BackendError(f"backend 'slurm': `{name}` is not on PATH; install the Slurm client tools or use backend='slurm_rest'")
        return found

    def _run(self, argv: Sequence[str], *, check: bool = True, timeout_s: float | None = None) -> subprocess.CompletedProcess[str]:
        name = Path(argv[0]).name
        limit = timeout_s or self.timeout_s
        try:
            proc = subprocess.run(
                list(argv), capture_output=True, text=True, timeout=limit,
                env={**os.environ, **self.env} if self.env is not None else None,
            )
        except subprocess.TimeoutExpired as exc:
            raise BackendUnavailable(f"backend 'slurm': {name} did not answer within {limit:g} s (slurmctld down or overloaded?)") from exc
        except OSError as exc:
            raise BackendError(f"backend 'slurm': running {name} failed: {exc}") from exc
        msg = " ".join((proc.stderr or proc.stdout).strip().splitlines())[-500:]
        if proc.returncode != 0 and any(word in msg for word in _UNAVAILABLE):
            raise BackendUnavailable(f"backend 'slurm': {name}: {msg}")
        if check and proc.returncode != 0:
            raise BackendError(f"backend 'slurm': {name} failed: {msg}")
        return proc

    def _retrying(self, call, what: str):
        return retrying(call, attempts=self.attempts, wait_s=self.retry_wait_s, what=what)

    def check(self, artifact: JobArtifact) -> None:
        super().check(artifact)
        check_slurm_artifact(artifact)

    def launch_text(self, artifact: JobArtifact) -> tuple[list[str], str | None]:
        argv = ["sbatch", "--parsable", *sbatch_options(artifact), str(artifact.job_dir / BATCH_SCRIPT)]
        return argv, batch_script(artifact)

    def submit(self, artifact: JobArtifact) -> JobRef:
        argv, script = self.launch_text(artifact)
        script_path = artifact.job_dir / BATCH_SCRIPT
        script_path.write_text(script or "")
        script_path.chmod(0o700)
        try:
            proc = self._run([self._tool("sbatch"), *argv[1:]], timeout_s=SUBMIT_TIMEOUT_S)
        except BackendUnavailable as exc:
            raise BackendUnavailable(f"{exc}; it may have been accepted anyway: check `squeue --name={artifact.name}` "
                                     "and scancel a job this left behind") from exc
        # --parsable prints "jobid" or "jobid;cluster".
        native = proc.stdout.strip().splitlines()[-1].split(";")[0] if proc.stdout.strip() else ""
        if not native.isdigit():
            raise BackendError(f"backend 'slurm': sbatch printed no job id ({proc.stdout.strip()[:200]!r})")
        return JobRef(backend=self.name, native_id=native, data={"slurm_job_id": native, "job_dir": str(artifact.job_dir)})

    def status(self, refs: Mapping[str, JobRef]) -> dict[str, BackendStatus]:
        if not refs:
            return {}
        return self._retrying(lambda: self._status(refs), "squeue/sacct")

    def _status(self, refs: Mapping[str, JobRef]) -> dict[str, BackendStatus]:
        by_native = {ref.native_id: key for key, ref in refs.items()}
        found: dict[str, BackendStatus] = {}
        found.update(self._squeue(list(by_native)))
        missing = [n for n in by_native if n not in found]
        if missing:
            found.update(self._sacct(missing))
        out: dict[str, BackendStatus] = {}
        for native, key in by_native.items():
            st = found.get(native)
            if st is None:
                st = unknown_job_status(native, Path(refs[key].data["job_dir"]))
            out[key] = st
        return out

    def _squeue(self, ids: list[str]) -> dict[str, BackendStatus]:
        fmt = "%i|%T|%r|%S|%e"
        proc = self._run([self._tool("squeue"), "-h", "--states=all", "-j", ",".join(ids), "-o", fmt], check=False)
        if proc.returncode != 0:
            if "Invalid job id" not in proc.stderr:
                raise BackendError(f"backend 'slurm': squeue failed: {proc.stderr.strip()[-300:]}")
            if len(ids) == 1:
                return {}
            out: dict[str, BackendStatus] = {}
            for one in ids:  # one purged id fails the whole query: ask one by one
                out.update(self._squeue([one]))
            return out
        out = {}
        for line in proc.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) < 5 or parts[0] not in ids:
                continue
            state, native = map_slurm_state(parts[1])
            if state is None:
                continue
            terminal = state not in ("PENDING", "RUNNING")
            reason = parts[2] if parts[2] not in ("None", "") else None
            out[parts[0]] = BackendStatus(
                state=state, native_state=native,  # type: ignore[arg-type]
                reason=_reason(native, reason) if terminal or state == "PENDING" else None,
                started_at=parse_slurm_time(parts[3]) if state != "PENDING" else None,
                ended_at=parse_slurm_time(parts[4]) if terminal else None,
            )
        return out

    def _sacct(self, ids: list[str]) -> dict[str, BackendStatus]:
        try:
            sacct = self._tool("sacct")
        except BackendError:
            return {}
        proc = self._run([sacct, "-n", "-X", "--parsable2", "-j", ",".join(ids),
                          "-o", "JobID,State,ExitCode,Start,End"], check=False)
        if proc.returncode != 0:
            return {}  # no accounting storage configured: the job directory decides
        out: dict[str, BackendStatus] = {}
        for line in proc.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) < 5 or parts[0] not in ids:
                continue
            state, native = map_slurm_state(parts[1])
            if state is None:
                continue
            code, _, sig = parts[2].partition(":")
            exit_code = -int(sig) if sig.isdigit() and int(sig) else (int(code) if code.isdigit() else None)
            out[parts[0]] = BackendStatus(
                state=state, native_state=native, exit_code=exit_code,  # type: ignore[arg-type]
                reason=_reason(native, None) if state not in ("RUNNING", "COMPLETED") else None,
                started_at=parse_slurm_time(parts[3]), ended_at=parse_slurm_time(parts[4]),
            )
        return out

    def cancel(self, ref: JobRef) -> None:
        # scancel of an already-ended job is harmless, so a retry is safe.
        self._retrying(lambda: self._run([self._tool("scancel"), ref.native_id]), "scancel")


def _reason(native: str | None, reason: str | None) -> str | None:
    if native in (None, "COMPLETED", "RUNNING"):
        return reason
    text = f"Slurm state {native}"
    return f"{text} ({reason})" if reason else text
