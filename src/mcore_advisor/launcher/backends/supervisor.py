"""The detached supervisor of one local job: `python supervisor.py JOB_DIR`.

Runs as its own session leader (the local backend starts it with start_new_session), so it
outlives the MCP server. It starts the job command from JOB_DIR/launch.json in a session and
process group of its own, records that group in JOB_DIR/job.json at once, enforces the wall-clock
limit, turns SIGTERM (cancel) into an orderly stop, and finally writes JOB_DIR/exit_code.json
atomically. That file is how a restarted server learns how the job ended; job.json is how the
server still reaches the job when the supervisor itself was killed (kill -9 leaves its children
running: they are re-parented, not signalled).

Why the process-tree care: torchrun starts every worker in a new session
(torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py, `_popen`:
start_new_session=True), so signalling our process group does not reach the workers. We become
a child subreaper (prctl PR_SET_CHILD_SUBREAPER) so workers orphaned by a dying torchrun stay
our descendants, and stop the whole tree: SIGTERM to the command, then SIGKILL to every
descendant after a grace period.

Stdlib only and importable by path: it must start fast and not depend on the server's imports.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

LAUNCH_FILE = "launch.json"
EXIT_FILE = "exit_code.json"
JOB_FILE = "job.json"  # {"pid", "pgid", "start_ticks"} of the job command, written once it started
CANCEL_FILE = "cancel_requested"
POLL_FAST_S = 0.05  # first seconds: short test jobs and quick failures end promptly
POLL_SLOW_S = 0.25
_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


# ---- /proc helpers (also used by the server side, local.py) ----------------------------------


def proc_stat(pid: int) -> dict[str, int | str] | None:
    """state, ppid, pgrp, session and start time (clock ticks since boot) from /proc/PID/stat."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    # comm (field 2) may contain spaces and ')' : split after the last ')'. proc(5) numbering.
    rest = raw[raw.rfind(")") + 2 :].split()
    try:
        return {
            "state": rest[0],
            "ppid": int(rest[1]),
            "pgrp": int(rest[2]),
            "session": int(rest[3]),
            "start_ticks": int(rest[19]),
        }
    except (IndexError, ValueError):
        return None


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def is_running(pid: int, start_ticks: int | None) -> bool:
    """Alive and the same process: a reused pid has a different start time; zombies count as dead."""
    st = proc_stat(pid)
    if st is None or st["state"] in ("Z", "X", "x"):
        return False
    return start_ticks is None or st["start_ticks"] == start_ticks


def descendants(root: int) -> list[int]:
    """All live descendants of `root` (children first), from one scan of /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = proc_stat(int(entry))
            if st is not None and st["state"] not in ("Z", "X", "x"):
                children.setdefault(int(st["ppid"]), []).append(int(entry))
    out: list[int] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def processes_with_env(name: str, value: str) -> list[int]:
    """Pids of our own processes whose environment has name=value (stray workers of a job)."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.append(int(entry))
    return found


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---- the supervisor ------------------------------------------------------------------------


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w") as fh:
        json.dump(data, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class _Stop:
    requested_at: float | None = None


def supervise(job_dir: Path) -> int:
    launch = json.loads((job_dir / LAUNCH_FILE).read_text())
    command: list[str] = launch["command"]
    time_limit_s = float(launch["time_limit_s"])
    grace_s = float(launch.get("grace_s", 10.0))
    env = dict(os.environ)
    env.update(launch.get("env", {}))

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: orphaned grandchildren are then found by their environment marker

    stop = _Stop()

    def on_term(signum: int, frame: object) -> None:
        if stop.requested_at is None:
            stop.requested_at = time.monotonic()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

    started_at = time.time()
    t0 = time.monotonic()
    with open(job_dir / launch["stdout"], "ab") as out, open(job_dir / launch["stderr"], "ab") as err:
        try:
            # Its own session: one killpg reaches the command and its plain children, and the group
            # outlives a killed supervisor (torchrun's workers have sessions of their own; the job's
            # environment marker finds those).
            child = subprocess.Popen(command, cwd=job_dir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                     start_new_session=True)
        except OSError as exc:
            err.write(f"mcore-advisor supervisor: cannot start {command[0]!r}: {exc}\n".encode())
            write_json_atomic(job_dir / EXIT_FILE, {
                "exit_code": 127, "timed_out": False, "cancelled": (job_dir / CANCEL_FILE).exists(),
                "started_at": started_at, "ended_at": time.time(), "error": f"cannot start: {exc}",
            })
            return 127

    stat = proc_stat(child.pid)
    write_json_atomic(job_dir / JOB_FILE, {"pid": child.pid, "pgid": child.pid,
                                            "start_ticks": stat["start_ticks"] if stat else None})
    returncode: int | None = None
    timed_out = False
    term_sent_at: float | None = None
    killed = False
    while True:
        # Reap everything: the command itself and any orphan we adopted as subreaper.
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid = 0
            if pid == 0:
                break
            if pid == child.pid:
                returncode = os.waitstatus_to_exitcode(status)
                child.returncode = returncode  # keep Popen from waiting on a reaped pid
        now = time.monotonic()
        if returncode is not None:
            rest = descendants(os.getpid())
            if not rest:
                break
            # The command is done but left processes behind: stop them too, quickly.
            if term_sent_at is None:
                term_sent_at = now
                signal_all(rest, signal.SIGTERM)
            elif now - term_sent_at > grace_s:
                signal_all(rest, signal.SIGKILL)
        else:
            if term_sent_at is None and (stop.requested_at is not None or now - t0 > time_limit_s):
                timed_out = stop.requested_at is None
                term_sent_at = now
                # torchrun forwards SIGTERM to its workers and waits for them.
                signal_group(child.pid, signal.SIGTERM)
            elif term_sent_at is not None and not killed and now - term_sent_at > grace_s:
                killed = True
                signal_all([*descendants(os.getpid())], signal.SIGKILL)
        time.sleep(POLL_FAST_S if now - t0 < 5.0 else POLL_SLOW_S)

    write_json_atomic(job_dir / EXIT_FILE, {
        "exit_code": returncode,
        "timed_out": timed_out,
        "cancelled": (job_dir / CANCEL_FILE).exists() and not timed_out,
        "terminated": stop.requested_at is not None,
        "started_at": started_at,
        "ended_at": time.time(),
    })
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.stderr.write("usage: supervisor.py JOB_DIR\n")
        raise SystemExit(2)
    raise SystemExit(supervise(Path(sys.argv[1]).resolve()))
