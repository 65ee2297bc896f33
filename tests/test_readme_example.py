"""The README's worked example is the tool's own output: this test reruns its two commands through the CLI
and compares them with the README's blocks (the search rate, which depends on the machine, masked).
UPDATE_README=1 rewrites the two blocks from the current output."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from pathlib import Path

from mcore_advisor.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"
RECOMMEND = ["recommend", "--model", "llama3-70b", "--gpus", "64", "--gpu", "h100-sxm", "--seq-length", "8192",
             "--global-batch-size", "128", "--top", "3"]


def _cli(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue().rstrip("\n")


def _mask(text: str) -> str:
    return re.sub(r"configurations \([\d,]+/s\)", "configurations (N/s)", text)


def _example_blocks(readme: str) -> tuple[int, int, int, int]:
    """(start, end) offsets of the worked example's first two ``` blocks' contents."""
    at = readme.index("## Worked example")
    spans = []
    for _ in range(2):
        start = readme.index("```\n", at) + 4
        end = readme.index("\n```", start)
        spans += [start, end]
        at = end + 4
    return tuple(spans)


def test_readme_worked_example_is_the_tools_output(tmp_path):
    rec = _cli(RECOMMEND)
    plan = json.loads(_cli([*RECOMMEND, "--json"]))["plans"][0]["plan"]
    best = tmp_path / "best.json"
    best.write_text(json.dumps(plan))
    mem = _cli(["memory", str(best)])
    readme = README.read_text()
    s1, e1, s2, e2 = _example_blocks(readme)
    if os.environ.get("UPDATE_README", "") not in ("", "0"):
        readme = readme[:s1] + rec + readme[e1:s2] + mem + readme[e2:]
        README.write_text(readme)
        s1, e1, s2, e2 = _example_blocks(readme)
    assert "mcore-advisor " + " ".join(RECOMMEND[:-2]) in readme  # the command the block is the output of
    assert _mask(readme[s1:e1]) == _mask(rec)
    assert readme[s2:e2] == mem
