"""Concurrent mixed MCP calls over streamable HTTP: each answer compared with the same call made alone.

Used by tests/reliability/test_load.py (a reduced count) and benchmarks/reliability.py (200 calls).
"""

from __future__ import annotations

import contextlib
import json
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "logs" / "megatron_0_19_gpt1p3b_te_mbs4_h200.log"
_ITER = re.compile(r"iteration\s+(\d+)/\s*(\d+)")


def big_log(target_bytes: int = 10 * 2**20) -> str:
    """A real Megatron-LM 0.19 log (arguments dump + iteration lines) with its iteration lines
    repeated and renumbered until it is `target_bytes` long."""
    lines = FIXTURE.read_text().splitlines()
    iters = [ln for ln in lines if _ITER.search(ln)]
    head = [ln for ln in lines if ln not in iters]
    out, size, i = list(head), sum(len(ln) + 1 for ln in head), 0
    total = target_bytes // (len(iters[-1]) + 1) + 1
    while size < target_bytes:
        line = _ITER.sub(f"iteration {i + 1:8d}/ {total:8d}", iters[1 + i % (len(iters) - 1)])
        out.append(line)
        size += len(line) + 1
        i += 1
    return "\n".join(out) + "\n"


SMALL_PLAN = {"model": "llama3-8b", "num_gpus": 8, "seq_length": 4096, "global_batch_size": 128, "tp": 2}
MOE_PLAN = {"model": "mixtral-8x7b", "num_gpus": 64, "seq_length": 4096, "global_batch_size": 256, "tp": 2, "ep": 8}


def call_mix(n: int, n_big_logs: int, log_text: str) -> list[tuple[str, dict[str, Any]]]:
    """n calls: recommend, evaluate, estimate and check_mfu in turn; n_big_logs of the check_mfu calls carry the big log."""
    kinds = [
        ("recommend_parallelism", {"model": "llama3-8b", "num_gpus": 16, "seq_length": 4096, "top_k": 3, "what_if": False}),
        ("evaluate_plan", SMALL_PLAN),
        ("estimate_memory", MOE_PLAN),
        ("check_mfu", {**SMALL_PLAN, "iteration_time_s": 6.5}),
    ]
    out = [kinds[i % len(kinds)] for i in range(n)]
    mfu_slots = [i for i, (name, _) in enumerate(out) if name == "check_mfu"]
    for i in mfu_slots[:n_big_logs]:
        out[i] = ("check_mfu", {"log_text": log_text, "gpu": "h200"})
    return out


def stable(tool: str, data: dict[str, Any] | None) -> Any:
    """What must be identical under load: the structured answer without timing figures."""
    data = json.loads(json.dumps(data or {}))
    if tool == "recommend_parallelism":
        return [p.get("plan_id") for p in data.get("plans") or []]
    for key in ("elapsed_s", "search_seconds", "configs_per_s", "searched"):
        data.pop(key, None)
    return data


@dataclass
class LoadReport:
    requests: int = 0
    failures: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    by_tool: dict[str, list[float]] = field(default_factory=dict)
    wall_s: float = 0.0

    def pct(self, q: float, values: list[float] | None = None) -> float:
        vals = sorted(values if values is not None else self.latencies_s)
        return vals[min(len(vals) - 1, int(q * len(vals)))] if vals else float("nan")


async def _session(url: str, token: str | None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    http = httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(300.0))
    return http, Client(streamable_http_client(url, http_client=http))


async def expected_answers(url: str, calls: list[tuple[str, dict[str, Any]]], token: str | None = None) -> dict[str, Any]:
    """Each distinct call made alone, one after another."""
    http, client = await _session(url, token)
    seen: dict[str, Any] = {}
    async with http, client:
        for tool, args in calls:
            key = tool + json.dumps(args, sort_keys=True)[:200] + str(len(json.dumps(args)))
            if key not in seen:
                res = await client.call_tool(tool, args)
                seen[key] = None if res.is_error else stable(tool, res.structured_content)
    return seen


async def run_load(url: str, calls: list[tuple[str, dict[str, Any]]], expected: dict[str, Any], sessions: int = 4,
                   token: str | None = None) -> LoadReport:
    """All calls at once, spread over `sessions` MCP sessions; every answer checked against `expected`."""
    report = LoadReport(requests=len(calls))
    opened = [await _session(url, token) for _ in range(sessions)]

    async def one(i: int, client: Client) -> None:
        tool, args = calls[i]
        key = tool + json.dumps(args, sort_keys=True)[:200] + str(len(json.dumps(args)))
        t0 = time.perf_counter()
        try:
            res = await client.call_tool(tool, args)
        except Exception as exc:  # the request itself failed
            report.failures.append(f"#{i} {tool}: {type(exc).__name__}: {str(exc)[:200]}")
            return
        dt = time.perf_counter() - t0
        report.latencies_s.append(dt)
        report.by_tool.setdefault(tool, []).append(dt)
        if res.is_error:
            report.failures.append(f"#{i} {tool}: error {' '.join(getattr(c, 'text', '') for c in res.content)[:200]}")
        elif stable(tool, res.structured_content) != expected.get(key):
            report.failures.append(f"#{i} {tool}: answer differs from the same call made alone")

    t0 = time.perf_counter()
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for http, client in opened:
            await stack.enter_async_context(http)
            clients.append(await stack.enter_async_context(client))
        async with anyio.create_task_group() as tg:
            for i in range(len(calls)):
                tg.start_soon(one, i, clients[i % sessions])
    report.wall_s = time.perf_counter() - t0
    return report


HEAVY_SEARCH = {"model": "deepseek-v3", "num_gpus": 1024, "seq_length": 4096, "top_k": 5}


async def cheap_while_searching(url: str, searches: int = 3, cheap: int = 10, token: str | None = None) -> tuple[list[float], list[float]]:
    """(evaluate_plan latencies alone, the same while `searches` heavy recommend calls run)."""
    http, client = await _session(url, token)
    async with http, client:
        alone = []
        for _ in range(cheap):
            t0 = time.perf_counter()
            await client.call_tool("evaluate_plan", SMALL_PLAN)
            alone.append(time.perf_counter() - t0)
        during: list[float] = []
        async with anyio.create_task_group() as tg:
            for _ in range(searches):
                tg.start_soon(client.call_tool, "recommend_parallelism", HEAVY_SEARCH)
            await anyio.sleep(0.5)  # the searches are running now
            for _ in range(cheap):
                t0 = time.perf_counter()
                await client.call_tool("evaluate_plan", SMALL_PLAN)
                during.append(time.perf_counter() - t0)
    return alone, during


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
