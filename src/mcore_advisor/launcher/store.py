"""SQLite job store: one row per profile job, durable across server restarts and crashes.

Each call opens its own connection (sqlite3 connections are not shared across threads), runs in
one transaction and closes it, so a crash leaves either the old row or the new one, never half.
WAL lets readers (get_job/list_jobs) run while a writer commits. The schema version lives in
`PRAGMA user_version`; the statements in `_MIGRATIONS[i]` upgrade version i to i+1.

Every SQLite failure becomes a StoreError that names the file, what is wrong with it (locked by
another writer, corrupt, disk full, read-only) and what to do; nothing is recreated or dropped
silently. A writer waits at most BUSY_TIMEOUT_S for another one: the server answers in seconds.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

JobStateName = Literal["PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"]
JOB_STATES: tuple[str, ...] = ("PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
ACTIVE_STATES = frozenset({"PENDING", "RUNNING"})

STATE_DIR_ENV = "MCORE_ADVISOR_STATE_DIR"
DB_FILENAME = "jobs.sqlite3"
SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 5.0  # a commit takes milliseconds; longer means another process holds the lock
QUOTE_CHARS = 64  # job ids are 12 characters: an error never echoes more of one than this


class StoreError(ValueError):
    """The job store cannot be used; the message names the file, the cause and the remedy.

    A ValueError so the server reports the message to the client rather than "internal error".
    """


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """repr(value) cut to `limit` characters, so a hostile 100 KB id is never echoed whole."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"

_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 0 -> 1
    ("""
    CREATE TABLE jobs (
        job_id       TEXT PRIMARY KEY,
        name         TEXT NOT NULL,
        backend      TEXT NOT NULL,
        backend_ref  TEXT,            -- JSON JobRef: local pid, start ticks, boot id / the Slurm job id
        state        TEXT NOT NULL CHECK (state IN
                        ('PENDING','RUNNING','COMPLETED','FAILED','CANCELLED','TIMEOUT')),
        created_at   REAL NOT NULL,   -- unix seconds
        started_at   REAL,
        ended_at     REAL,
        job_dir      TEXT NOT NULL,
        command      TEXT NOT NULL,   -- JSON list of argv
        paths        TEXT NOT NULL,   -- JSON {name: path}
        resources    TEXT NOT NULL,   -- JSON
        plan         TEXT NOT NULL,   -- JSON (Plan.model_dump)
        spec         TEXT NOT NULL,   -- JSON (launcher.spec.job_spec)
        predicted    TEXT,            -- JSON (evaluate_plan at submit time)
        result       TEXT,            -- JSON (the entry's result.json)
        exit_code    INTEGER,
        error        TEXT,
        diagnosis    TEXT             -- JSON (check_mfu on a failed job's log)
    )""",
     "CREATE INDEX jobs_state ON jobs(state)",
     "CREATE INDEX jobs_created ON jobs(created_at)"),
)

_JSON_COLUMNS = ("backend_ref", "command", "paths", "resources", "plan", "spec", "predicted", "result", "diagnosis")
_UPDATABLE = frozenset(
    {"backend_ref", "state", "started_at", "ended_at", "paths", "predicted", "result", "exit_code", "error", "diagnosis"}
)


