"""What the Slurm CLI and slurmrestd backends share: state mapping, the batch script, input checks.

Everything user-controlled that reaches Slurm is either checked against a strict pattern (job
name, partition, account, environment names) or shell-quoted with shlex (paths, argv in the
script body). Resource options travel as separate argv elements (CLI) or JSON fields (REST),
never spliced into a shell line.
"""

from __future__ import annotations

import re
import shlex
from datetime import datetime
from pathlib import Path

from mcore_advisor import __version__

from ..store import quote
from .base import (
    JOB_ENV_MARKER,
    BackendStatus,
    JobArtifact,
    check_safe_path,
    check_slurm_word,
    read_outcome,
    torchrun_argv,
)

BATCH_SCRIPT = "job.sbatch"
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Slurm job states (squeue(1) "JOB STATE CODES", slurm/slurm.h job_states) -> ours.
# OUT_OF_MEMORY / NODE_FAIL / BOOT_FAIL end the job without a result: FAILED, with the native word kept.
# DEADLINE is a time limit too. PREEMPTED without requeue ends the job: FAILED.
_STATE_MAP = {
    "PENDING": "PENDING",
    "REQUEUED": "PENDING",
    "REQUEUE_HOLD": "PENDING",
    "REQUEUE_FED": "PENDING",
    "RESV_DEL_HOLD": "PENDING",
    "CONFIGURING": "PENDING",
    "POWER_UP_NODE": "PENDING",
    "RUNNING": "RUNNING",
    "COMPLETING": "RUNNING",
    "STAGE_OUT": "RUNNING",
    "SIGNALING": "RUNNING",
    "RESIZING": "RUNNING",
    "SUSPENDED": "RUNNING",
    "STOPPED": "RUNNING",
    "UPDATE_DB": "RUNNING",
    "COMPLETED": "COMPLETED",
    "CANCELLED": "CANCELLED",
    "REVOKED": "CANCELLED",
    "TIMEOUT": "TIMEOUT",
    "DEADLINE": "TIMEOUT",
    "FAILED": "FAILED",
    "OUT_OF_MEMORY": "FAILED",
    "NODE_FAIL": "FAILED",
    "BOOT_FAIL": "FAILED",
    "PREEMPTED": "FAILED",
    "SPECIAL_EXIT": "FAILED",
}
_ABBREV = {"PD": "PENDING", "R": "RUNNING", "CG": "COMPLETING", "CD": "COMPLETED", "CA": "CANCELLED", "F": "FAILED",
           "TO": "TIMEOUT", "OOM": "OUT_OF_MEMORY", "NF": "NODE_FAIL", "BF": "BOOT_FAIL", "PR": "PREEMPTED",
           "DL": "DEADLINE", "CF": "CONFIGURING", "S": "SUSPENDED", "ST": "STOPPED", "RQ": "REQUEUED", "SE": "SPECIAL_EXIT"}


def map_slurm_state(native: str | list[str] | None) -> tuple[str | None, str | None]:
    """(our state or None if unknown, the cleaned native word). Accepts 'CANCELLED by 0', 'OOM', ['FAILED']."""
    if isinstance(native, list):  # slurmrestd >= v0.0.40 reports a list of flags
        words = [str(w).upper() for w in native]
        base = next((w for w in words if w in _STATE_MAP), words[0] if words else None)
    else:
        base = str(native or "").strip().split(" ")[0].upper().rstrip("+") or None
    if base is None:
        return None, None
    base = _ABBREV.get(base, base)
    return _STATE_MAP.get(base), base


def check_slurm_artifact(artifact: JobArtifact) -> None:
    check_slurm_word(artifact.resources.slurm_partition, "slurm_partition")
    check_slurm_word(artifact.resources.slurm_account, "slurm_account")
    check_safe_path(artifact.job_dir, "job_dir")
    if "%" in str(artifact.job_dir):
        # sbatch expands %j, %x, ... in --output/--error paths.
        raise ValueError(f"job_dir: {quote(str(artifact.job_dir), 200)} contains '%', which Slurm treats as a filename pattern; "
                         "set MCORE_ADVISOR_STATE_DIR to a path without '%'")
    for key in artifact.env:
        if not _ENV_NAME_RE.fullmatch(key):
            raise ValueError(f"env: {quote(key)} is not a valid environment variable name")


def job_environment(artifact: JobArtifact) -> dict[str, str]:
    return {**artifact.env, JOB_ENV_MARKER: artifact.job_id}


def batch_script(artifact: JobArtifact) -> str:
    """The batch script: one launcher per node via srun; torchrun with a c10d rendezvous on the first node.

    Resource requests are not in #SBATCH lines: the CLI passes them as sbatch options and the REST
    backend as JSON fields, so the script is identical for both.
    """
    if artifact.script is not None:
        return artifact.script
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        f"# mcore-advisor {__version__} profile job {artifact.job_id} ({artifact.name}): "
        f"{artifact.nodes} node(s) x {artifact.gpus_per_node} process(es)",
        "set -euo pipefail",
        f"cd {q(str(artifact.job_dir))}",
    ]
    for key, value in sorted(job_environment(artifact).items()):
        lines.append(f"export {key}={q(value)}")
    # SLURM_JWT is for REST clients; with it set srun would try JWT against slurmd, which accepts only munge.
    lines.append("unset SLURM_JWT")
    program = [q(a) for a in artifact.program]
    if artifact.nodes == 1 and artifact.gpus_per_node == 1:
        lines.append(f"srun --ntasks=1 {q(artifact.python)} {' '.join(program)}")
    else:
        lines += [
            'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            "# NodeAddr rather than the node name: node names need not resolve (emulated or renamed nodes).",
            "MASTER_ADDR=$(scontrol show node \"$head_node\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
            'export MASTER_ADDR="${MASTER_ADDR:-$head_node}"',
            "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
            " ".join([
                f"srun --kill-on-bad-exit=1 --nodes={artifact.nodes} --ntasks={artifact.nodes} --ntasks-per-node=1",
                *(q(a) for a in torchrun_argv(artifact.python)),
                f"--nnodes={artifact.nodes}", f"--nproc_per_node={artifact.gpus_per_node}",
                '--rdzv_id="$SLURM_JOB_ID"', "--rdzv_backend=c10d", '--rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT"',
                *program,
            ]),
        ]
    return "\n".join(lines) + "\n"


def parse_slurm_time(text: str | None) -> float | None:
    """sacct/squeue timestamps ('2026-11-21T12:00:00', local time) -> unix seconds; None for Unknown/N/A."""
    if not text or text in ("Unknown", "None", "N/A", "0"):
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def unknown_job_status(native_id: str, job_dir: Path) -> BackendStatus:
    """Slurm no longer knows the job (purged, no accounting): let the job directory decide."""
    outcome = read_outcome(job_dir)
    if outcome is not None:
        return BackendStatus(state=outcome.state, native_state="UNKNOWN", reason=outcome.error)
    return BackendStatus(
        state="FAILED", native_state="UNKNOWN", lost=True,
        reason=f"lost: Slurm job {native_id} is no longer known to Slurm and left no result.json or error.json",
    )
