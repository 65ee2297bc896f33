"""`mcore-advisor serve` from the built wheel in a fresh virtual environment (as uvx/pipx run it):
the package data (catalogs, templates) and the chart dependency come with the package, not the tree."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from mcp import Client, StdioServerParameters

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("fresh")
    src = tmp / "pkg"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)], check=True,
                   capture_output=True, timeout=300)
    wheel = next((tmp / "dist").glob("mcore_advisor-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith("/METADATA"))).decode()
    assert "Requires-Dist: matplotlib" in meta  # charts need it in a plain install
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies (mcp, pydantic, numpy, matplotlib ...) from this environment; not its mcore_advisor,
    # which is an editable install whose finder a plain path entry does not load
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([*pip, "--python", str(py), "install", "--no-deps", str(wheel)], check=True, capture_output=True, timeout=300)
    return venv


def test_the_wheel_installs_its_own_package(fresh, tmp_path):
    where = subprocess.run([str(fresh / "bin" / "python"), "-c", "import mcore_advisor; print(mcore_advisor.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, check=True).stdout
    assert where.startswith(str(fresh)), where


async def test_serve_from_the_fresh_environment_answers_over_stdio(fresh, tmp_path):
    env = {"PATH": f"{fresh / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "MCORE_ADVISOR_STATE_DIR": str(tmp_path / "state")}
    params = StdioServerParameters(command=str(fresh / "bin" / "mcore-advisor"), args=["serve"], env=env, cwd=str(tmp_path))
    async with Client(params) as client:
        assert len((await client.list_tools()).tools) == 10
        rec = await client.call_tool("recommend_parallelism", {"model": "llama3-8b", "num_gpus": 8, "top_k": 1, "what_if": False})
        assert rec.is_error is False and rec.structured_content["feasible"] is True
        pid = rec.structured_content["plans"][0]["plan_id"]
        script = await client.call_tool("render_launch_script", {"plan_id": pid, "launcher": "slurm"})  # jinja templates
        assert script.is_error is False and "#SBATCH" in script.content[0].text
        chart = await client.call_tool("render_chart", {"plan_id": pid, "chart": "memory"})  # matplotlib
        assert [c.type for c in chart.content] == ["text", "image"]
        models = json.loads((await client.read_resource("mcore://models")).contents[0].text)
        assert any(m["key"] == "llama3-70b" for m in models)
