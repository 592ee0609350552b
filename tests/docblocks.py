"""Command blocks a user is told to copy (README "Examples", docs/ single-machine blocks), read
from the Markdown itself, so a test runs exactly what a person reads."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def bash_blocks(markdown: str) -> list[str]:
    """Every ```bash fenced block of a Markdown text, in order."""
    return re.findall(r"```bash\n(.+?)\n```", markdown, flags=re.S)


def readme_examples() -> str:
    """The README's block that follows its "Examples:" line."""
    text = (ROOT / "README.md").read_text()
    after = text.split("\nExamples:\n", 1)[1]
    return bash_blocks(after)[0]


def commands(block: str, tmp: Path) -> list[str]:
    """The block's commands, one per logical line (backslash continuations joined), comments
    kept (bash drops them), `/tmp/` rewritten to TMP/ and nothing else."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = [ln for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return [ln.replace("/tmp/", f"{tmp}/") for ln in lines]


MARK = "<!-- runs as written: tests/integration/test_readme_examples.py -->"
"""Put before a docs/ ```bash block a person is told to copy: the test then runs it."""


def marked_blocks(markdown: str) -> list[str]:
    """The ```bash blocks right after a MARK line."""
    return re.findall(re.escape(MARK) + r"\n```bash\n(.+?)\n```", markdown, flags=re.S)


def distributed_single_machine() -> list[str]:
    """docs/distributed.md's single-machine blocks (marked)."""
    return marked_blocks((ROOT / "docs" / "distributed.md").read_text())
