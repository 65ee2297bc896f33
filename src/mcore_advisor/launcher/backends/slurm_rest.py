"""Slurm through slurmrestd: JWT over TCP or peer credentials over a UNIX socket.

Configuration (environment, or constructor arguments):
- SLURM_REST_URL: `http://host:6820`, or `unix:/path/to/slurmrestd.sock` (rest_auth/local: no token;
  jobs run as slurmrestd's own uid).
- SLURM_REST_USER: the X-SLURM-USER-NAME header; default the current user.
- SLURM_JWT: the X-SLURM-USER-TOKEN; when unset and `scontrol` exists, a token is minted with
  `scontrol token username=USER lifespan=...` and renewed once when the daemon rejects it.

The API version is discovered from the daemon's own OpenAPI document (GET /openapi/v3) rather than
hard-coded. Request shapes are those verified against Slurm 22.05.8 / openapi v0.0.38
(shared/reference/mcp-and-launch.md section 5.4): `environment` is a required object, `nodes` an
int, `gpus_per_node` a string, `tasks = nodes * tasks_per_node`. For newer plugins the two known
shape changes are applied (environment as a list of NAME=value from v0.0.39; numbers as
{set, infinite, number} from v0.0.40); those are not verified against a live daemon here.

slurmrestd unreachable or slow, or slurmctld behind it not answering, makes reads and cancels
retry a bounded number of times and then raise BackendUnavailable (state unknown, not failed).
A submit is retried only when the connection was never made (nothing can have been sent).
"""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from ..store import quote
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
    job_environment,
    map_slurm_state,
    unknown_job_status,
)

DEFAULT_URL = "http://127.0.0.1:6820"
PREFERRED_VERSION = "v0.0.38"  # Slurm 22.05: the shapes below were verified against it
TOKEN_LIFESPAN_S = 3600
TIMEOUT_S = 10.0  # slurmrestd waits for slurmctld up to its MessageTimeout (10 s by default), then answers
ATTEMPTS = 2
RETRY_WAIT_S = 1.0
ESLURM_INVALID_JOB_ID = 2017  # slurm_errno.h: the job is not (or no longer) known to slurmctld
# Passed to the job so `python`, `srun` and friends resolve; nothing secret (no tokens).
_PASS_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "SLURM_CONF", "VIRTUAL_ENV")


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.lstrip("v").split("."))


