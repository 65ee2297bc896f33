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


CORE = ("schemas", "knowledge", "validators")
# The core's parts and what each may import from the package (besides itself and `mcore_advisor` for
# __version__): physics is the base every wing builds on; diagnosis uses planning's plan changes;
# tools/ is only the thin functions the adapters expose.
ALLOWED = {
    "knowledge": {"schemas"},
    "validators": {"schemas", "knowledge"},
    "physics": set(CORE),
    "planning": {*CORE, "physics"},
    "diagnosis": {*CORE, "physics", "planning"},
    "rendering": {*CORE, "physics"},
    "tools": {*CORE, "physics", "planning", "diagnosis", "rendering"},
}


def _module_name(path: Path) -> str:
    parts = ("mcore_advisor", *path.relative_to(PKG).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_imports(path: Path, known: set[str]) -> set[str]:
    """Package modules `path` imports anywhere in it (lazy imports too), relative imports resolved."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return {m for m in out if m in known}


@pytest.mark.parametrize("path", _modules(""), ids=lambda p: str(p.relative_to(PKG)))
def test_only_the_profile_entry_imports_torch_or_megatron(path):
    if "launcher/entry" in path.as_posix():
        return
    assert not (_top(_imports(path)) & HEAVY), f"{path.relative_to(PKG)} imports {_top(_imports(path)) & HEAVY}"


@pytest.mark.parametrize("path", [p for sub in ALLOWED for p in _modules(sub)] + [PKG / "schemas.py"],
                         ids=lambda p: str(p.relative_to(PKG)))
def test_the_core_does_no_io_and_never_imports_upward(path):
    names = _imports(path)
    upward = {n for n in names if n.startswith(("mcore_advisor.launcher", "mcore_advisor.server", "mcore_advisor.cli"))}
    assert not upward, f"{path.relative_to(PKG)} imports {upward}"
    assert not (_top(names) & IO), f"{path.relative_to(PKG)} imports {_top(names) & IO}"


@pytest.mark.parametrize("path", _modules("launcher/entry"), ids=lambda p: str(p.relative_to(PKG)))
def test_the_profile_entry_needs_nothing_but_torch_megatron_and_the_stdlib(path):
    # It runs on GPU images without pydantic: only its own package, the stdlib (+ torch/megatron/TE) and
    # physics/anatomy.py (the one layer description, stdlib-only: the job's FLOPs are the core's by construction).
    names = {n for n in _imports(path) if n.startswith("mcore_advisor")}
    allowed = ("mcore_advisor.launcher.entry", "mcore_advisor.physics.anatomy")
    assert all(n.startswith(allowed) for n in names), names
    assert "pydantic" not in _top(_imports(path))


def test_nothing_imports_the_adapters():
    for path in _modules(""):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith("server/") or rel == "cli.py":
            continue
        names = _imports(path)
        assert not {n for n in names if n.startswith(("mcore_advisor.server", "mcore_advisor.cli"))}, rel


@pytest.mark.parametrize("sub", sorted(ALLOWED))
def test_each_part_of_the_core_imports_only_the_parts_below_it(sub):
    for path in _modules(sub):
        parts = {n.split(".")[1] for n in _imports(path) if n.startswith("mcore_advisor.")}
        wrong = parts - ALLOWED[sub] - {sub}
        assert not wrong, f"{path.relative_to(PKG)} imports mcore_advisor.{sorted(wrong)}; allowed: {sorted(ALLOWED[sub])}"


def test_the_import_graph_has_no_cycle():
    paths = {_module_name(p): p for p in _modules("")}
    graph = {m: _package_imports(p, set(paths)) - {m} for m, p in paths.items()}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m not in done:
            for n in sorted(graph[m]):
                visit(n, path + [m])
            done.add(m)

    for m in sorted(graph):
        visit(m, [])
