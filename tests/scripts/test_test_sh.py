"""scripts/test.sh stops the local Slurm it started (a trap on exit), keeps one that was already up, and keeps
its own with KEEP_SLURM=1. Run against fakes: the real installs, Slurm bring-up and pytest are replaced by
recorders in a copy of the scripts, so this is fast and needs neither root nor Slurm."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _exe(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _sandbox(tmp: Path, pytest_rc: int) -> Path:
    repo = tmp / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "test.sh", repo / "scripts" / "test.sh")
    log = tmp / "calls.log"
    rec = f'#!/bin/bash\necho "$(basename "$0") $*" >> {log}\n'
    _exe(repo / "scripts" / "slurm" / "up.sh", rec + 'echo "export SLURM_CONF=/nonexistent/slurm.conf"\n')
    _exe(repo / "scripts" / "slurm" / "down.sh", rec)
    for name in ("install_clients.sh",):  # other helpers test.sh may call: recorded, no effect
        _exe(repo / "scripts" / name, rec)
    _exe(repo / ".venv" / "bin" / "python", rec + f'case "$*" in *pytest*) exit {pytest_rc};; esac\n')
    fake = tmp / "bin"
    _exe(fake / "id", "#!/bin/bash\necho 0\n")
    for name in ("apt-get", "shellcheck", "python3.12"):  # test.sh asks for Python 3.12 by name
        _exe(fake / name, rec)
    return repo


def _run(tmp: Path, *, pytest_rc: int = 0, env: dict | None = None) -> tuple[int, list[str]]:
    repo = _sandbox(tmp, pytest_rc)
    e = {"PATH": f"{tmp / 'bin'}:/usr/bin:/bin", "HOME": str(tmp), "SLURM_RUN_DIR": str(tmp / "slurm")} | (env or {})
    r = subprocess.run(["bash", str(repo / "scripts" / "test.sh"), "-k", "x"], env=e, capture_output=True, text=True, timeout=60)
    calls = (tmp / "calls.log").read_text().splitlines()
    return r.returncode, [c.split()[0] for c in calls]


def test_slurm_started_by_the_run_is_stopped_after_the_tests(tmp_path):
    rc, calls = _run(tmp_path)
    assert rc == 0 and calls.index("up.sh") < calls.index("python", calls.index("up.sh")) < calls.index("down.sh")


def test_the_stop_keeps_pytests_exit_status(tmp_path):
    rc, calls = _run(tmp_path, pytest_rc=3)
    assert rc == 3 and calls[-1] == "down.sh"


def test_keep_slurm_keeps_the_daemons(tmp_path):
    rc, calls = _run(tmp_path, env={"KEEP_SLURM": "1"})
    assert rc == 0 and "up.sh" in calls and "down.sh" not in calls


def test_a_cluster_that_was_already_up_is_left_running(tmp_path):
    pid_file = tmp_path / "slurm" / "run" / "slurmctld.daemon.pid"
    pid_file.parent.mkdir(parents=True)
    pid_file.write_text(str(os.getpid()))  # a live process stands for the running slurmctld
    rc, calls = _run(tmp_path)
    assert rc == 0 and "down.sh" not in calls


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_test_sh_passes_shellcheck():
    assert subprocess.run(["shellcheck", str(ROOT / "scripts" / "test.sh")], capture_output=True).returncode == 0
