"""Run the wandistill CLI in this process, the way a test reads it: (exit code, stdout, stderr)."""

from __future__ import annotations

from pathlib import Path

import pytest

from wandistill.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """`wandistill ARGS...` in-process; a usage error or a failure is its exit code, not raised."""
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err
