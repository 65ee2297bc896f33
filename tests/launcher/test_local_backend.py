"""Local backend with a fake entry point (a small python script, no torch): every way a job ends."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from mcore_advisor.launcher.backends import supervisor as sv
from mcore_advisor.launcher.backends.base import JobArtifact, JobRef, JobResources, read_outcome
from mcore_advisor.launcher.backends.local import LocalBackend, local_command, local_gpu_count

# Behaves like launcher/entry/profile.py as far as the launcher can tell: writes result.json or
# error.json into --out-dir and exits 0 or non-zero. MODE picks the behaviour.
FAKE_ENTRY = r'''
import json, os, signal, subprocess, sys, time
mode = sys.argv[1]
out = sys.argv[sys.argv.index("--out-dir") + 1]
def write(name, data):
    with open(os.path.join(out, name), "w") as fh:
        json.dump(data, fh)
if mode == "ok":
    print("iteration 1 ok", flush=True)
    write("result.json", {"status": "ok", "iter_s": 0.5, "tokens_per_s_per_gpu": 100.0, "peak_allocated_gib": [1.0, 2.0]})
elif mode == "wait":  # runs until the test creates <out>/go
    while not os.path.exists(os.path.join(out, "go")):
        time.sleep(0.01)
    write("result.json", {"status": "ok", "iter_s": 0.5})
elif mode == "fail":
    print("Traceback: boom", file=sys.stderr, flush=True)
    write("error.json", {"status": "failed", "error_type": "RuntimeError", "message": "boom", "rank": 0})
    sys.exit(3)
elif mode == "sleep":
    time.sleep(60)
elif mode == "stubborn":  # ignores SIGTERM and starts a worker in its own session, as torchrun does
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    w = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"],
                         start_new_session=True)
    write("pids.json", {"main": os.getpid(), "worker": w.pid})
    time.sleep(60)
elif mode == "silent":
    pass
'''


@pytest.fixture
def fake_entry(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fake") / "fake_entry.py"
    path.write_text(FAKE_ENTRY)
    return path


def _artifact(tmp_path: Path, fake_entry: Path, mode: str, *, time_limit_min: float = 5.0, job_id: str = "job1") -> JobArtifact:
    job_dir = tmp_path / job_id
    job_dir.mkdir()
    return JobArtifact(
        job_id=job_id, name="t", job_dir=job_dir,
        program=[str(fake_entry), mode, "--spec", str(job_dir / "spec.json"), "--out-dir", str(job_dir)],
        resources=JobResources(time_limit_min=time_limit_min), nodes=1, gpus_per_node=1, use_gpus=False,
    )


def _wait_state(backend: LocalBackend, ref: JobRef, want: str, timeout_s: float = 8.0):
    deadline = time.monotonic() + timeout_s
    while True:
        st = backend.status({"k": ref})["k"]
        if st.state == want or time.monotonic() > deadline:
            return st
        time.sleep(0.02)


def _gone(pid: int) -> bool:
    st = sv.proc_stat(pid)
    return st is None or st["state"] == "Z"


def test_a_job_is_running_until_its_command_ends_then_completed_with_its_result(tmp_path, fake_entry):
    backend = LocalBackend()
    art = _artifact(tmp_path, fake_entry, "wait")
    ref = backend.submit(art)
    assert ref.native_id == str(ref.data["pid"])
    assert backend.status({"k": ref})["k"].state == "RUNNING"
    (art.job_dir / "go").touch()
    st = _wait_state(backend, ref, "COMPLETED")
    assert (st.state, st.exit_code) == ("COMPLETED", 0)
    assert read_outcome(art.job_dir).result == {"status": "ok", "iter_s": 0.5}


def test_exit_3_with_error_json_is_failed_with_the_exit_code_and_the_error(tmp_path, fake_entry):
    backend = LocalBackend()
    art = _artifact(tmp_path, fake_entry, "fail")
    st = _wait_state(backend, backend.submit(art), "FAILED")
    assert (st.state, st.exit_code, st.reason) == ("FAILED", 3, "exited with code 3")
    assert read_outcome(art.job_dir).error == "RuntimeError on rank 0: boom"
    assert "Traceback: boom" in (art.job_dir / "stderr.log").read_text()


def test_the_wall_clock_limit_ends_the_job_as_timeout(tmp_path, fake_entry):
    backend = LocalBackend()
    art = _artifact(tmp_path, fake_entry, "sleep", time_limit_min=0.5 / 60)  # 0.5 s
    t0 = time.monotonic()
    st = _wait_state(backend, backend.submit(art), "TIMEOUT")
    assert st.state == "TIMEOUT"
    assert st.exit_code == -signal.SIGTERM
    assert time.monotonic() - t0 < 5.0


def test_cancel_stops_the_job_and_it_ends_cancelled(tmp_path, fake_entry):
    backend = LocalBackend()
    art = _artifact(tmp_path, fake_entry, "sleep")
    ref = backend.submit(art)
    assert backend.status({"k": ref})["k"].state == "RUNNING"
    backend.cancel(ref)
    st = _wait_state(backend, ref, "CANCELLED")
    assert st.state == "CANCELLED"
    assert _gone(ref.data["pid"])


def test_cancel_kills_a_command_ignoring_sigterm_and_its_workers_in_other_sessions(tmp_path, fake_entry):
    backend = LocalBackend(grace_s=0.3)
    art = _artifact(tmp_path, fake_entry, "stubborn")
    ref = backend.submit(art)
    deadline = time.monotonic() + 5
    while not (art.job_dir / "pids.json").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    pids = json.loads((art.job_dir / "pids.json").read_text())
    backend.cancel(ref)
    st = _wait_state(backend, ref, "CANCELLED")
    assert st.state == "CANCELLED"
    assert st.exit_code == -signal.SIGKILL
    deadline = time.monotonic() + 3
    while not (_gone(pids["main"]) and _gone(pids["worker"])) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _gone(pids["main"]) and _gone(pids["worker"])


def test_a_job_whose_supervisor_vanished_without_a_record_is_reported_lost(tmp_path, fake_entry):
    backend = LocalBackend()
    art = _artifact(tmp_path, fake_entry, "sleep")
    ref = backend.submit(art)
    os.killpg(ref.data["pgid"], signal.SIGKILL)
    st = _wait_state(backend, ref, "FAILED")
    assert st.lost
    assert st.reason.startswith(f"lost: process {ref.data['pid']} exited without result")


def test_a_reused_pid_with_another_start_time_is_not_mistaken_for_the_job(tmp_path):
    me = os.getpid()  # alive, but not the job: its start time differs
    ticks = sv.proc_stat(me)["start_ticks"]
    assert sv.is_running(me, ticks)
    assert not sv.is_running(me, ticks + 1)
    job_dir = tmp_path / "j"
    job_dir.mkdir()
    ref = JobRef(backend="local", native_id=str(me), data={"pid": me, "start_ticks": ticks + 1, "job_dir": str(job_dir), "job_id": "j"})
    assert LocalBackend().status({"k": ref})["k"].lost


def test_a_command_that_cannot_start_fails_with_the_reason(tmp_path):
    job_dir = tmp_path / "j"
    job_dir.mkdir()
    art = JobArtifact(job_id="j", name="t", job_dir=job_dir, program=["x"], resources=JobResources(),
                      nodes=1, gpus_per_node=1, use_gpus=False, python=str(tmp_path / "no-such-python"))
    backend = LocalBackend()
    st = _wait_state(backend, backend.submit(art), "FAILED")
    assert st.exit_code == 127 and "cannot start" in st.reason


def test_one_process_runs_python_directly_and_several_run_under_torchrun_standalone(tmp_path):
    one = JobArtifact(job_id="j", name="t", job_dir=tmp_path, program=["-m", "m", "--spec", "s"], resources=JobResources(),
                      nodes=1, gpus_per_node=1, python="/venv/bin/python")
    assert local_command(one) == ["/venv/bin/python", "-m", "m", "--spec", "s"]
    four = JobArtifact(job_id="j", name="t", job_dir=tmp_path, program=["-m", "m"], resources=JobResources(),
                       nodes=1, gpus_per_node=4, python="/venv/bin/python")
    assert local_command(four) == ["/venv/bin/python", "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                                   "--nproc_per_node", "4", "-m", "m"]


def test_more_nodes_or_gpus_than_this_host_has_are_rejected_naming_the_field(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert local_gpu_count() == 2
    backend = LocalBackend()
    base = dict(job_id="j", name="t", job_dir=tmp_path, program=["-m", "m"], resources=JobResources())
    with pytest.raises(ValueError, match=r"resources\.nodes"):
        backend.check(JobArtifact(**base, nodes=2, gpus_per_node=1))
    with pytest.raises(ValueError, match=r"cluster\.num_gpus: the job needs 4 GPUs but this host has 2"):
        backend.check(JobArtifact(**base, nodes=1, gpus_per_node=4))
    with pytest.raises(ValueError, match=r"resources\.slurm_partition"):
        backend.check(JobArtifact(**{**base, "resources": JobResources(slurm_partition="debug")}, nodes=1, gpus_per_node=1))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert local_gpu_count() == 0


def test_the_fake_entry_runs_under_this_interpreter():
    assert sys.executable  # the supervisor and the fake entry both use it


def _wait_file(path: Path, timeout_s: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.01)
    raise AssertionError(f"{path} never appeared")


def _kill_supervisor(ref: JobRef) -> None:
    os.kill(ref.data["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 3
    while not _gone(ref.data["pid"]) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_job_runs_in_its_own_process_group_recorded_in_job_json(tmp_path, fake_entry):
    backend = LocalBackend()
    art = _artifact(tmp_path, fake_entry, "wait")
    ref = backend.submit(art)
    job = _wait_file(art.job_dir / sv.JOB_FILE)
    st = sv.proc_stat(job["pid"])
    assert job["pgid"] == job["pid"] == st["pgrp"] == st["session"]  # a session and group of its own
    assert job["pgid"] != ref.data["pgid"]  # not the supervisor's
    (art.job_dir / "go").touch()
    assert _wait_state(backend, ref, "COMPLETED").state == "COMPLETED"


def test_after_kill_9_of_the_supervisor_the_job_keeps_running_and_its_end_is_still_seen(tmp_path, fake_entry):
    backend = LocalBackend()
    art = _artifact(tmp_path, fake_entry, "wait")
    ref = backend.submit(art)
    job = _wait_file(art.job_dir / sv.JOB_FILE)
    _kill_supervisor(ref)
    st = backend.status({"k": ref})["k"]
    assert (st.state, st.native_state) == ("RUNNING", "running (supervisor gone)")
    assert f"supervisor (pid {ref.data['pid']}) was killed" in st.reason and str(job["pid"]) in st.reason
    (art.job_dir / "go").touch()
    st = _wait_state(backend, ref, "FAILED")
    # No exit record: the backend says lost, and the job directory's result.json decides (jobs.py turns it COMPLETED).
    assert st.lost and read_outcome(art.job_dir).state == "COMPLETED"


def test_cancel_after_kill_9_of_the_supervisor_stops_the_job_and_its_workers(tmp_path, fake_entry):
    backend = LocalBackend(cancel_wait_s=0.3)
    art = _artifact(tmp_path, fake_entry, "stubborn")
    ref = backend.submit(art)
    pids = _wait_file(art.job_dir / "pids.json")
    _kill_supervisor(ref)
    assert backend.status({"k": ref})["k"].state == "RUNNING"
    assert not _gone(pids["main"]) and not _gone(pids["worker"])
    backend.cancel(ref)
    deadline = time.monotonic() + 3
    while not (_gone(pids["main"]) and _gone(pids["worker"])) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _gone(pids["main"]) and _gone(pids["worker"])  # SIGTERM ignored, SIGKILL after cancel_wait_s
    st = backend.status({"k": ref})["k"]
    assert (st.state, st.reason) == ("CANCELLED", "cancelled by request")


def test_the_time_limit_still_holds_after_kill_9_of_the_supervisor(tmp_path, fake_entry):
    backend = LocalBackend(cancel_wait_s=0.2)
    art = _artifact(tmp_path, fake_entry, "sleep", time_limit_min=1.0 / 60)  # 1 s
    ref = backend.submit(art)
    job = _wait_file(art.job_dir / sv.JOB_FILE)
    _kill_supervisor(ref)
    st = _wait_state(backend, ref, "TIMEOUT")
    assert st.state == "TIMEOUT" and "server stopped the job at its wall-clock limit" in st.reason
    assert _gone(job["pid"])


def test_a_job_process_killed_with_sigkill_fails_naming_the_signal(tmp_path, fake_entry):
    backend = LocalBackend()
    art = _artifact(tmp_path, fake_entry, "wait")
    ref = backend.submit(art)
    job = _wait_file(art.job_dir / sv.JOB_FILE)
    os.kill(job["pid"], signal.SIGKILL)
    st = _wait_state(backend, ref, "FAILED")
    assert (st.state, st.exit_code, st.reason) == ("FAILED", -signal.SIGKILL, "killed by SIGKILL")


def test_an_oversized_result_json_is_not_loaded_and_fails_the_job(tmp_path, monkeypatch):
    from mcore_advisor.launcher.backends import base

    monkeypatch.setattr(base, "MAX_RESULT_BYTES", 1000)
    (tmp_path / "result.json").write_text('{"status": "ok", "pad": "' + "x" * 2000 + '"}')
    out = read_outcome(tmp_path)
    assert out.state == "FAILED" and out.result is None
    assert out.error.startswith("result.json is larger than the 1,000 bytes mcore-advisor reads")
