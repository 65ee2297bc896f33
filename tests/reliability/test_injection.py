"""No string an MCP client sends reaches a shell, Slurm or a path as anything but data (see _rel_inject.py)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from _rel_inject import make_standins, payloads, recorded_argv, run_injection, run_script
from mcp import Client

from mcore_advisor.launcher.backends.local import LocalBackend
from mcore_advisor.launcher.backends.slurm_cli import SlurmCliBackend
from mcore_advisor.launcher.jobs import JobManager
from mcore_advisor.launcher.store import JobStore
from mcore_advisor.server.app import build_server

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(autouse=True)
def _quiet_sdk():
    logging.getLogger("mcp").setLevel(logging.CRITICAL)


def _server(tmp: Path, bin_dir: Path, argv_log: Path):
    # The Slurm backend really submits: sbatch is the stand-in that records its argv and prints a job id.
    factories = {"slurm": lambda: SlurmCliBackend(bin_dir=str(bin_dir), env={"ARGV_LOG": str(argv_log)}), "local": LocalBackend}
    manager = JobManager(store=JobStore(tmp / "jobs.sqlite3"), job_root=tmp / "jobs", backend_factories=factories)
    return build_server(manager=manager)


def test_the_stand_ins_record_argv_and_a_payload_in_the_script_text_would_run(tmp_path):
    """The harness itself: an unquoted payload does create the canary, and stand-ins only record."""
    bin_dir, canary, log = tmp_path / "bin", tmp_path / "canary", tmp_path / "argv.log"
    make_standins(bin_dir)
    proc = run_script(f"#!/bin/bash\nset -e\nsrun --x 'a b'$'\\n'c\necho hi; touch {canary}\n", tmp_path / "w", bin_dir, log)
    assert proc.returncode == 0, proc.stderr
    assert canary.exists()
    assert recorded_argv(log) == [["srun", "--x", "a b\nc"]]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
async def test_no_payload_in_any_shell_scheduler_or_path_string_executes(tmp_path):
    bin_dir, canary = tmp_path / "bin", tmp_path / "canary"
    make_standins(bin_dir)
    every = payloads(canary)
    # CI: a third of the payloads (each still goes through every field); benchmarks/reliability.py runs all.
    chosen = every[::3]
    async with Client(_server(tmp_path, bin_dir, tmp_path / "sbatch-argv.log")) as client:
        report = await run_injection(client, tmp_path / "sandbox", bin_dir, canary, tmp_path / "jobs", chosen)
    assert report.executed == 0, report.problems
    assert report.problems == []
    assert report.tried == len(chosen) * 28
    # Both happen: hostile values are refused where a name must be plain, and carried whole as one
    # argument where a path or flag value may be anything.
    assert report.rejected > 0 and report.scripts_run > 0 and report.intact > 0
    # The real Slurm path ran: the stand-in sbatch got a submission with the options as separate arguments.
    assert report.baseline_submitted
    [sbatch] = [c for c in recorded_argv(tmp_path / "sbatch-argv.log") if c[0] == "sbatch"]
    assert "--job-name=inject-baseline" in sbatch and "--partition=debug" in sbatch
