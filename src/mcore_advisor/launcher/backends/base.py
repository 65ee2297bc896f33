"""The backend interface: `submit(artifact) -> JobRef`, `status(refs) -> states`, `cancel(ref)`.

A backend only starts, observes and stops processes. What a finished job *means* (COMPLETED
needs a result.json, error.json explains a failure) is read from the job directory by
`read_outcome`, the same way for every backend, so Slurm and local jobs end in the same states.

Resource names shared by all backends: `nodes`, `gpus_per_node`, `time_limit_min`. Options only
one backend understands carry its prefix (`slurm_partition`, `slurm_account`); a backend rejects
prefixed options that are not its own rather than silently ignoring them.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from ..store import JobStateName, quote

RESULT_FILE = "result.json"
ERROR_FILE = "error.json"
TRAIN_LOG = "train.log"
STDOUT_FILE = "stdout.log"
STDERR_FILE = "stderr.log"
JOB_ENV_MARKER = "MCORE_ADVISOR_JOB_ID"  # set in every job's environment; finds stray processes

# Conservative on purpose: these strings reach sbatch options, REST JSON and file names.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SLURM_WORD_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_SHARED_RESOURCES = frozenset({"nodes", "gpus_per_node", "time_limit_min"})
T = TypeVar("T")


class BackendError(ValueError):
    """A backend refused or failed an operation; the message says why and carries no secrets.

    A ValueError so the server reports the message to the client (a refused partition or an
    unreachable slurmrestd is something the caller can act on).
    """


class BackendUnavailable(BackendError):
    """The backend did not answer (controller or daemon down, slow or overloaded).

    Says nothing about the job: its state is unknown, not failed, and the stored state is kept.
    """


def retrying(call: Callable[[], T], *, attempts: int, wait_s: float, what: str) -> T:
    """call(), tried up to `attempts` times while the backend is unavailable, waiting wait_s, 2*wait_s, ...

    Bounded on purpose: a caller (an MCP client) waits for the answer, and an outage is reported
    as such rather than retried until the client gives up.
    """
    t0 = time.monotonic()
    for i in range(attempts):
        try:
            return call()
        except BackendUnavailable as exc:
            last = exc
            if i + 1 < attempts:
                time.sleep(wait_s * 2**i)
    raise BackendUnavailable(f"{last} ({what}: tried {attempts} times over {time.monotonic() - t0:.0f} s)") from last


class JobResources(BaseModel):
    """What the job asks the backend for. None = derived from the plan."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: int | None = Field(None, ge=1, le=4096, description="Nodes; None = ceil(cluster.num_gpus / gpus_per_node). The local backend runs on 1 node only.")
    gpus_per_node: int | None = Field(None, ge=1, le=72, description="GPUs (processes) per node; None = plan.cluster.gpus_per_node, else min(num_gpus, the GPU's catalog node size).")
    time_limit_min: float = Field(30.0, gt=0, le=7 * 24 * 60, description="Wall-clock limit in minutes; the job ends as TIMEOUT when reached. Slurm rounds up to whole minutes.")
    slurm_partition: str | None = Field(None, description="Slurm partition (--partition); None = the cluster's default. Slurm backends only.")
    slurm_account: str | None = Field(None, description="Slurm account (--account); None = the user's default. Slurm backends only.")

    @property
    def slurm_time_limit_min(self) -> int:
        return max(1, math.ceil(self.time_limit_min))


class JobRef(BaseModel):
    """How a backend finds its job again after a restart; stored as JSON in the job row."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str
    native_id: str = Field(description="What the backend calls the job: the supervisor pid (local) or the Slurm job id.")
    data: dict[str, Any] = Field(default_factory=dict)


class BackendStatus(BaseModel):
    """One poll's answer for one job, before the job directory's files are consulted."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    state: JobStateName
    native_state: str | None = Field(None, description="The backend's own word for it, e.g. Slurm's OUT_OF_MEMORY.")
    exit_code: int | None = Field(None, description="Process exit code; negative = killed by that signal.")
    reason: str | None = None
    started_at: float | None = None
    ended_at: float | None = None
    lost: bool = Field(False, description="The job vanished without leaving an exit record.")


@dataclass(frozen=True)
class JobArtifact:
    """Everything a backend needs to start one job.

    `program` is the Python argv after the interpreter (`-m module ...` or `script.py ...`); each
    backend wraps it in its launcher: plain `python` for one process, torchrun for several.
    """

    job_id: str
    name: str
    job_dir: Path
    program: list[str]
    resources: JobResources
    nodes: int
    gpus_per_node: int
    use_gpus: bool = True
    python: str = sys.executable
    env: Mapping[str, str] = field(default_factory=dict)
    script: str | None = None  # a rendered batch script; the Slurm backends build one when None

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def torchrun_argv(python: str) -> list[str]:
    """The venv's `torchrun` console script when it sits next to the interpreter, else `python -m torch.distributed.run`."""
    candidate = Path(python).parent / "torchrun"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return [str(candidate)]
    return [python, "-m", "torch.distributed.run"]


