"""`train` on several caches in one process: one dataset, every cache in the reader's state;
caches of other settings and bad weights refused before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from wandistill.config import load_recipe
from wandistill.errors import CacheMismatchError, ConfigError
from wandistill.train import run
from wandistill.train.checkpoint import resolve_latest
from wandistill.train.checkpoint_read import check_state

from cachefixtures import SETTINGS, write_cache

SIZES = (
    "student.num_layers=1",
    "student.num_attention_heads=2",
    "student.attention_head_dim=12",
    "student.ffn_dim=32",
)


def _sets(caches: list[Path], out: Path, *extra: str) -> list[str]:
    listed = ", ".join(f'"{c}"' for c in caches)
    return [
        f"cache=[{listed}]",
        f'out="{out}"',
        "steps=4",
        "batch_size=2",
        "checkpoint_every=4",
        "log_every=2",
        "data_threads=2",
        'device="cpu"',
        "tensorboard=false",
        *SIZES,
        *extra,
    ]


def test_train_on_two_caches_checkpoints_a_reader_state_covering_both(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_cache(a, range(3))
    write_cache(b, range(3, 7), backend="zarr")
    cfg = load_recipe(None, _sets([a, b], tmp_path / "run", "cache_weights=[1, 3]"), stage="train")
    r = run(cfg.train)
    assert r.steps == 4 and not r.corrupt
    assert (tmp_path / "run" / "student" / "config.json").is_file()
    _, state, _ = check_state(resolve_latest(tmp_path / "run" / "checkpoints"))
    reader = state["reader"]
    assert reader["caches"] == [str(a), str(b)] and reader["weights"] == [1.0, 3.0]
    assert reader["batches_done"] == 4  # 21 samples / 2 = 10 steps an epoch: still epoch 0


def test_caches_of_other_settings_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    write_cache(tmp_path / "a", range(3))
    write_cache(tmp_path / "b", range(3, 6), settings={**SETTINGS, "num_frames": 9})
    cfg = load_recipe(
        None, _sets([tmp_path / "a", tmp_path / "b"], tmp_path / "run"), stage="train"
    )
    with pytest.raises(CacheMismatchError, match="settings.num_frames"):
        run(cfg.train)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("weights", ["[1, 0]", "[1]", "[-1, 2]"])
def test_weights_that_are_not_one_positive_number_a_cache_are_refused(
    tmp_path: Path, weights: str
) -> None:
    with pytest.raises(ConfigError, match="train.cache_weights") as e:
        load_recipe(
            None,
            _sets([tmp_path / "a", tmp_path / "b"], tmp_path / "o", f"cache_weights={weights}"),
            stage="train",
        )
    assert e.value.fix and "\n" not in e.value.message


def test_cli_names_the_mismatch_and_the_bad_weight_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from clirun import run_cli

    write_cache(tmp_path / "a", range(3))
    write_cache(tmp_path / "b", range(3, 6), settings={**SETTINGS, "guidance_scale": 3.0})
    write_cache(tmp_path / "c", range(6, 9))
    base = ["train", "--out", tmp_path / "run", "--cache", tmp_path / "a"]
    code, _, err = run_cli(capsys, *base, "--cache", tmp_path / "b")
    assert code != 0 and "Traceback" not in err
    assert "settings.guidance_scale" in err and str(tmp_path / "b") in err and "fix:" in err
    code, _, err = run_cli(
        capsys, *base, "--cache", tmp_path / "c", "--set", "train.cache_weights=[2, 0]"
    )
    assert code != 0 and "train.cache_weights[1]=0" in err and "fix:" in err
    assert not (tmp_path / "run").exists()