class SlurmRestBackend(Backend):
    name = "slurm_rest"
    option_prefix = "slurm_"

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        user: str | None = None,
        token: str | None = None,
        version: str | None = None,
        timeout_s: float = TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
        attempts: int = ATTEMPTS,
        retry_wait_s: float = RETRY_WAIT_S,
    ):
        self.url = url
        self.user = user or getpass.getuser()
        self._token = token
        self._token_minted = False
        self._version = version
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.retry_wait_s = retry_wait_s
        self._transport = transport
        self.unix_socket: str | None = None
        if url.startswith("unix:"):
            self.unix_socket = url[len("unix:"):].removeprefix("//")
        elif not url.startswith(("http://", "https://")):
            raise ValueError(f"SLURM_REST_URL: {quote(url, 200)} must start with http://, https:// or unix:")

    @classmethod
    def from_env(cls) -> SlurmRestBackend:
        return cls(
            os.environ.get("SLURM_REST_URL", DEFAULT_URL),
            user=os.environ.get("SLURM_REST_USER") or None,
            token=os.environ.get("SLURM_JWT") or None,
        )

    # -- HTTP plumbing -----------------------------------------------------------------------

    def _client(self) -> httpx.Client:
        headers = {}
        if self.unix_socket is None:
            headers = {"X-SLURM-USER-NAME": self.user, "X-SLURM-USER-TOKEN": self._get_token()}
        if self._transport is not None:
            transport = self._transport
            base = self.url if self.unix_socket is None else "http://localhost"
        elif self.unix_socket is not None:
            transport, base = httpx.HTTPTransport(uds=self.unix_socket), "http://localhost"
        else:
            transport, base = None, self.url
        return httpx.Client(base_url=base, headers=headers, timeout=self.timeout_s, transport=transport)

    def _get_token(self) -> str:
        if self._token:
            return self._token
        scontrol = shutil.which("scontrol")
        if not scontrol:
            raise BackendError("backend 'slurm_rest': no token; set SLURM_JWT (from `scontrol token`) or use a unix: SLURM_REST_URL")
        try:
            proc = subprocess.run([scontrol, "token", f"username={self.user}", f"lifespan={TOKEN_LIFESPAN_S}"],
                                  capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BackendError(f"backend 'slurm_rest': scontrol token failed: {exc}") from exc
        out = proc.stdout.strip()
        if proc.returncode != 0 or "=" not in out:
            raise BackendError(f"backend 'slurm_rest': scontrol token failed: {proc.stderr.strip()[-300:]}")
        self._token = out.split("=", 1)[1].strip()
        self._token_minted = True
        return self._token

    def _request(self, method: str, path: str, *, json: Any = None, retry_auth: bool = True) -> tuple[int, dict[str, Any]]:
        try:
            with self._client() as client:
                resp = client.request(method, path, json=json)
        except (httpx.TimeoutException, httpx.NetworkError) as exc:
            raise BackendUnavailable(f"backend 'slurm_rest': cannot reach slurmrestd at {self.url}: {type(exc).__name__}: {exc}") from exc
        except httpx.HTTPError as exc:
            raise BackendError(f"backend 'slurm_rest': cannot reach slurmrestd at {self.url}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code in (502, 503, 504):
            raise BackendUnavailable(f"backend 'slurm_rest': slurmrestd at {self.url} answered HTTP {resp.status_code}")
        try:
            body = resp.json()
        except ValueError:
            body = {"errors": [{"description": resp.text.strip()[:300]}]}
        if not isinstance(body, dict):
            body = {}
        if self._auth_failed(resp.status_code, body):
            if retry_auth and self._token_minted:
                self._token = None  # expired: mint a fresh one once
                return self._request(method, path, json=json, retry_auth=False)
            raise BackendError(
                f"backend 'slurm_rest': slurmrestd rejected the credentials of user {self.user!r} "
                f"(HTTP {resp.status_code}); refresh SLURM_JWT (`scontrol token`) or check SLURM_REST_USER"
            )
        return resp.status_code, body

    @staticmethod
    def _auth_failed(status: int, body: dict[str, Any]) -> bool:
        if status in (401, 403):
            return True
        # 22.05 answers a forged or expired JWT with HTTP 500 and this error (verified, reference 5.4).
        return status == 500 and any(
            "unable to load" in str(e.get("description", "")) and "slurm_load_ctl_conf" in str(e.get("source", ""))
            for e in body.get("errors") or [] if isinstance(e, dict)
        )

    @staticmethod
    def _errors(body: dict[str, Any]) -> str:
        errs = [e for e in body.get("errors") or [] if isinstance(e, dict)]
        return "; ".join(
            str(e.get("description") or e.get("error") or e.get("error_number") or e) for e in errs
        )

    def _retrying(self, call, what: str):
        return retrying(call, attempts=self.attempts, wait_s=self.retry_wait_s, what=what)

    def version(self) -> str:
        if self._version is None:
            self._version = self._retrying(self._discover_version, "GET /openapi")
        return self._version

    def _discover_version(self) -> str:
        status, spec = self._request("GET", "/openapi/v3")
        if status != 200:
            status, spec = self._request("GET", "/openapi")
        paths = spec.get("paths") or {}
        served = sorted({p.split("/")[2] for p in paths if p.startswith("/slurm/v")}, key=_version_key)
        if not served:
            raise BackendError(f"backend 'slurm_rest': {self.url} serves no /slurm/vX.Y.Z API (HTTP {status})")
        usable = [v for v in served if _version_key(v) >= _version_key(PREFERRED_VERSION)]
        if not usable:
            raise BackendError(f"backend 'slurm_rest': {self.url} serves only {', '.join(served)}; need {PREFERRED_VERSION} or newer")
        return PREFERRED_VERSION if PREFERRED_VERSION in usable else usable[-1]

    # -- Backend -----------------------------------------------------------------------------

    def check(self, artifact: JobArtifact) -> None:
        super().check(artifact)
        check_slurm_artifact(artifact)

    def job_request(self, artifact: JobArtifact, version: str = PREFERRED_VERSION) -> dict[str, Any]:
        r = artifact.resources
        env = {k: os.environ[k] for k in _PASS_ENV if k in os.environ}
        env.update(job_environment(artifact))
        vk = _version_key(version)
        job: dict[str, Any] = {
            "name": artifact.name,
            "nodes": artifact.nodes,
            "tasks": artifact.nodes,
            "tasks_per_node": 1,
            "time_limit": r.slurm_time_limit_min,
            "current_working_directory": str(artifact.job_dir),
            "standard_output": str(artifact.job_dir / STDOUT_FILE),
            "standard_error": str(artifact.job_dir / STDERR_FILE),
            "environment": env,
        }
        if artifact.use_gpus:
            job["gpus_per_node"] = str(artifact.gpus_per_node)
        if r.slurm_partition:
            job["partition"] = r.slurm_partition
        if r.slurm_account:
            job["account"] = r.slurm_account
        if vk >= (0, 0, 39):
            job["environment"] = [f"{k}={v}" for k, v in env.items()]
        if vk >= (0, 0, 40):
            job["time_limit"] = {"set": True, "infinite": False, "number": r.slurm_time_limit_min}
        return {"script": batch_script(artifact), "job": job}

    def launch_text(self, artifact: JobArtifact) -> tuple[list[str], str | None]:
        # No network for a dry run: show the request for the version we would prefer.
        where = self.unix_socket or self.url
        return ["POST", f"{where}/slurm/{self._version or PREFERRED_VERSION}/job/submit"], batch_script(artifact)

    def submit(self, artifact: JobArtifact) -> JobRef:
        v = self.version()
        body = self.job_request(artifact, v)
        (artifact.job_dir / BATCH_SCRIPT).write_text(body["script"])
        try:
            status, resp = self._request("POST", f"/slurm/{v}/job/submit", json=body)
        except BackendUnavailable as exc:
            if isinstance(exc.__cause__, httpx.ConnectError):
                raise  # never connected: nothing was submitted
            raise BackendUnavailable(f"{exc}; the job may have been accepted anyway: check `squeue --name={artifact.name}` "
                                     "and scancel a job this left behind") from exc
        job_id = resp.get("job_id")
        if status != 200 or job_id is None or self._errors(resp):
            raise BackendError(f"backend 'slurm_rest': submit refused (HTTP {status}): {self._errors(resp) or 'no job id returned'}")
        return JobRef(backend=self.name, native_id=str(job_id),
                      data={"slurm_job_id": str(job_id), "job_dir": str(artifact.job_dir), "api_version": v})

    def status(self, refs: Mapping[str, JobRef]) -> dict[str, BackendStatus]:
        if not refs:
            return {}
        v = self.version()
        out: dict[str, BackendStatus] = {}
        for key, ref in refs.items():
            st = self._retrying(lambda ref=ref: self._job_status(v, ref.native_id), f"GET job {ref.native_id}")
            out[key] = st if st is not None else unknown_job_status(ref.native_id, Path(ref.data["job_dir"]))
        return out

    def _job_status(self, v: str, native_id: str) -> BackendStatus | None:
        status, body = self._request("GET", f"/slurm/{v}/job/{native_id}")
        jobs = body.get("jobs") or []
        if status == 200 and jobs:
            return self._from_job(jobs[0])
        if status != 404 and not _invalid_job_id(body):
            # 22.05 answers a slurmctld that does not respond with HTTP 500 and error_number -1 ("Unable
            # to find JobId=N", the same words as for a purged job): only the number tells them apart.
            raise BackendUnavailable(f"backend 'slurm_rest': job {native_id} query failed (HTTP {status}): "
                                     f"{self._errors(body)[:300] or 'no error text'}")
        return self._from_slurmdb(v, native_id)

    def _from_slurmdb(self, v: str, native_id: str) -> BackendStatus | None:
        # Only when slurmdbd is there (openapi/dbv plugin): 404 otherwise.
        status, body = self._request("GET", f"/slurmdb/{v}/job/{native_id}")
        jobs = body.get("jobs") or []
        if status != 200 or not jobs:
            return None
        rec = jobs[0]
        state_obj = rec.get("state") or {}
        state, native = map_slurm_state(state_obj.get("current") if isinstance(state_obj, dict) else state_obj)
        if state is None:
            return None
        exit_obj = rec.get("exit_code") or {}
        code = exit_obj.get("return_code") if isinstance(exit_obj, dict) else None
        time_obj = rec.get("time") or {}
        return BackendStatus(
            state=state, native_state=native, exit_code=_int(code),  # type: ignore[arg-type]
            reason=None if state in ("RUNNING", "COMPLETED", "PENDING") else f"Slurm state {native}",
            started_at=_epoch(time_obj.get("start")), ended_at=_epoch(time_obj.get("end")),
        )

    @staticmethod
    def _from_job(job: dict[str, Any]) -> BackendStatus | None:
        state, native = map_slurm_state(job.get("job_state"))
        if state is None:
            return None
        reason = job.get("state_reason")
        reason = None if reason in (None, "None", "") else str(reason)
        terminal = state not in ("PENDING", "RUNNING")
        text = None
        if state == "PENDING" or (terminal and state != "COMPLETED"):
            text = f"Slurm state {native}" + (f" ({reason})" if reason else "")
        return BackendStatus(
            state=state, native_state=native, exit_code=_int(job.get("exit_code")) if terminal else None,  # type: ignore[arg-type]
            reason=text,
            started_at=_epoch(job.get("start_time")) if state != "PENDING" else None,
            ended_at=_epoch(job.get("end_time")) if terminal else None,
        )

    def cancel(self, ref: JobRef) -> None:
        v = self.version()
        status, body = self._retrying(lambda: self._request("DELETE", f"/slurm/{v}/job/{ref.native_id}"), "DELETE job")
        if status != 200 or self._errors(body):
            raise BackendError(f"backend 'slurm_rest': cancel of job {ref.native_id} failed (HTTP {status}): {self._errors(body)}")
        # slurmctld applies the signal asynchronously; give it a moment so the next poll sees CANCELLED.
        time.sleep(0.2)


def _invalid_job_id(body: dict[str, Any]) -> bool:
    """slurmctld itself said the job id is unknown (ESLURM_INVALID_JOB_ID)."""
    for e in body.get("errors") or []:
        if isinstance(e, dict) and (e.get("error_number") == ESLURM_INVALID_JOB_ID
                                    or "invalid job id" in str(e.get("error", "")).lower()):
            return True
    return False


def _number(value: Any) -> Any:
    """v0.0.40+ wraps numbers as {set, infinite, number}."""
    if isinstance(value, dict):
        return value.get("number") if value.get("set", True) else None
    return value


def _int(value: Any) -> int | None:
    value = _number(value)
    if isinstance(value, dict):  # v0.0.40+ exit_code {status, return_code: {...}}
        value = _number(value.get("return_code"))
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _epoch(value: Any) -> float | None:
    value = _number(value)
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if v > 0 else None
