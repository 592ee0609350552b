"""`plan` and `cache info` read at 80 columns: no line wider, no name cut ("cuda…"), per-strategy
notes and long JSON below their tables."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from realfiles import RealFiles, real_files

ROOT = Path(__file__).parents[2]
STRATEGIES = ("cuda:0", "balanced", "sequential", "balanced_low_0", "model-offload")


def _narrow(*args: str) -> list[str]:
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-m", "wandistill", *args], capture_output=True, text=True, env=env
    )
    assert p.returncode == 0, p.stderr
    lines = (p.stdout + p.stderr).splitlines()
    assert [line for line in lines if len(line.rstrip()) > 80] == []
    assert "…" not in p.stdout + p.stderr  # rich's ellipsis: a cut name
    return lines


@pytest.mark.slow  # a fresh interpreter at COLUMNS=80
def test_plan_at_80_columns_keeps_every_strategy_name_whole() -> None:
    lines = _narrow(
        "plan", "wan2.1-14b_4x80gb", "--config", "wan2.1-14b",
        "--gpus", "4", "--gpu-mem", "80GiB", "--cpu-mem", "512GiB",
    )  # fmt: skip
    rows = [line for line in lines if line.startswith("│")]
    for name in STRATEGIES:
        assert any(f"│ {name} " in row for row in rows), name
        assert any(re.match(rf"\d+ {re.escape(name)}[ :]", line) for line in lines), name


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> RealFiles:
    return real_files(tmp_path_factory.mktemp("real"))


@pytest.mark.slow  # a fresh interpreter at COLUMNS=80
def test_cache_info_at_80_columns_puts_the_scheduler_json_below_its_table(
    real: RealFiles,
) -> None:
    lines = _narrow("cache", "info", str(real.wds))
    assert any("scheduler_config" in row and "(below)" in row for row in lines)
    at = lines.index("scheduler_config:")
    assert lines[at + 1] == "{" and '"num_train_timesteps": 1000,' in lines[at + 2]
