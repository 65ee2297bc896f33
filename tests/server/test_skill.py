"""The agent skill: its files are well formed, the `skills` CLI installs it, and its evals hold.

evals/tasks.json lists, per task, the prompt a user would type, the tool calls an assistant should
make and what their answers must show; the worked examples quote figures that the tools must still
produce (within the stated tolerance), so the examples cannot go stale unnoticed.
"""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

import pytest
from _npm_clients import ROOT, client, node_env
from mcp import Client

from mcore_advisor.launcher.jobs import JobManager
from mcore_advisor.launcher.store import JobStore
from mcore_advisor.server.app import build_server

SKILL = ROOT / "skills" / "mcore-advisor"
TASKS = json.loads((SKILL / "evals" / "tasks.json").read_text())["tasks"]
EXAMPLES = (SKILL / "references" / "worked-examples.md").read_text()
LOGS = ROOT / "tests" / "fixtures" / "logs"


def _front_matter(text: str) -> dict[str, str]:
    m = re.match(r"---\n(.*?)\n---\n", text, re.S)
    assert m, "SKILL.md starts with YAML front matter"
    return dict(line.split(": ", 1) for line in m.group(1).splitlines())


def test_skill_md_follows_the_agent_skills_format():
    text = (SKILL / "SKILL.md").read_text()
    meta = _front_matter(text)
    assert meta["name"] == SKILL.name and re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", meta["name"])
    assert 1 <= len(meta["description"]) <= 1024 and len(meta.get("compatibility", "")) <= 500
    assert len(text.splitlines()) < 500
    for link in re.findall(r"\]\(([^)]+)\)", text):
        assert (SKILL / link).is_file(), link
    # every tool the skill names exists on the server, and every tool is named
    names = set(re.findall(r"`([a-z_]+)`", text))
    tools = {t.name for t in build_server()._tool_manager.list_tools()}  # noqa: SLF001
    assert tools <= names


SKILLS_CLI, WHY = client("skills")


@pytest.mark.skipif(SKILLS_CLI is None, reason=WHY)
def test_the_skills_cli_installs_the_skill_from_the_repository(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    res = subprocess.run([str(SKILLS_CLI), "add", str(ROOT), "--skill", "mcore-advisor", "-a", "claude-code", "-y"],
                         cwd=project, capture_output=True, text=True, timeout=180, env=node_env(tmp_path))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    installed = project / ".claude" / "skills" / "mcore-advisor"
    assert (installed / "SKILL.md").read_bytes() == (SKILL / "SKILL.md").read_bytes()
    source_files = sorted(p.relative_to(SKILL) for p in SKILL.rglob("*") if p.is_file())
    assert sorted(p.relative_to(installed) for p in installed.rglob("*") if p.is_file()) == source_files
    assert json.loads((project / "skills-lock.json").read_text())["skills"]["mcore-advisor"]


# ---- evals ---------------------------------------------------------------------------------------


def _get(data: Any, path: str) -> Any:
    for name, index in re.findall(r"([A-Za-z_0-9]+)(?:\[(\d+)\])?", path):
        data = data[name]
        if index:
            data = data[int(index)]
    return data


def _resolve(value: Any, saved: dict[str, Any]) -> Any:
    """'$name.path' refers to an earlier call's structured answer; 'log_file' reads a fixture log."""
    if isinstance(value, str) and value.startswith("$"):
        name, _, path = value[1:].partition(".")
        return _get(saved[name], path) if path else saved[name]
    if isinstance(value, dict):
        return {k: _resolve(v, saved) for k, v in value.items()}
    return value


def _number(quote: str) -> float:
    """The first number of a quote: '1,114 tokens/s/GPU' -> 1114, '89.5 of 139.8 GiB' -> 89.5."""
    return float(re.search(r"[-+]?\d[\d,]*(?:\.\d+)?", quote).group().replace(",", ""))


TRANSFORMS = {"slower_pct": lambda relative: 100 * (1 - relative)}  # relative_throughput -> '% slower'


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
@pytest.mark.parametrize("task", TASKS, ids=[t["id"] for t in TASKS])
async def test_eval_task(task, tmp_path):
    server = build_server(manager=JobManager(store=JobStore(tmp_path / "jobs.sqlite"), job_root=tmp_path / "jobs"))
    saved: dict[str, Any] = {}
    answers = []
    async with Client(server) as mcp:
        for call in task["calls"]:
            args = _resolve(call["arguments"], saved)
            if "log_file" in args:
                args["log_text"] = (LOGS / args.pop("log_file")).read_text()
            res = await mcp.call_tool(call["tool"], args)
            text = "\n".join(getattr(c, "text", "") or "" for c in res.content)
            assert res.is_error is False, (call["tool"], text)
            answers.append((res, text))
            if "save" in call:
                saved[call["save"]] = res.structured_content
    for check in task["expect"]:
        res, text = answers[check.get("call", 0)]
        if "text_contains" in check:
            assert check["text_contains"] in text, (check, text[:2000])
            continue
        if "content_type" in check:
            assert check["content_type"] in [c.type for c in res.content], check
            continue
        value = _get(res.structured_content, check["path"])
        if "equals" in check:
            assert value == check["equals"], (check, value)
        if "contains" in check:
            assert check["contains"] in value, (check, value)
        if "min" in check:
            assert value >= check["min"], (check, value)
        if "max" in check:
            assert value <= check["max"], (check, value)
        if "quote" in check:  # a figure the worked examples quote: still what the tool says
            assert check["quote"] in EXAMPLES, f"worked-examples.md does not quote {check['quote']!r}"
            if check.get("text"):
                assert value == check["quote"], (check, value)
            else:
                value = TRANSFORMS[check["transform"]](value) if "transform" in check else value
                assert value == pytest.approx(_number(check["quote"]), rel=check.get("rel", 0.05)), (check, value)
    assert task["answer"] and task["prompt"]