@dataclass(frozen=True)
class Outcome:
    """What the job directory says about how the job ended."""

    state: JobStateName  # COMPLETED or FAILED
    result: dict[str, Any] | None = None
    error: str | None = None


class Backend(ABC):
    """Start, observe and stop jobs somewhere."""

    name: ClassVar[str]
    option_prefix: ClassVar[str | None] = None

    def check(self, artifact: JobArtifact) -> None:
        """Raise ValueError naming the request field when this backend cannot run the artifact."""
        check_prefixed_options(artifact.resources, self.option_prefix, self.name)
        check_job_name(artifact.name)

    @abstractmethod
    def launch_text(self, artifact: JobArtifact) -> tuple[list[str], str | None]:
        """(the exact submit/run argv, the batch script or None): shown by dry runs, run by submit."""

    @abstractmethod
    def submit(self, artifact: JobArtifact) -> JobRef: ...

    @abstractmethod
    def status(self, refs: Mapping[str, JobRef]) -> dict[str, BackendStatus]:
        """States of the given jobs (keyed like `refs`); a job the backend cannot answer for is omitted."""

    @abstractmethod
    def cancel(self, ref: JobRef) -> None: ...


def check_job_name(name: str) -> None:
    if not _NAME_RE.fullmatch(name or ""):
        raise ValueError(
            f"name: {quote(name)} is not a valid job name; use 1-64 characters from A-Z a-z 0-9 _ . - "
            "starting with a letter or digit (no spaces, quotes, ';', '$' or newlines)"
        )


def check_slurm_word(value: str | None, field_name: str) -> None:
    """Partition and account names: reject anything that could be an option or shell syntax."""
    if value is None:
        return
    if not _SLURM_WORD_RE.fullmatch(value):
        raise ValueError(
            f"resources.{field_name}: {quote(value)} is not a valid Slurm name; use 1-64 characters from "
            "A-Z a-z 0-9 _ . - not starting with '-' or '.'"
        )


def check_prefixed_options(resources: JobResources, own_prefix: str | None, backend: str) -> None:
    for key, value in resources.model_dump().items():
        if value is None or key in _SHARED_RESOURCES:
            continue
        prefix = key.split("_", 1)[0] + "_"
        if prefix != own_prefix:
            raise ValueError(
                f"resources.{key} is an option of the {prefix[:-1]} backends, not of backend {backend!r}; "
                f"drop it or choose a {prefix[:-1]} backend"
            )


def check_safe_path(path: Path, what: str) -> None:
    """Paths go into batch scripts and REST fields: refuse control characters outright."""
    text = str(path)
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise ValueError(f"{what}: path {quote(text, 200)} contains control characters; choose another state directory")


MAX_RESULT_BYTES = 16 * 2**20
"""Most of result.json / error.json read: the profile entry writes tens of KB; a job's files are not
trusted to be small, and the server reads them on every poll."""


class TooLarge(ValueError):
    pass


def read_json(path: Path, limit: int | None = None) -> dict[str, Any] | None:
    """The JSON object in `path`, reading at most `limit` bytes (default MAX_RESULT_BYTES); None when
    absent, unreadable or no object; TooLarge when the file is longer than `limit`."""
    limit = MAX_RESULT_BYTES if limit is None else limit
    try:
        with path.open("rb") as fh:
            raw = fh.read(limit + 1)
    except OSError:
        return None
    if len(raw) > limit:
        raise TooLarge(f"{path.name} is larger than the {limit:,} bytes mcore-advisor reads")
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def read_outcome(job_dir: Path) -> Outcome | None:
    """COMPLETED if result.json says ok; FAILED if error.json exists; None while neither is there."""
    try:
        error = read_json(job_dir / ERROR_FILE)
        result = read_json(job_dir / RESULT_FILE)
    except TooLarge as exc:
        return Outcome(state="FAILED", error=f"{exc}: the job wrote an output it should not have; see {job_dir}")
    if result is not None and result.get("status", "ok") == "ok" and error is None:
        return Outcome(state="COMPLETED", result=result)
    if error is not None:
        return Outcome(state="FAILED", result=result, error=describe_error(error))
    if result is not None:  # a result that says it failed
        return Outcome(state="FAILED", result=result, error=describe_error(result))
    return None


def describe_error(error: Mapping[str, Any]) -> str:
    """'OutOfMemoryError on rank 3: CUDA out of memory ...' from the entry's error.json."""
    kind = str(error.get("error_type") or "error")
    rank = error.get("rank")
    message = str(error.get("message") or "").strip()
    where = f" on rank {rank}" if rank is not None else ""
    return f"{kind}{where}: {message}" if message else f"{kind}{where}"


def tail_text(path: Path, *, max_lines: int = 40, max_bytes: int = 8192) -> str | None:
    """The last lines of a log file, reading at most `max_bytes` from its end (logs can be GBs)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            chunk = fh.read(max_bytes)
    except OSError:
        return None
    text = chunk.decode("utf-8", errors="replace")
    lines = text.splitlines()
    if size > max_bytes and lines:
        lines = lines[1:]  # the first line was cut mid-way
    return "\n".join(lines[-max_lines:])
