"""The README's two commands stay true: CI runs exactly the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text, flags=re.S)[:2]


def test_readme_opens_with_the_demo_and_the_test_command() -> None:
    demo, tests = _commands()
    assert demo.rstrip().endswith("wandistill demo")
    assert "pip install torch==2.13.0" in demo
    assert "pytest" in tests


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    _, tests = _commands()
    test_cmd = tests.split("&&")[-1].strip()
    assert test_cmd in (ROOT / ".ci" / "run").read_text()
