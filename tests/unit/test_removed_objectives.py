"""The objectives that lost (loss.trajectory, loss.reflow, loss.consistency and its target decay):
an old recipe or `--set` naming one is refused by the CLI with one line naming the key and the
fix, before anything is written. (A checkpoint holding consistency's target:
tests/unit/test_train_checkpoint.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from wandistill.config.common import REMOVED

from clirun import run_cli as _run

REMOVED_KEYS = ["trajectory", "reflow", "consistency", "consistency_target_decay"]


def _refused(code: int, err: str, key: str, out: Path) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert lines[0].startswith("error: ") and len(lines) == 2, err
    assert lines[0].endswith(f"train.loss.{key} was removed ({REMOVED['loss.' + key][0]})")
    assert lines[1].strip().startswith(f"fix: delete train.loss.{key}")
    assert "did you mean" not in err and "Traceback" not in err
    assert not out.exists()  # nothing written


@pytest.mark.parametrize("key", REMOVED_KEYS)
def test_a_removed_objective_key_in_set_is_one_error_naming_it_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str
) -> None:
    out = tmp_path / "run"
    code, _, err = _run(
        capsys, "train", "tiny", "--cache", tmp_path / "c", "--out", out, "--set", f"loss.{key}=0.5"
    )
    _refused(code, err, key, out)
    if key != "consistency_target_decay":
        assert "loss.perflow = 1 or loss.unroll = 1" in err and "docs/benchmarks.md" in err


@pytest.mark.parametrize("key", REMOVED_KEYS)
def test_a_removed_objective_key_in_an_old_recipe_is_one_error_naming_it_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str
) -> None:
    recipe = tmp_path / "old.toml"
    recipe.write_text(f"[train.loss]\noutput = 1.0\n{key} = 0.0\n")
    out = tmp_path / "run"
    code, _, err = _run(capsys, "train", recipe, "--cache", tmp_path / "c", "--out", out)
    _refused(code, err, key, out)
