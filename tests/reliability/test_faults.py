"""Faults of the job system, each ending in a stated job state with nothing lost.

Real faults wherever this machine allows them: processes killed with SIGKILL, a server process
killed and restarted, SQLite locked by a second connection or overwritten with garbage, a job
directory on a full or read-only tmpfs (root only), a Slurm controller that does not answer
(stand-in Slurm tools, or the local Slurm when it is up). The Slurm CLI and REST outage cases use
stand-ins because stopping a shared controller is not ours to do outside the `slurm` tests.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import httpx
import httpx2
import pytest
from _rel_common import fake_entry, serve_http, stop, wait_http
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from mcore_advisor.launcher.backends import supervisor as sv
from mcore_advisor.launcher.backends.base import BackendError, BackendUnavailable, JobRef
from mcore_advisor.launcher.backends.slurm_cli import SlurmCliBackend
from mcore_advisor.launcher.backends.slurm_rest import SlurmRestBackend
from mcore_advisor.launcher.jobs import JobManager, ProfileJobRequest
from mcore_advisor.launcher.store import JobStore, StoreError, record_from
from mcore_advisor.schemas import Plan

TINY = {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 256},
        "cluster": {"num_gpus": 1}, "training": {"seq_length": 64, "global_batch_size": 4, "micro_batch_size": 2},
        "parallelism": {}, "implementation": {"transformer_impl": "local"}}


@pytest.fixture(autouse=True)
def _no_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # local jobs take the CPU path on any machine


def _manager(state: Path, tmp: Path, mode: str, **kw) -> JobManager:
    return JobManager(JobStore(state / "jobs.sqlite3", **kw), entry=fake_entry(tmp, mode))


def _request(**kw) -> ProfileJobRequest:
    return ProfileJobRequest(plan=Plan.model_validate(TINY), **kw)


def _wait(mgr: JobManager, job_id: str, states: set[str], timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        st = mgr.get(job_id)
        if st.state in states or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def _job_pid(job_dir: Path, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return json.loads((job_dir / sv.JOB_FILE).read_text())["pid"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.02)
    raise AssertionError("the supervisor never recorded the job's process")


def _alive(pid: int) -> bool:
    st = sv.proc_stat(pid)
    return st is not None and st["state"] not in ("Z", "X")


# ---- processes --------------------------------------------------------------------------------------


def test_a_server_killed_with_sigkill_mid_job_is_restarted_and_the_job_finishes(record_property, tmp_path):
    state = tmp_path / "state"
    entry = fake_entry(tmp_path, "slow")

    async def submit(url: str) -> str:
        async with httpx2.AsyncClient(timeout=60) as http, Client(streamable_http_client(url, http_client=http)) as c:
            res = await c.call_tool("run_profile_job", {"plan": TINY})
            assert not res.is_error, res.content
            return res.structured_content["job_id"]

    async def poll(url: str, job_id: str) -> dict:
        async with httpx2.AsyncClient(timeout=60) as http, Client(streamable_http_client(url, http_client=http)) as c:
            for _ in range(600):
                st = (await c.call_tool("get_job", {"job_id": job_id})).structured_content
                if st["state"] not in ("PENDING", "RUNNING"):
                    return st
                await anyio.sleep(0.1)
        raise AssertionError("the job never ended")

    proc, url = serve_http(state, entry=entry)
    try:
        wait_http(url, proc)
        job_id = anyio.run(submit, url)
        job_pid = _job_pid(state / "jobs" / job_id)
        os.killpg(proc.pid, signal.SIGKILL)  # the server and nothing else: the job has its own session
        proc.wait(timeout=10)
        survived = _alive(job_pid)
        assert survived
    finally:
        stop(proc)
    proc, url = serve_http(state, entry=entry)
    try:
        wait_http(url, proc)
        st = anyio.run(poll, url, job_id)
    finally:
        stop(proc)
    record_property("outcome", f"job {st['state']} after the server was killed (SIGKILL) and restarted; the job's "
                               f"process survived the kill: {survived}")
    assert st["state"] == "COMPLETED", st


def test_a_job_killed_with_sigkill_fails_with_the_signal_and_its_log_tail(record_property, tmp_path):
    mgr = _manager(tmp_path / "state", tmp_path, "hang")
    sub = mgr.submit(_request())
    job_dir = Path(sub.job_dir)
    pid = _job_pid(job_dir)
    deadline = time.monotonic() + 10
    log = job_dir / "train.log"
    while not (log.exists() and "iteration        2/" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    st = _wait(mgr, sub.job_id, {"FAILED"})
    record_property("outcome", f"job {st.state}: {st.error}; log tail kept ({len(st.log_tail.splitlines())} lines)")
    assert (st.state, st.exit_code, st.error) == ("FAILED", -signal.SIGKILL, "killed by SIGKILL")
    assert "iteration        2/" in st.log_tail


def test_after_kill_9_of_the_supervisor_the_job_is_running_and_cancel_stops_it(record_property, tmp_path):
    mgr = _manager(tmp_path / "state", tmp_path, "hang")
    sub = mgr.submit(_request())
    pid = _job_pid(Path(sub.job_dir))
    os.kill(int(sub.backend_job_id), signal.SIGKILL)
    time.sleep(0.2)
    st = mgr.get(sub.job_id)
    assert st.state == "RUNNING" and _alive(pid)  # not FAILED while the training process still runs
    st = mgr.cancel(sub.job_id)
    assert st.state == "CANCELLED"
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
    record_property("outcome", "job RUNNING after kill -9 of its supervisor (training process alive), "
                               f"then {st.state} by cancel_job; the training process is gone")


def test_cancel_of_a_finished_or_unknown_job(record_property, tmp_path):
    mgr = _manager(tmp_path / "state", tmp_path, "ok")
    sub = mgr.submit(_request())
    done = _wait(mgr, sub.job_id, {"COMPLETED"})
    assert done.state == "COMPLETED"
    again = mgr.cancel(sub.job_id)
    assert (again.state, again.ended_at, again.result) == ("COMPLETED", done.ended_at, done.result)
    with pytest.raises(KeyError, match="job_id: no job 'feedfeedfeed' in this store"):
        mgr.cancel("feedfeedfeed")
    with pytest.raises(KeyError) as info:
        mgr.cancel("x" * 100_000)
    assert len(str(info.value)) < 200  # a hostile id is not echoed back whole
    record_property("outcome", f"finished job stays {again.state}; an unknown id is KeyError 'job_id: no job ...'")


def test_two_servers_sharing_one_store_lose_nothing(record_property, tmp_path):
    state = tmp_path / "state"
    entry = fake_entry(tmp_path, "ok")
    other = textwrap.dedent(f"""
        import time
        from mcore_advisor.launcher.jobs import JobManager, ProfileJobRequest
        from mcore_advisor.launcher.store import JobStore
        from mcore_advisor.schemas import Plan
        mgr = JobManager(JobStore({str(state / "jobs.sqlite3")!r}), entry={entry!r})
        ids = [mgr.submit(ProfileJobRequest(plan=Plan.model_validate({TINY!r}))).job_id for _ in range(3)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(mgr.get(i).state in ("PENDING", "RUNNING") for i in ids):
            mgr.list()
            time.sleep(0.02)
        print(" ".join(ids))
    """)
    proc = subprocess.Popen([sys.executable, "-c", other], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    mgr = JobManager(JobStore(state / "jobs.sqlite3"), entry=entry)
    mine = [mgr.submit(_request()).job_id for _ in range(3)]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(mgr.get(i).state in ("PENDING", "RUNNING") for i in mine):
        mgr.list()  # both servers poll every job: the same transitions race
        time.sleep(0.02)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    theirs = out.split()
    jobs = {j.job_id: j for j in mgr.list(limit=100).jobs}
    assert set(jobs) == set(mine) | set(theirs) and len(jobs) == 6
    assert {j.state for j in jobs.values()} == {"COMPLETED"}
    assert all(mgr.get(i).result["tokens_per_s_per_gpu"] == 100.0 for i in jobs)
    record_property("outcome", f"{len(jobs)} of 6 jobs from 2 processes on one store, all {jobs[mine[0]].state} with results")


# ---- the SQLite store --------------------------------------------------------------------------------


def _record(job_id: str, tmp: Path):
    return record_from(job_id=job_id, name="n", backend="local", job_dir=tmp / job_id, command=["x"], plan={}, spec={},
                       resources={})


def test_a_store_locked_by_another_writer_answers_within_the_busy_timeout_and_loses_nothing(record_property, tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3", busy_timeout_s=0.5)
    store.insert(_record("a1", tmp_path))
    holder = sqlite3.connect(store.path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process's open write transaction
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError) as info:
            store.insert(_record("a2", tmp_path))
        assert time.monotonic() - t0 < 3.0
        msg = str(info.value)
        assert f"job store {store.path} is locked" in msg and "end that process's transaction" in msg
        assert store.get("a1").job_id == "a1"  # WAL: reads go on while the writer holds the lock
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    store.insert(_record("a2", tmp_path))  # released: the same write succeeds
    assert [r.job_id for r in store.list()] == ["a2", "a1"]
    assert sqlite3.connect(store.path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    record_property("outcome", f"StoreError in {time.monotonic() - t0:.1f} s ('is locked ...'); reads went on; "
                               "the write succeeded once the lock was released; nothing lost")


def test_a_corrupt_store_is_reported_with_the_file_and_what_to_do_and_is_left_untouched(record_property, tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    store.insert(_record("c1", tmp_path))
    sqlite3.connect(store.path).execute("PRAGMA wal_checkpoint(TRUNCATE)").close()
    data = bytearray(store.path.read_bytes())
    data[:16] = b"not a database!!"
    store.path.write_bytes(bytes(data))
    for call in (lambda: store.get("c1"), lambda: store.insert(_record("c2", tmp_path)), lambda: JobStore(store.path)):
        with pytest.raises(StoreError) as info:
            call()
        msg = str(info.value)
        assert f"job store {store.path} is corrupt" in msg and f"mv {store.path} {store.path}.corrupt" in msg
    assert store.path.read_bytes() == bytes(data)  # nothing recreated or overwritten
    record_property("outcome", "StoreError 'is corrupt ... Move it aside (mv ...)' on read, write and open; file untouched")


def test_a_row_no_version_wrote_is_reported_as_corrupt_not_as_an_internal_error(record_property, tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    store.insert(_record("r1", tmp_path))
    with sqlite3.connect(store.path) as conn:
        conn.execute("UPDATE jobs SET plan = '{not json' WHERE job_id = 'r1'")
    with pytest.raises(StoreError, match=r"is corrupt \(job 'r1' cannot be read"):
        store.get("r1")
    record_property("outcome", "StoreError 'is corrupt (job ... cannot be read)', not an internal error")


# ---- full and read-only disks (a small tmpfs: root only) --------------------------------------------------


@pytest.fixture
def small_fs(tmp_path):
    """A 256 KiB tmpfs at tmp_path/fs; yields (mountpoint, remount(options))."""
    mp = tmp_path / "fs"
    mp.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a tmpfs")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mp)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs is not permitted here")

    def remount(opts: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{opts}", str(mp)], check=True, capture_output=True)

    try:
        yield mp, remount
    finally:
        subprocess.run(["umount", "-l", str(mp)], capture_output=True)


def _fill(path: Path) -> None:
    with open(path, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError:
            pass


def test_a_full_job_directory_disk_refuses_the_job_and_leaves_no_row(record_property, tmp_path, small_fs):
    mp, _ = small_fs
    mgr = JobManager(JobStore(tmp_path / "state" / "jobs.sqlite3"), entry=fake_entry(tmp_path, "ok"), job_root=mp / "jobs")
    (mp / "jobs").mkdir()
    _fill(mp / "filler")
    with pytest.raises(BackendError) as info:
        mgr.submit(_request())
    msg = str(info.value)
    assert f"cannot write the job directory {mp / 'jobs'}" in msg and "No space left on device" in msg
    assert "no job was created" in msg
    assert mgr.list().jobs == [] and list((mp / "jobs").iterdir()) == []
    record_property("outcome", "submit refused ('No space left on device ... no job was created'); no row, no directory")


def test_a_read_only_job_directory_refuses_the_job_and_leaves_no_row(record_property, tmp_path, small_fs):
    mp, remount = small_fs
    (mp / "jobs").mkdir()
    remount("ro")
    mgr = JobManager(JobStore(tmp_path / "state" / "jobs.sqlite3"), entry=fake_entry(tmp_path, "ok"), job_root=mp / "jobs")
    with pytest.raises(BackendError, match=r"Read-only file system\): check its permissions and that the file system is not mounted read-only"):
        mgr.submit(_request())
    assert mgr.list().jobs == []
    record_property("outcome", "submit refused ('Read-only file system ... mounted read-only'); no row")


def test_a_full_or_read_only_store_says_so_and_keeps_what_it_had(record_property, tmp_path, small_fs):
    mp, remount = small_fs
    store = JobStore(mp / "jobs.sqlite3")
    store.insert(_record("f1", tmp_path))
    _fill(mp / "filler")
    with pytest.raises(StoreError, match=r"the disk is full .*nothing was written"):
        for i in range(200):  # until the WAL cannot grow
            store.insert(_record(f"f{i + 2}" + "x" * 4000, tmp_path))
    (mp / "filler").unlink()
    assert store.get("f1").job_id == "f1"
    remount("ro")
    with pytest.raises(StoreError, match=r"cannot be written .*mounted read-only"):
        store.insert(_record("f999", tmp_path))
    record_property("outcome", "StoreError 'the disk is full ... nothing was written', then 'cannot be written ... "
                               "read-only'; the rows written before stay readable")


# ---- Slurm that does not answer ---------------------------------------------------------------------------


SLOW_TOOL = """#!/bin/bash
echo "$(basename "$0") $*" >> "{log}"
case "$(basename "$0")" in
  sbatch) echo 77 ;;
  squeue) {squeue} ;;
  scancel) {scancel} ;;
  sacct) exit 1 ;;
