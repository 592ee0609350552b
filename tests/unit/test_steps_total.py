"""`--steps` is the run's total: `--resume` at or past it names the next total and exits 0
without touching the run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from clirun import run_cli
from realfiles import RealFiles, real_files, tree_digest


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> RealFiles:
    return real_files(tmp_path_factory.mktemp("real"))


@pytest.mark.parametrize("steps", ["2", "1"])
def test_resume_at_or_past_the_total_says_so_and_changes_nothing(
    real: RealFiles, tmp_path: Path, capsys: pytest.CaptureFixture[str], steps: str
) -> None:
    run = Path(shutil.copytree(real.run, tmp_path / "run"))
    before = tree_digest(run)
    args = real.train_args(real.wds, run, "--resume")
    args[args.index("--steps") + 1] = steps
    code, out, err = run_cli(capsys, *args)
    assert code == 0, out + err
    assert f"already at 2 steps; pass --steps {2 + int(steps)} to continue" in out
    assert tree_digest(run) == before


def test_train_help_says_steps_is_the_total(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "train", "--help")
    assert code == 0 and "Total optimizer steps" in " ".join(out.split())
