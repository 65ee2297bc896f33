"""One-way data flow, enforced on the source: who may import what (DEVELOPERS.md, STYLE.md section 1)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "mcore_advisor"
HEAVY = {"torch", "megatron", "transformer_engine", "apex"}
# The pure core must not reach the clock, the environment, processes, sockets or the network.
IO = {"subprocess", "socket", "time", "os", "httpx", "httpx2", "sqlite3", "shutil", "signal", "threading", "asyncio"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def _modules(sub: str) -> list[Path]:
    root = PKG / sub if sub else PKG
    return sorted(p for p in root.rglob("*.py"))


def _top(names: set[str]) -> set[str]:
    return {n.split(".")[0] for n in names}


@pytest.mark.parametrize("path", _modules(""), ids=lambda p: str(p.relative_to(PKG)))
def test_only_the_profile_entry_imports_torch_or_megatron(path):
    if "launcher/entry" in path.as_posix():
        return
    assert not (_top(_imports(path)) & HEAVY), f"{path.relative_to(PKG)} imports {_top(_imports(path)) & HEAVY}"


@pytest.mark.parametrize("path", _modules("tools") + _modules("validators") + _modules("knowledge")
                         + [PKG / "schemas.py"], ids=lambda p: str(p.relative_to(PKG)))
def test_the_core_does_no_io_and_never_imports_upward(path):
    names = _imports(path)
    upward = {n for n in names if n.startswith(("mcore_advisor.launcher", "mcore_advisor.server", "mcore_advisor.cli"))}
    assert not upward, f"{path.relative_to(PKG)} imports {upward}"
    assert not (_top(names) & IO), f"{path.relative_to(PKG)} imports {_top(names) & IO}"


@pytest.mark.parametrize("path", _modules("launcher/entry"), ids=lambda p: str(p.relative_to(PKG)))
def test_the_profile_entry_needs_nothing_but_torch_megatron_and_the_stdlib(path):
    # It runs on GPU images without pydantic: only its own package and the stdlib (+ torch/megatron/TE).
    names = {n for n in _imports(path) if n.startswith("mcore_advisor")}
    assert all(n.startswith("mcore_advisor.launcher.entry") for n in names), names
    assert "pydantic" not in _top(_imports(path))


def test_nothing_imports_the_adapters():
    for path in _modules(""):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith("server/") or rel == "cli.py":
            continue
        names = _imports(path)
        assert not {n for n in names if n.startswith(("mcore_advisor.server", "mcore_advisor.cli"))}, rel