def default_state_dir() -> Path:
    """$MCORE_ADVISOR_STATE_DIR, else $XDG_STATE_HOME/mcore-advisor, else ~/.local/state/mcore-advisor."""
    explicit = os.environ.get(STATE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME")
    # XDG base-dir spec: a relative XDG_* path is invalid and must be ignored.
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".local" / "state"
    return base / "mcore-advisor"


def new_job_id() -> str:
    """12 hex digits of a uuid4: 48 random bits, short enough to type, collisions ~never in one store."""
    return uuid.uuid4().hex[:12]


class JobRecord(BaseModel):
    """One job as stored. Times are unix seconds; JSON columns are decoded."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str
    name: str
    backend: str
    backend_ref: dict[str, Any] | None = None
    state: JobStateName
    created_at: float
    started_at: float | None = None
    ended_at: float | None = None
    job_dir: str
    command: list[str]
    paths: dict[str, str] = Field(default_factory=dict)
    resources: dict[str, Any] = Field(default_factory=dict)
    plan: dict[str, Any]
    spec: dict[str, Any]
    predicted: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    exit_code: int | None = None
    error: str | None = None
    diagnosis: dict[str, Any] | None = None

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_STATES


class JobStore:
    """Durable job table in `<state_dir>/jobs.sqlite3` (or an explicit `db_path`)."""

    def __init__(self, db_path: str | os.PathLike[str] | None = None, *, state_dir: str | os.PathLike[str] | None = None,
                 busy_timeout_s: float = BUSY_TIMEOUT_S):
        if db_path is None:
            root = Path(state_dir).expanduser() if state_dir is not None else default_state_dir()
            db_path = root / DB_FILENAME
        self.path = Path(db_path).expanduser().resolve()
        self.busy_timeout_s = busy_timeout_s
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise StoreError(
                f"job store {self.path}: cannot create its directory ({exc.strerror or exc}); "
                f"set {STATE_DIR_ENV} to a writable directory"
            ) from exc
        with self._errors():
            self._migrate()

    @property
    def state_dir(self) -> Path:
        return self.path.parent

    # -- connection handling -------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: we issue BEGIN ourselves, so every write is one explicit transaction.
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None)
        try:
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            # FULL: a commit survives power loss too, not only a process crash; the write rate is tiny.
            conn.execute("PRAGMA synchronous=FULL")
        except BaseException:
            conn.close()
            raise
        return conn

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            raise StoreError(describe_sqlite_error(self.path, exc, timeout_s=self.busy_timeout_s)) from exc

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._errors():
            conn = self._connect()
            try:
                # IMMEDIATE takes the write lock up front, so read-check-write sequences cannot interleave.
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield conn
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
            finally:
                conn.close()

    def _read(self, sql: str, args: Sequence[Any]) -> list[sqlite3.Row]:
        with self._errors():
            conn = self._connect()
            try:
                return conn.execute(sql, args).fetchall()
            finally:
                conn.close()

    def _migrate(self) -> None:
        with self._transaction() as conn:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"job store {self.path} has schema version {version}, newer than this mcore-advisor "
                    f"({SCHEMA_VERSION}); upgrade mcore-advisor or point {STATE_DIR_ENV} elsewhere"
                )
            for step in range(version, SCHEMA_VERSION):
                for statement in _MIGRATIONS[step]:
                    conn.execute(statement)
            if version != SCHEMA_VERSION:
                # PRAGMA takes no parameters; the value is our own integer constant.
                conn.execute(f"PRAGMA user_version = {int(SCHEMA_VERSION)}")

    # -- row mapping ---------------------------------------------------------------------------

    def _row_to_record(self, row: sqlite3.Row) -> JobRecord:
        data = dict(row)
        try:
            for col in _JSON_COLUMNS:
                if data.get(col) is not None:
                    data[col] = json.loads(data[col])
            return JobRecord(**data)
        except ValueError as exc:  # bad JSON or values: a row no version of mcore-advisor wrote
            bad = sqlite3.DatabaseError(f"job {quote(data.get('job_id'))} cannot be read: {type(exc).__name__}")
            raise StoreError(describe_sqlite_error(self.path, bad, name="SQLITE_CORRUPT")) from exc

    @staticmethod
    def _encode(col: str, value: Any) -> Any:
        if col in _JSON_COLUMNS and value is not None:
            return json.dumps(value, sort_keys=True, separators=(",", ":"))
        return value

    # -- API -----------------------------------------------------------------------------------

    def insert(self, record: JobRecord) -> JobRecord:
        """Add a new job; ValueError if the id already exists."""
        data = record.model_dump()
        cols = list(data)
        sql = f"INSERT INTO jobs ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})"
        with self._transaction() as conn:
            try:
                conn.execute(sql, [self._encode(c, data[c]) for c in cols])
            except sqlite3.IntegrityError as exc:
                raise ValueError(f"job id {quote(record.job_id)} already exists in {self.path}") from exc
        return record

    def get(self, job_id: str) -> JobRecord:
        """The job with this id; KeyError naming the id otherwise."""
        rows = self._read("SELECT * FROM jobs WHERE job_id = ?", (job_id,))
        if not rows:
            raise KeyError(f"job_id: no job {quote(job_id)} in this store; list_jobs shows the known ones")
        return self._row_to_record(rows[0])

    def list(self, state: str | None = None, limit: int = 50, *, states: Iterable[str] | None = None) -> list[JobRecord]:
        """Newest first; `state` filters to one state, `states` to several."""
        wanted: list[str] = []
        if state is not None:
            wanted.append(state)
        if states is not None:
            wanted.extend(states)
        for s in wanted:
            if s not in JOB_STATES:
                raise ValueError(f"state: unknown job state {quote(s)}; use one of {', '.join(JOB_STATES)}")
        sql = "SELECT * FROM jobs"
        args: list[Any] = []
        if wanted:
            sql += f" WHERE state IN ({', '.join('?' for _ in wanted)})"
            args.extend(wanted)
        sql += " ORDER BY created_at DESC, job_id DESC LIMIT ?"
        args.append(int(limit))
        return [self._row_to_record(r) for r in self._read(sql, args)]

    def update(self, job_id: str, *, only_if_active: bool = False, **fields: Any) -> JobRecord:
        """Set the given columns in one transaction and return the new record.

        With `only_if_active`, a job already in a terminal state is left as it is (and returned),
        so a late poll can never overwrite COMPLETED with something else.
        """
        unknown = set(fields) - _UPDATABLE
        if unknown:
            raise ValueError(f"cannot update job columns {sorted(unknown)}")
        if "state" in fields and fields["state"] not in JOB_STATES:
            raise ValueError(f"unknown job state {quote(fields['state'])}")
        with self._transaction() as conn:
            row = conn.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
            if row is None:
                raise KeyError(f"job_id: no job {quote(job_id)} in this store; list_jobs shows the known ones")
            if only_if_active and row["state"] in TERMINAL_STATES:
                return self._row_to_record(row)
            if fields:
                sets = ", ".join(f"{c} = ?" for c in fields)
                conn.execute(
                    f"UPDATE jobs SET {sets} WHERE job_id = ?",
                    [self._encode(c, v) for c, v in fields.items()] + [job_id],
                )
            row = conn.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return self._row_to_record(row)

    def transition(self, job_id: str, state: str, **fields: Any) -> JobRecord:
        """Move an active job to `state` (stamping started_at/ended_at); terminal jobs stay put."""
        now = time.time()
        current = self.get(job_id)
        if current.is_terminal:
            return current
        updates: dict[str, Any] = dict(fields)
        updates["state"] = state
        if state != "PENDING" and current.started_at is None and "started_at" not in updates:
            updates["started_at"] = now if state == "RUNNING" else None
        if state in TERMINAL_STATES and "ended_at" not in updates:
            updates["ended_at"] = now
        return self.update(job_id, only_if_active=True, **updates)

    def delete(self, job_id: str) -> None:
        with self._transaction() as conn:
            conn.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,))


def record_from(
    *,
    job_id: str,
    name: str,
    backend: str,
    job_dir: Path,
    command: list[str],
    plan: Mapping[str, Any],
    spec: Mapping[str, Any],
    resources: Mapping[str, Any],
    paths: Mapping[str, str] | None = None,
    predicted: Mapping[str, Any] | None = None,
    state: str = "PENDING",
    created_at: float | None = None,
) -> JobRecord:
    """A fresh PENDING record (the backend ref and start time come after submit)."""
    return JobRecord(
        job_id=job_id,
        name=name,
        backend=backend,
        state=state,  # type: ignore[arg-type]
        created_at=time.time() if created_at is None else created_at,
        job_dir=str(job_dir),
        command=list(command),
        paths=dict(paths or {}),
        resources=dict(resources),
        plan=dict(plan),
        spec=dict(spec),
        predicted=dict(predicted) if predicted is not None else None,
    )


_LOCKED = ("SQLITE_BUSY", "SQLITE_LOCKED")
_CORRUPT = ("SQLITE_CORRUPT", "SQLITE_NOTADB")
_READ_ONLY = ("SQLITE_READONLY", "SQLITE_PERM", "SQLITE_CANTOPEN", "SQLITE_AUTH")


def _no_space(path: Path) -> bool:
    """SQLite reports a write that hit ENOSPC as an I/O error (SQLITE_IOERR_WRITE) as often as SQLITE_FULL."""
    try:
        st = os.statvfs(path.parent)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 64 * 1024


def describe_sqlite_error(path: Path, exc: sqlite3.Error, name: str | None = None, timeout_s: float = BUSY_TIMEOUT_S) -> str:
    """What is wrong with the store file and what to do, from SQLite's result code (sqlite3.h)."""
    code = name or getattr(exc, "sqlite_errorname", None) or ""
    detail = str(exc) or code or type(exc).__name__
    where = f"job store {path}"
    if code.startswith(_LOCKED) or "locked" in detail:
        return (f"{where} is locked: another process has held its write lock for over {timeout_s:g} s ({detail}). "
                "Another mcore-advisor server or a sqlite3 shell with an open transaction holds it; retry when it "
                "has finished, or end that process's transaction")
    if code.startswith(_CORRUPT) or "malformed" in detail or "not a database" in detail:
        return (f"{where} is corrupt ({detail}); nothing was changed. Move it aside (mv {path} {path}.corrupt, "
                f"with its -wal and -shm files) and restart for an empty store, or restore a backup; each job's "
                f"files stay in {path.parent / 'jobs'}/<job_id>/")
    if code.startswith("SQLITE_FULL") or "disk is full" in detail or (code.startswith("SQLITE_IOERR") and _no_space(path)):
        return (f"{where}: the disk is full ({detail}); nothing was written. Free space on the file system of "
                f"{path.parent}, or set {STATE_DIR_ENV} to a directory on another disk")
    if code.startswith(_READ_ONLY) or "readonly" in detail or "unable to open" in detail:
        return (f"{where} cannot be written ({detail}): check the permissions of the file and of {path.parent} "
                f"and that its file system is not mounted read-only, or set {STATE_DIR_ENV} to a writable directory")
    if code.startswith("SQLITE_IOERR"):
        return (f"{where}: disk I/O error ({detail}); check the disk and free space under {path.parent}, "
                f"or set {STATE_DIR_ENV} to a directory on another disk")
    return f"{where}: SQLite error {code or type(exc).__name__} ({detail})"
