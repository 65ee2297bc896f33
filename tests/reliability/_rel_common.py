"""What the reliability tests share: a server whose backends start nothing, pools of the server's
own names and plans, a server process over streamable HTTP, and a fake profile entry point."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mcore_advisor.launcher.backends.base import BackendStatus, JobArtifact, JobRef
from mcore_advisor.launcher.backends.local import LocalBackend
from mcore_advisor.launcher.backends.slurm_cli import SlurmCliBackend
from mcore_advisor.launcher.backends.slurm_rest import SlurmRestBackend
from mcore_advisor.launcher.jobs import JobManager
from mcore_advisor.launcher.store import JobStore
from mcore_advisor.server.app import build_server

REPO = Path(__file__).resolve().parents[2]

# Behaves like launcher/entry/profile.py as far as the launcher can tell (tests/launcher/test_local_backend.py
# has the same idea): prints iteration lines into train.log and writes result.json; MODE picks the behaviour.
FAKE_ENTRY = r'''
import json, os, sys, time
mode = sys.argv[1]
out = sys.argv[sys.argv.index("--out-dir") + 1]
log = open(os.path.join(out, "train.log"), "a", buffering=1)
steps = 40 if mode == "slow" else 3
for i in range(1, steps + 1):
    print(f" [fake] iteration {i:8d}/ {steps:8d} | elapsed time per iteration (ms): 100.0 |", file=log)
    if mode == "slow":
        time.sleep(0.1)
    if mode == "hang" and i == 2:
        time.sleep(600)
with open(os.path.join(out, "result.json"), "w") as fh:
    json.dump({"status": "ok", "iter_s": 0.1, "tokens_per_s_per_gpu": 100.0}, fh)
'''


def fake_entry(tmp: Path, mode: str) -> list[str]:
    path = tmp / "fake_entry.py"
    path.write_text(FAKE_ENTRY)
    return [str(path), mode]


def _inert(cls: type) -> type:
    """The backend with its checks and launch text, but submit/status/cancel start or touch nothing."""

    class Inert(cls):  # type: ignore[misc, valid-type]
        def submit(self, artifact: JobArtifact) -> JobRef:
            return JobRef(backend=self.name, native_id="0", data={"job_dir": str(artifact.job_dir), "job_id": artifact.job_id})

        def status(self, refs: Any) -> dict[str, BackendStatus]:
            return {k: BackendStatus(state="PENDING", native_state="inert") for k in refs}

        def cancel(self, ref: JobRef) -> None:
            return None

    return Inert


def inert_manager(tmp: Path) -> JobManager:
    factories = {"local": _inert(LocalBackend), "slurm": _inert(SlurmCliBackend),
                 "slurm_rest": lambda: _inert(SlurmRestBackend)("http://127.0.0.1:9")}
    return JobManager(store=JobStore(tmp / "jobs.sqlite3"), job_root=tmp / "jobs", backend_factories=factories)


def inert_server(tmp: Path):
    return build_server(manager=inert_manager(tmp))


async def pools_from(client: Any) -> Any:
    """Catalog keys from the server's resources and one plan it recommended."""
    from _rel_fuzz import Pools

    models = json.loads((await client.read_resource("mcore://models")).contents[0].text)
    hardware = json.loads((await client.read_resource("mcore://hardware")).contents[0].text)
    keys = [m["key"] for m in models if isinstance(m, dict) and "key" in m] if isinstance(models, list) else list(models)
    gpus = [g["key"] for g in hardware if isinstance(g, dict) and "key" in g] if isinstance(hardware, list) else list(hardware)
    plans = []
    rec = await client.call_tool("recommend_parallelism", {"model": "llama3-8b", "num_gpus": 8, "seq_length": 4096, "top_k": 1,
                                                           "what_if": False})
    for p in (rec.structured_content or {}).get("plans") or []:
        pid = p.get("plan_id")
        if pid:
            plans.append(json.loads((await client.read_resource(f"mcore://plans/{pid}")).contents[0].text))
    tiny = {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 256},
            "cluster": {"num_gpus": 1}, "training": {"seq_length": 64, "global_batch_size": 4, "micro_batch_size": 2},
            "parallelism": {}, "implementation": {"transformer_impl": "local"}}
    plan_ids = [p["plan_id"] for p in (rec.structured_content or {}).get("plans") or [] if p.get("plan_id")]
    sub = await client.call_tool("run_profile_job", {"plan": tiny, "backend": "local"})
    job_ids = [(sub.structured_content or {}).get("job_id") or "0"]
    # Catalog keys, plan and job ids by the argument names they fit; any other string argument draws from all.
    by_name = {"model": keys, "gpu": gpus, "plan_id": plan_ids, "job_id": job_ids}
    return Pools(strings=sorted(set(keys[:40] + gpus[:20] + plan_ids + job_ids)), by_name=by_name, plans=[*plans, tiny])


# ---- a server process over streamable HTTP ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_http(state_dir: Path, *args: str, env: dict[str, str] | None = None, entry: list[str] | None = None,
               port: int | None = None) -> tuple[subprocess.Popen, str]:
    """`mcore-advisor serve --http` (or, with `entry`, the same server with a fake profile entry) in a child process."""
    port = port or free_port()
    full_env = {**os.environ, "MCORE_ADVISOR_STATE_DIR": str(state_dir), **(env or {})}
    if entry is None:
        cmd = [sys.executable, "-m", "mcore_advisor.cli", "serve", "--http", "--port", str(port), *args]
    else:
        code = ("import sys; from mcore_advisor.launcher.jobs import JobManager, reattach_all; "
                "from mcore_advisor.server.app import build_server; "
                f"m = JobManager(entry={entry!r}); reattach_all(manager=m); "
                f"build_server(manager=m).run('streamable-http', host='127.0.0.1', port={port})")
        cmd = [sys.executable, "-c", code]
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}/mcp"


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError(f"server at {url} did not come up in {timeout_s} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    if proc.stderr:
        proc.stderr.close()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")
