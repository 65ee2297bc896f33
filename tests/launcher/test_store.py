"""SQLite job store: round trip, restart, schema version, transactions that survive a crash."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mcore_advisor.launcher import store as store_mod
from mcore_advisor.launcher.store import SCHEMA_VERSION, JobStore, new_job_id, record_from


def _record(job_id: str, *, created_at: float, state: str = "PENDING"):
    return record_from(
        job_id=job_id,
        name=f"profile-{job_id}",
        backend="local",
        job_dir=Path("/tmp/jobs") / job_id,
        command=["python", "-m", "x", "--spec", "spec.json"],
        plan={"model": {"name": "llama3-8b"}, "cluster": {"num_gpus": 8}},
        spec={"spec_version": 1, "run": {"seed": 1}},
        resources={"nodes": 1, "gpus_per_node": 8, "time_limit_min": 30.0},
        paths={"result": f"/tmp/jobs/{job_id}/result.json"},
        predicted={"tokens_per_s_per_gpu": 1234.5},
        state=state,
        created_at=created_at,
    )


def test_a_stored_job_reads_back_identical_including_json_columns(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    rec = _record("abc123def456", created_at=1000.0)
    store.insert(rec)
    assert store.get("abc123def456") == rec


def test_a_new_store_object_on_the_same_file_sees_every_job_and_update(tmp_path):
    path = tmp_path / "state" / "jobs.sqlite3"
    first = JobStore(path)
    for i in range(3):
        first.insert(_record(f"job{i}", created_at=1000.0 + i))
    first.update("job1", state="RUNNING", started_at=1010.0, backend_ref={"backend": "local", "native_id": "42", "data": {"pid": 42}})
    first.update("job2", state="COMPLETED", ended_at=1100.0, result={"status": "ok", "iter_s": 1.5})

    second = JobStore(path)
    assert [r.job_id for r in second.list()] == ["job2", "job1", "job0"]  # newest first
    assert second.get("job1").backend_ref == {"backend": "local", "native_id": "42", "data": {"pid": 42}}
    assert second.get("job2").result == {"status": "ok", "iter_s": 1.5}
    assert second.get("job2").state == "COMPLETED"


def test_list_filters_by_state_and_honours_the_limit(tmp_path):
    store = JobStore(tmp_path / "db.sqlite3")
    for i in range(5):
        store.insert(_record(f"j{i}", created_at=float(i), state="RUNNING" if i % 2 else "PENDING"))
    assert [r.job_id for r in store.list(state="RUNNING")] == ["j3", "j1"]
    assert [r.job_id for r in store.list(limit=2)] == ["j4", "j3"]
    assert {r.job_id for r in store.list(states=["PENDING", "RUNNING"])} == {f"j{i}" for i in range(5)}
    with pytest.raises(ValueError, match="state: unknown job state 'DONE'"):
        store.list(state="DONE")


def test_unknown_job_id_raises_key_error_naming_it(tmp_path):
    store = JobStore(tmp_path / "db.sqlite3")
    with pytest.raises(KeyError, match="job_id: no job 'nope' in this store"):
        store.get("nope")
    with pytest.raises(KeyError, match="job_id: no job 'nope' in this store"):
        store.update("nope", state="FAILED")


def test_a_duplicate_id_is_refused_and_the_first_row_is_kept(tmp_path):
    store = JobStore(tmp_path / "db.sqlite3")
    store.insert(_record("same", created_at=1.0))
    with pytest.raises(ValueError, match="already exists"):
        store.insert(_record("same", created_at=2.0))
    assert store.get("same").created_at == 1.0


def test_a_terminal_state_is_never_overwritten_by_a_late_transition(tmp_path):
    store = JobStore(tmp_path / "db.sqlite3")
    store.insert(_record("j", created_at=1.0))
    running = store.transition("j", "RUNNING")
    assert running.state == "RUNNING" and running.started_at is not None
    done = store.transition("j", "COMPLETED", result={"status": "ok"})
    assert done.ended_at is not None
    late = store.transition("j", "FAILED", error="late poll")
    assert late.state == "COMPLETED" and late.error is None


def test_schema_version_is_recorded_and_a_newer_file_is_refused(tmp_path):
    path = tmp_path / "db.sqlite3"
    JobStore(path)
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    with pytest.raises(RuntimeError, match="newer than this mcore-advisor"):
        JobStore(path)


def test_a_process_dying_mid_transaction_leaves_the_last_committed_row(tmp_path):
    path = tmp_path / "db.sqlite3"
    store = JobStore(path)
    store.insert(_record("j", created_at=1.0))
    store.update("j", state="RUNNING")
    # The child changes the row inside a transaction, then dies without committing (a crash).
    code = textwrap.dedent(f"""
        import os
        from mcore_advisor.launcher.store import JobStore
        s = JobStore({str(path)!r})
        with s._transaction() as conn:
            conn.execute("UPDATE jobs SET state = 'FAILED', error = 'half' WHERE job_id = 'j'")
            os._exit(9)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == 9, proc.stderr
    rec = JobStore(path).get("j")
    assert (rec.state, rec.error) == ("RUNNING", None)


