"""Every ```python block of README.md runs when pasted into a fresh interpreter.

A block is left out only with a marker on the line just above it, ``<!-- readme-test: skip (why) -->``,
saying why (e.g. it needs a GPU or several machines).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\s*\((?P<why>[^)]+)\)\s*-->\s*$")


def python_blocks(text: str) -> list[tuple[str, str, str | None]]:
    """``(name, code, why skipped or None)`` of every ```python block; the name is its section heading
    (with ``#k`` for the k-th block of a section)."""
    blocks, heading, seen = [], "top", {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not line.startswith("#!"):
            heading = line.lstrip("#").strip()
        if line.strip() == "```python":
            end = lines.index("```", i + 1)
            seen[heading] = seen.get(heading, 0) + 1
            name = heading if seen[heading] == 1 else f"{heading} #{seen[heading]}"
            marker = SKIP.search(lines[i - 1]) if i else None
            blocks.append((name, "\n".join(lines[i + 1 : end]) + "\n", marker["why"] if marker else None))
            i = end
        i += 1
    return blocks


BLOCKS = python_blocks(README.read_text())


def test_blocks_are_found_and_every_skip_says_why() -> None:
    assert len(BLOCKS) >= 5
    assert all(why is None or why.strip() for _, _, why in BLOCKS)
    assert python_blocks("# A\n<!-- readme-test: skip (needs a GPU) -->\n```python\nx = 1\n```\n") == [
        ("A", "x = 1\n", "needs a GPU")
    ]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "code", "why"), BLOCKS, ids=[name for name, _, _ in BLOCKS])
def test_readme_block_runs(name: str, code: str, why: str | None, tmp_path: Path) -> None:
    if why is not None:
        pytest.skip(f"README marks it: {why}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"README block {name!r} failed:\n{result.stderr[-3000:]}"
