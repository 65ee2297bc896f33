"""Slurm backends: state mapping, the batch script and requests (always), and a real Slurm (marker `slurm`).

The integration tests need the throwaway cluster of scripts/slurm/up.sh: they read SLURM_CONF (and
SLURM_REST_URL / SLURM_JWT / SLURM_REST_USER) from the environment, else from the env.sh that up.sh
writes into $SLURM_RUN_DIR (default /tmp/mcore-advisor-slurm), and skip when `sinfo` does not answer.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mcore_advisor.launcher.backends.base import BackendError, JobArtifact, JobRef, JobResources
from mcore_advisor.launcher.backends.slurm_cli import SlurmCliBackend, sbatch_options
from mcore_advisor.launcher.backends.slurm_common import batch_script, map_slurm_state
from mcore_advisor.launcher.backends.slurm_rest import SlurmRestBackend
from mcore_advisor.launcher.jobs import JobManager, ProfileJobRequest
from mcore_advisor.launcher.store import JobStore
from mcore_advisor.schemas import ClusterSpec, ModelSpec, Plan, TrainingSpec


def artifact(tmp_path: Path, *, nodes: int = 1, gpus_per_node: int = 1, program: list[str] | None = None, **res) -> JobArtifact:
    return JobArtifact(
        job_id="abc123", name="profile-t", job_dir=tmp_path, program=program or ["-m", "mod", "--out-dir", str(tmp_path)],
        resources=JobResources(**res), nodes=nodes, gpus_per_node=gpus_per_node, python="/venv/bin/python",
    )


# ---- state mapping ---------------------------------------------------------------------------


@pytest.mark.parametrize(("native", "ours"), [
    ("PENDING", "PENDING"), ("CONFIGURING", "PENDING"), ("RUNNING", "RUNNING"), ("COMPLETING", "RUNNING"),
    ("COMPLETED", "COMPLETED"), ("FAILED", "FAILED"), ("CANCELLED by 0", "CANCELLED"), ("TIMEOUT", "TIMEOUT"),
    ("OUT_OF_MEMORY", "FAILED"), ("OOM", "FAILED"), ("NODE_FAIL", "FAILED"), ("BOOT_FAIL", "FAILED"),
    ("PREEMPTED", "FAILED"), ("DEADLINE", "TIMEOUT"), ("REQUEUED", "PENDING"), (["FAILED"], "FAILED"),
    (["RUNNING", "COMPLETING"], "RUNNING"),
])
def test_slurm_states_map_to_job_states(native, ours):
    assert map_slurm_state(native)[0] == ours


def test_an_unknown_slurm_state_maps_to_none_so_the_stored_state_is_kept():
    assert map_slurm_state("SOMETHING_NEW") == (None, "SOMETHING_NEW")
    assert map_slurm_state(None) == (None, None)


# ---- what reaches sbatch and slurmrestd ------------------------------------------------------


def test_sbatch_options_are_separate_argv_elements_with_validated_values(tmp_path):
    opts = sbatch_options(artifact(tmp_path, nodes=2, gpus_per_node=8, slurm_partition="gpu", slurm_account="proj_1", time_limit_min=0.5))
    assert opts == [
        "--job-name=profile-t", "--nodes=2", "--ntasks-per-node=1", "--time=1", f"--chdir={tmp_path}",
        f"--output={tmp_path}/stdout.log", f"--error={tmp_path}/stderr.log", "--gpus-per-node=8",
        "--partition=gpu", "--account=proj_1",
    ]


@pytest.mark.parametrize("value", ["gpu;id", "$(id)", "a b", "-p", "x\ny", "a'b", "é"])
def test_hostile_partition_or_account_is_rejected_by_both_slurm_backends(tmp_path, value):
    for backend in (SlurmCliBackend(), SlurmRestBackend("http://127.0.0.1:1")):
        for field in ("slurm_partition", "slurm_account"):
            with pytest.raises(ValueError, match=f"resources.{field}"):
                backend.check(artifact(tmp_path, **{field: value}))


def test_a_percent_sign_in_the_job_dir_is_refused_because_slurm_expands_it(tmp_path):
    d = tmp_path / "100%j"
    d.mkdir()
    with pytest.raises(ValueError, match="job_dir: .* contains '%'"):
        SlurmCliBackend().check(artifact(d))


def test_the_script_runs_torchrun_once_per_node_with_a_c10d_rendezvous(tmp_path):
    script = batch_script(artifact(tmp_path, nodes=2, gpus_per_node=8))
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert "srun --kill-on-bad-exit=1 --nodes=2 --ntasks=2 --ntasks-per-node=1" in script
    assert "--nnodes=2 --nproc_per_node=8" in script and '--rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT"' in script
    assert "unset SLURM_JWT" in script and "export MCORE_ADVISOR_JOB_ID=abc123" in script


def test_hostile_paths_and_arguments_in_the_script_stay_inert(tmp_path):
    # A job dir with spaces and shell syntax, and a program argument that would run a command if unquoted.
    job_dir = tmp_path / "dir with space;$(touch pwned1)"
    job_dir.mkdir()
    record = tmp_path / "argv.json"
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    # srun stand-in: drops its own options, then runs the rest.
    (fake_bin / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (fake_bin / "srun").chmod(0o755)
    recorder = f"import json, sys; json.dump(sys.argv[1:], open({str(record)!r}, 'w'))"
    art = JobArtifact(job_id="j", name="t", job_dir=job_dir, program=["-c", recorder, "$(touch pwned2)", "`touch pwned3`", "a b;c"],
                      resources=JobResources(), nodes=1, gpus_per_node=1, python=sys.executable)
    script = batch_script(art)
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env={**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"},
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(record.read_text()) == ["$(touch pwned2)", "`touch pwned3`", "a b;c"]
    assert not list(tmp_path.rglob("pwned*"))


def test_the_v0_0_38_request_has_the_verified_shapes(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("SLURM_JWT", "secret-token")
    body = SlurmRestBackend("http://x", token="t").job_request(artifact(tmp_path, nodes=2, gpus_per_node=8, slurm_partition="debug"))
    job = body["job"]
    # reference/mcp-and-launch.md 5.4: environment a required object, nodes an int, gpus_per_node a string,
    # tasks = nodes * tasks_per_node (else the job stays PENDING).
    assert job["environment"]["PATH"] == "/usr/bin:/bin" and isinstance(job["environment"], dict)
    assert "SLURM_JWT" not in job["environment"]
    assert (job["nodes"], job["tasks"], job["tasks_per_node"], job["gpus_per_node"]) == (2, 2, 1, "8")
    assert job["partition"] == "debug" and job["time_limit"] == 30
    assert body["script"].startswith("#!/bin/bash")
    newer = SlurmRestBackend("http://x", token="t").job_request(artifact(tmp_path), "v0.0.40")["job"]
    assert isinstance(newer["environment"], list) and newer["time_limit"] == {"set": True, "infinite": False, "number": 30}


def _mock_rest(handler) -> SlurmRestBackend:
    return SlurmRestBackend("http://slurm.test:6820", user="alice", token="s3cret", transport=httpx.MockTransport(handler))


def test_the_api_version_is_discovered_and_v0_0_38_preferred():
    def handler(req: httpx.Request) -> httpx.Response:
        assert req.headers["X-SLURM-USER-NAME"] == "alice" and req.headers["X-SLURM-USER-TOKEN"] == "s3cret"
        return httpx.Response(200, json={"paths": {f"/slurm/{v}/ping": {} for v in ("v0.0.36", "v0.0.37", "v0.0.38")}})
    assert _mock_rest(handler).version() == "v0.0.38"


def test_a_rejected_token_is_reported_without_leaking_it():
    # Slurm 22.05 answers a forged/expired JWT with HTTP 500 and this error (reference 5.4, verified there).
    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(500, json={"errors": [{"description": "slurmctld config is unable to load", "source": "slurm_load_ctl_conf"}]})
    with pytest.raises(BackendError, match="rejected the credentials of user 'alice'") as err:
        _mock_rest(handler).version()
    assert "s3cret" not in str(err.value)


def test_an_unreachable_slurmrestd_is_a_backend_error_naming_the_url():
    def handler(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")
    with pytest.raises(BackendError, match="cannot reach slurmrestd at http://slurm.test:6820"):
        _mock_rest(handler).version()


def test_a_job_slurm_has_forgotten_is_decided_by_its_directory(tmp_path):
    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/openapi/v3":
            return httpx.Response(200, json={"paths": {"/slurm/v0.0.38/ping": {}}})
        return httpx.Response(500, json={"jobs": [], "errors": [{"description": "Invalid job id specified", "error_number": 2017}]})
    backend = _mock_rest(handler)
    ref = JobRef(backend="slurm_rest", native_id="77", data={"job_dir": str(tmp_path)})
    st = backend.status({"k": ref})["k"]
    assert st.state == "FAILED" and st.lost and "Slurm job 77 is no longer known" in st.reason
    (tmp_path / "result.json").write_text('{"status": "ok"}')
    assert backend.status({"k": ref})["k"].state == "COMPLETED"


# ---- a real Slurm (scripts/slurm/up.sh) ------------------------------------------------------


def _slurm_env() -> dict[str, str] | None:
    env = dict(os.environ)
    if "SLURM_CONF" not in env:
        env_sh = Path(env.get("SLURM_RUN_DIR", "/tmp/mcore-advisor-slurm")) / "env.sh"
        if not env_sh.is_file():
            return None
        for line in env_sh.read_text().splitlines():
            if line.startswith("export ") and "=" in line:
                key, value = line[len("export "):].split("=", 1)
                env[key.strip()] = value.strip()
    if not shutil.which("sinfo"):
        return None
    try:
        ok = subprocess.run(["sinfo", "-h"], env=env, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return env if ok else None


SLURM_ENV = _slurm_env()
needs_slurm = pytest.mark.skipif(SLURM_ENV is None, reason="no local Slurm: run scripts/slurm/up.sh (as root) first")

FAKE_ENTRY = r'''
import json, os, sys, time
mode = sys.argv[1]
out = sys.argv[sys.argv.index("--out-dir") + 1]
if mode == "ok":
    json.dump({"status": "ok", "iter_s": 1.0, "tokens_per_s_per_gpu": 10.0}, open(os.path.join(out, "result.json"), "w"))
elif mode == "fail":
    json.dump({"status": "failed", "error_type": "RuntimeError", "message": "boom", "rank": 0}, open(os.path.join(out, "error.json"), "w"))
    sys.exit(3)
else:
    time.sleep(120)
'''


@pytest.fixture
def slurm_manager(tmp_path, monkeypatch):
    for key, value in (SLURM_ENV or {}).items():
        if key.startswith("SLURM"):
            monkeypatch.setenv(key, value)
    fake = tmp_path / "fake_entry.py"
    fake.write_text(FAKE_ENTRY)

    def make(mode: str) -> JobManager:
        return JobManager(JobStore(tmp_path / "state" / "jobs.sqlite3"), entry=[str(fake), mode])
    return make


def tiny_plan() -> Plan:
    return Plan(model=ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256),
                cluster=ClusterSpec(num_gpus=1), training=TrainingSpec(seq_length=32, global_batch_size=2, micro_batch_size=1))


def wait_for(mgr: JobManager, job_id: str, states: set[str], timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        st = mgr.get(job_id)
        if st.state in states or time.monotonic() > deadline:
            return st
        time.sleep(0.25)


@pytest.mark.slurm
@needs_slurm
@pytest.mark.parametrize("backend", ["slurm", "slurm_rest"])
def test_a_job_submitted_to_slurm_completes_and_a_failing_one_fails(slurm_manager, backend):
    mgr = slurm_manager("ok")
    sub = mgr.submit(ProfileJobRequest(plan=tiny_plan(), backend=backend))
    assert sub.backend_job_id and sub.backend_job_id.isdigit()
    st = wait_for(mgr, sub.job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    assert st.state == "COMPLETED", (st.error, st.stderr_tail)
    assert st.result["tokens_per_s_per_gpu"] == 10.0

    bad = slurm_manager("fail").submit(ProfileJobRequest(plan=tiny_plan(), backend=backend))
    st = wait_for(mgr, bad.job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    assert st.state == "FAILED" and st.error.startswith("RuntimeError on rank 0: boom")


@pytest.mark.slurm
@needs_slurm
@pytest.mark.parametrize("backend", ["slurm", "slurm_rest"])
def test_cancelling_a_running_slurm_job_ends_it_cancelled_in_slurm_too(slurm_manager, backend):
    mgr = slurm_manager("sleep")
    sub = mgr.submit(ProfileJobRequest(plan=tiny_plan(), backend=backend))
    assert wait_for(mgr, sub.job_id, {"RUNNING"}).state == "RUNNING"
    assert mgr.cancel(sub.job_id).state == "CANCELLED"
    deadline = time.monotonic() + 20
    while True:
        native = subprocess.run(["squeue", "-h", "--states=all", "-j", sub.backend_job_id, "-o", "%T"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        if native == "CANCELLED" or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert native == "CANCELLED"


@pytest.mark.slurm
@pytest.mark.slow
@needs_slurm
@pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("megatron.core") is None,
                    reason="needs torch + megatron-core on the Slurm nodes (the job extra)")
def test_the_real_entry_through_slurm_and_the_rendered_script_completes(tmp_path, monkeypatch):
    for key, value in (SLURM_ENV or {}).items():
        if key.startswith("SLURM"):
            monkeypatch.setenv(key, value)
    mgr = JobManager(JobStore(tmp_path / "jobs.sqlite3"))
    sub = mgr.submit(ProfileJobRequest(plan=tiny_plan(), backend="slurm", warmup_steps=1, measure_steps=2, profile_steps=None))
    assert "render_launch_script" in sub.script  # the render tool's profile-target script, not the fallback
    st = wait_for(mgr, sub.job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout_s=300)
    assert st.state == "COMPLETED", (st.error, st.stderr_tail)
    assert st.result["tokens_per_s_per_gpu"] > 0 and st.comparison_note


def test_a_unix_socket_url_sends_no_token_headers_and_bad_urls_are_refused():
    seen = {}

    def handler(req: httpx.Request) -> httpx.Response:
        seen.update(req.headers)
        return httpx.Response(200, json={"paths": {"/slurm/v0.0.38/ping": {}}})
    backend = SlurmRestBackend("unix:///run/slurmrestd.sock", transport=httpx.MockTransport(handler))
    assert backend.unix_socket == "/run/slurmrestd.sock"
    assert backend.version() == "v0.0.38"
    assert "x-slurm-user-token" not in seen and "x-slurm-user-name" not in seen
    with pytest.raises(ValueError, match="SLURM_REST_URL"):
        SlurmRestBackend("ftp://host")