esac
"""


def _stand_in_slurm(tmp: Path, squeue: str, scancel: str = "exit 0") -> tuple[Path, Path]:
    bin_dir, log = tmp / "slurm-bin", tmp / "slurm-calls.log"
    bin_dir.mkdir()
    for tool in ("sbatch", "squeue", "scancel", "sacct"):
        p = bin_dir / tool
        p.write_text(SLOW_TOOL.format(log=log, squeue=squeue, scancel=scancel))
        p.chmod(0o755)
    return bin_dir, log


@pytest.mark.parametrize("squeue, why", [
    ('echo "squeue: error: Unable to contact slurm controller (connect failure)" >&2; exit 1', "Unable to contact slurm controller"),
    ("sleep 5", "did not answer within 0.3 s"),
])
def test_a_slurm_controller_down_or_slow_makes_the_state_unknown_not_failed_after_bounded_retries(record_property, tmp_path, squeue, why):
    bin_dir, log = _stand_in_slurm(tmp_path, squeue)
    backend = SlurmCliBackend(bin_dir=str(bin_dir), timeout_s=0.3, attempts=3, retry_wait_s=0.05)
    mgr = JobManager(JobStore(tmp_path / "jobs.sqlite3"), entry=fake_entry(tmp_path, "ok"), backends={"slurm": backend})
    sub = mgr.submit(_request(backend="slurm"))
    t0 = time.monotonic()
    st = mgr.get(sub.job_id)
    took = time.monotonic() - t0
    assert (st.state, st.last_known_state) == ("UNKNOWN", "PENDING")
    assert why in st.error and "tried 3 times" in st.error and "may still be running" in st.error
    assert took < 3 * 0.3 + 0.05 + 0.1 + 2.0  # three attempts and two waits, not the 60 s of a hung call
    assert open(log).read().count("squeue") == 3
    assert mgr.store.get(sub.job_id).state == "PENDING"  # nothing stored: the outage is not the job's failure
    assert [j.state for j in mgr.list().jobs] == ["UNKNOWN"]
    record_property("outcome", f"job UNKNOWN (stored state {mgr.store.get(sub.job_id).state} kept) after 3 attempts in {took:.1f} s")


def test_cancel_while_the_slurm_controller_is_down_says_so_and_keeps_the_state(record_property, tmp_path):
    down = 'echo "error: Unable to contact slurm controller (connect failure)" >&2; exit 1'
    bin_dir, _ = _stand_in_slurm(tmp_path, 'echo "77|PENDING|None|N/A|N/A"', scancel=down)
    backend = SlurmCliBackend(bin_dir=str(bin_dir), timeout_s=1, attempts=2, retry_wait_s=0.05)
    mgr = JobManager(JobStore(tmp_path / "jobs.sqlite3"), entry=fake_entry(tmp_path, "ok"), backends={"slurm": backend})
    sub = mgr.submit(_request(backend="slurm"))
    with pytest.raises(BackendUnavailable, match="scancel: .*Unable to contact slurm controller.*tried 2 times"):
        mgr.cancel(sub.job_id)
    assert mgr.store.get(sub.job_id).state == "PENDING"
    record_property("outcome", "cancel_job answers BackendUnavailable ('Unable to contact slurm controller ... tried 2 "
                               "times'); the job stays PENDING")


@pytest.mark.parametrize("fault", ["connect", "timeout", "controller"])
def test_slurmrestd_down_slow_or_without_its_controller_makes_the_state_unknown(record_property, tmp_path, fault):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path.startswith("/openapi"):
            return httpx.Response(200, json={"paths": {"/slurm/v0.0.38/job/{job_id}": {}}})
        if fault == "connect":
            raise httpx.ConnectError("connection refused", request=request)
        if fault == "timeout":
            raise httpx.ReadTimeout("timed out", request=request)
        # 22.05 with slurmctld stopped: HTTP 500, error_number -1, the words of a purged job (verified locally)
        return httpx.Response(500, json={"errors": [{"description": "Unable to find JobId=5", "error_number": -1,
                                                     "error": "Unspecified error", "source": "slurm_load_job"}], "jobs": []})

    rest = SlurmRestBackend("http://slurm.example:6820", token="t", transport=httpx.MockTransport(handler), attempts=3,
                            retry_wait_s=0.01)
    ref = JobRef(backend="slurm_rest", native_id="5", data={"job_dir": str(tmp_path)})
    with pytest.raises(BackendUnavailable, match="tried 3 times"):
        rest.status({"k": ref})
    assert calls.count("/slurm/v0.0.38/job/5") == 3
    record_property("outcome", "BackendUnavailable after 3 attempts -> the job is reported UNKNOWN, never FAILED")


def test_a_purged_slurmrestd_job_is_decided_by_its_directory_not_retried(record_property, tmp_path):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/openapi"):
            return httpx.Response(200, json={"paths": {"/slurm/v0.0.38/job/{job_id}": {}}})
        if request.url.path.startswith("/slurmdb"):
            return httpx.Response(404, json={})
        return httpx.Response(500, json={"errors": [{"description": "Unable to find JobId=6", "error_number": 2017,
                                                     "error": "Invalid job id specified"}], "jobs": []})

    (tmp_path / "result.json").write_text('{"status": "ok"}')
    rest = SlurmRestBackend("http://slurm.example:6820", token="t", transport=httpx.MockTransport(handler))
    st = rest.status({"k": JobRef(backend="slurm_rest", native_id="6", data={"job_dir": str(tmp_path)})})["k"]
    assert st.state == "COMPLETED"
    record_property("outcome", f"a job slurmctld no longer knows (error 2017) is {st.state} from its result.json, not retried")


@pytest.mark.slurm
@pytest.mark.skipif(not os.environ.get("SLURM_RUN_DIR"), reason="needs the local Slurm (scripts/slurm/up.sh)")
@pytest.mark.parametrize("backend", ["slurm", "slurm_rest"])
def test_a_stopped_slurmctld_makes_a_running_job_unknown_and_it_completes_once_it_is_back(record_property, tmp_path, backend):
    """The real controller, paused with SIGSTOP (the state it keeps survives; SIGCONT resumes it)."""
    pid = int((Path(os.environ["SLURM_RUN_DIR"]) / "run" / "slurmctld.daemon.pid").read_text())
    jobs_dir = Path(os.environ["SLURM_RUN_DIR"]) / "jobs" / f"fault-{os.getpid()}-{backend}"
    backends = {"slurm": SlurmCliBackend(timeout_s=2, attempts=2, retry_wait_s=0.1),
                "slurm_rest": SlurmRestBackend(os.environ.get("SLURM_REST_URL", "http://127.0.0.1:6820"),
                                               user=os.environ.get("SLURM_REST_USER"), token=os.environ.get("SLURM_JWT"),
                                               timeout_s=2, attempts=2, retry_wait_s=0.1)}
    mgr = JobManager(JobStore(tmp_path / "jobs.sqlite3"), entry=fake_entry(tmp_path, "slow"), job_root=jobs_dir,
                     backends=backends)
    sub = mgr.submit(_request(backend=backend))
    assert _wait(mgr, sub.job_id, {"RUNNING", "COMPLETED"}, 60).state in ("RUNNING", "COMPLETED")
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        st = mgr.get(sub.job_id)
        assert st.state == "UNKNOWN" and "tried 2 times" in st.error, st
        assert time.monotonic() - t0 < 10
    finally:
        os.kill(pid, signal.SIGCONT)
    final = _wait(mgr, sub.job_id, {"COMPLETED", "FAILED"}, 120).state
    record_property("outcome", f"job UNKNOWN while slurmctld was stopped, then {final} once it resumed")
    assert final == "COMPLETED"
