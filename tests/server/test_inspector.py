"""The MCP Inspector CLI (a client other than our SDK) lists and calls every tool over stdio and HTTP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _npm_clients import client, node_env

INSPECTOR, WHY = client("mcp-inspector")
pytestmark = pytest.mark.skipif(INSPECTOR is None, reason=WHY)

PLAN = ["model=llama3-8b", "num_gpus=8", "seq_length=4096", "global_batch_size=64"]
# one call per tool: arguments as the Inspector's key=value pairs, and whether the call must fail
CALLS = {
    "recommend_parallelism": (PLAN + ["top_k=1", "what_if=false"], False),
    "evaluate_plan": (PLAN + ["tp=2"], False),
    "estimate_memory": (PLAN + ["micro_batch_size=2"], False),
    "check_mfu": (PLAN + ["reported_tflops_per_gpu=400"], False),
    "render_launch_script": (PLAN + ["launcher=slurm"], False),
    "render_chart": (PLAN + ["chart=memory"], False),
    "run_profile_job": (PLAN + ["dry_run=true"], False),
    "list_jobs": ([], False),
    "get_job": (["job_id=0123456789ab"], True),
    "cancel_job": (["job_id=0123456789ab"], True),
}


def _inspect(home: Path, target: list[str], *args: str) -> subprocess.CompletedProcess:
    # a slow start under load must not count as a failure: the server imports for seconds on a busy machine
    cmd = [str(INSPECTOR), "--cli", "--connect-timeout", "120000", *args, "--", *target]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=node_env(home))


def _check(home: Path, target: list[str], era: str) -> None:
    listed = _inspect(home, target, "--protocol-era", era, "--method", "tools/list", "--strict")
    assert listed.returncode == 0, listed.stderr[-2000:]  # --strict: no error-level schema portability problem
    names = {t["name"] for t in json.loads(listed.stdout)["tools"]}
    assert names == set(CALLS)

    def call(name: str) -> tuple[str, subprocess.CompletedProcess]:
        args, _ = CALLS[name]
        extra = ["--tool-arg", *args] if args else []
        return name, _inspect(home, target, "--protocol-era", era, "--method", "tools/call", "--tool-name", name, *extra)

    with ThreadPoolExecutor(max_workers=2) as pool:
        for name, res in pool.map(call, CALLS):
            must_fail = CALLS[name][1]
            body = json.loads(res.stdout[: res.stdout.rindex("}") + 1]) if "{" in res.stdout else {}
            if must_fail:  # an unknown job: a tool error naming the id, not a crash
                assert res.returncode != 0 and body.get("isError") is True, (name, res.stdout[-500:])
                assert "0123456789ab" in body["content"][0]["text"]
                continue
            assert res.returncode == 0, (name, res.stdout[-1000:], res.stderr[-1000:])
            assert body.get("isError") is not True, (name, body)
            kinds = [c["type"] for c in body["content"]]
            if name == "render_chart":
                assert kinds == ["text", "image"] and body["content"][1]["mimeType"] == "image/png"
            else:
                assert kinds == ["text"] and isinstance(body["structuredContent"], dict), name


def test_inspector_lists_and_calls_every_tool_over_stdio(tmp_path):
    server = [sys.executable, "-m", "mcore_advisor.cli", "serve"]
    # the Inspector starts the server with a minimal environment, as hosts do: pass what it needs
    env = [f"MCORE_ADVISOR_STATE_DIR={tmp_path / 'state'}"]
    env += [f"PYTHONPATH={os.environ['PYTHONPATH']}"] if os.environ.get("PYTHONPATH") else []
    _check(tmp_path, ["env", *env, *server], "legacy")  # the initialize handshake (2025-11-25)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_inspector_lists_and_calls_every_tool_over_http(tmp_path):
    port = _free_port()
    env = {**os.environ, "MCORE_ADVISOR_STATE_DIR": str(tmp_path / "state")}
    env.pop("MCORE_ADVISOR_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "mcore_advisor.cli", "serve", "--http", "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the HTTP server did not start"
                time.sleep(0.1)
        _check(tmp_path, [f"http://127.0.0.1:{port}/mcp"], "modern")  # server/discover (2026-07-28)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