def test_state_dir_comes_from_the_env_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("MCORE_ADVISOR_STATE_DIR", str(tmp_path / "explicit"))
    assert store_mod.default_state_dir() == tmp_path / "explicit"
    monkeypatch.delenv("MCORE_ADVISOR_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert store_mod.default_state_dir() == tmp_path / "xdg" / "mcore-advisor"
    # The XDG spec says a relative XDG_* path is invalid and must be ignored.
    monkeypatch.setenv("XDG_STATE_HOME", "relative/dir")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert store_mod.default_state_dir() == tmp_path / "home" / ".local" / "state" / "mcore-advisor"
    s = JobStore()
    assert s.path == (tmp_path / "home" / ".local" / "state" / "mcore-advisor" / "jobs.sqlite3").resolve()


def test_job_ids_are_short_and_distinct():
    ids = {new_job_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(i) == 12 and int(i, 16) >= 0 for i in ids)


@pytest.mark.parametrize("code, words", [
    ("SQLITE_BUSY", "is locked: another process has held its write lock for over 5 s"),
    ("SQLITE_CORRUPT", "is corrupt (boom); nothing was changed. Move it aside (mv /s/jobs.sqlite3 /s/jobs.sqlite3.corrupt"),
    ("SQLITE_NOTADB", "is corrupt"),
    ("SQLITE_FULL", "the disk is full (boom); nothing was written. Free space on the file system of /s"),
    ("SQLITE_READONLY", "cannot be written (boom): check the permissions of the file and of /s"),
    ("SQLITE_CANTOPEN", "set MCORE_ADVISOR_STATE_DIR to a writable directory"),
    ("SQLITE_IOERR_FSYNC", "disk I/O error (boom); check the disk"),
    ("SQLITE_MISMATCH", "SQLite error SQLITE_MISMATCH (boom)"),
])
def test_every_sqlite_failure_names_the_file_the_cause_and_the_remedy(code, words):
    msg = store_mod.describe_sqlite_error(Path("/s/jobs.sqlite3"), sqlite3.OperationalError("boom"), name=code)
    assert msg.startswith("job store /s/jobs.sqlite3")
    assert words in msg


def test_an_unwritable_state_dir_is_a_store_error_naming_it(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(store_mod.StoreError, match=r"cannot create its directory .*set MCORE_ADVISOR_STATE_DIR"):
        JobStore(tmp_path / "file" / "sub" / "jobs.sqlite3")


def test_a_hostile_job_id_is_quoted_short_in_errors(tmp_path):
    s = JobStore(tmp_path / "jobs.sqlite3")
    with pytest.raises(KeyError) as info:
        s.get("y" * 100_000)
    assert "(100,002 characters)" in str(info.value) and len(str(info.value)) < 200
