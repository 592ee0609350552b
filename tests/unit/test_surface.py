"""Small pieces behind what users see: the quiet switch, the plots, the run settings file and the
modes of what we publish."""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import warnings
from pathlib import Path

import pytest
from PIL import Image

from wandistill.io import fsutil
from wandistill.plots import _eval_bars, loss_curves, plot_eval_metrics, plot_loss
from wandistill.runtime import quiet


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No switch set by an earlier in-process CLI call; `quiet`'s memory of what it set reset."""
    for key in quiet.QUIET_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(quiet, "_set_by_us", {})
    for name in quiet.LOGGERS:
        monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)


def test_quiet_by_default_and_verbose_restores_what_it_set(clean_env: None) -> None:
    with warnings.catch_warnings():
        assert quiet.configure(verbose=False) is False
        assert {k: os.environ[k] for k in quiet.QUIET_ENV} == quiet.QUIET_ENV
        assert logging.getLogger("diffusers").level == logging.ERROR
        with warnings.catch_warnings(record=True) as caught:
            warnings.warn("a library's deprecation", FutureWarning, stacklevel=1)
        assert caught == []
        assert quiet.configure(verbose=True) is True
        assert [k for k in quiet.QUIET_ENV if k in os.environ] == []
        # back to the library's own default: unset, or WARNING once diffusers' logging module is
        # loaded (an earlier in-process test may have imported it)
        assert logging.getLogger("diffusers").level in (logging.NOTSET, logging.WARNING)


def test_verbose_is_honoured_on_rank_0_only(
    clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    with warnings.catch_warnings():
        assert quiet.configure(verbose=True) is False
        assert os.environ["TQDM_DISABLE"] == "1"


@pytest.mark.parametrize("command", [["recipes"], ["train", "--dry-run"]])
def test_verbose_under_torchrun_is_refused_in_one_line_on_every_rank(
    clean_env: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: list[str],
) -> None:
    from wandistill.cli import main

    for rank in ("0", "1"):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_info:
            main(["-v", *command])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "Traceback" not in err
        lines = [line for line in err.splitlines() if line.strip()]
        assert lines[0].startswith("error: --verbose under torchrun (2 ranks)"), err
        assert len(lines) == 2 and "fix:" in lines[1] and "without torchrun" in err


def test_a_users_own_setting_wins(clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")
    with warnings.catch_warnings():
        quiet.configure(verbose=False)
        quiet.configure(verbose=True)
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "info"


def test_loss_curves_take_every_term_the_last_row_of_a_step_and_only_finite_values() -> None:
    rows = [
        {"event": "start", "step": 0},
        {"step": 1, "loss": 2.0, "loss_output": 1.5, "loss_perflow": 0.5, "lr": 1e-3},
        {"step": 2, "loss": 9.0, "loss_output": math.inf, "loss_perflow": 0.4},
        {"step": 2, "loss": 1.0, "loss_output": 0.7, "loss_perflow": 0.3},  # after a resume
        {"event": "end", "step": 2},
    ]
    assert loss_curves(rows) == {
        "loss": ([1, 2], [2.0, 1.0]),
        "loss_output": ([1, 2], [1.5, 0.7]),
        "loss_perflow": ([1, 2], [0.5, 0.3]),
    }


def test_plots_are_pngs_written_in_place(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1 / s, "loss_output": 0.5 / s}) for s in (1, 2, 3)]
    metrics.write_text("\n".join(lines) + '\n{"step": 4, "lo')  # a killed run's last line
    (tmp_path / "eval.json").write_text(
        json.dumps({"records": 4, "steps": 2, "latent_mse": 0.1, "noise_mse": 1.0,
                    "latent_psnr": 20.0, "per_record": [], "grid": "grid.png"})
    )  # fmt: skip
    for path in (
        plot_loss(metrics, tmp_path / "loss.png"),
        plot_eval_metrics(tmp_path / "eval.json", tmp_path / "metrics.png"),
    ):
        with Image.open(path) as img:
            assert img.format == "PNG" and img.size[0] >= 600
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "eval.json",
        "loss.png",
        "metrics.jsonl",
        "metrics.png",
    ]  # no temp file left


def test_eval_bars_read_both_eval_json_layouts_and_leave_out_the_reference() -> None:
    flat = {"records": 4, "steps": 2, "latent_mse": 0.1, "noise_mse": 1.0, "latent_psnr": 20.0,
            "image_psnr": None, "per_record": [], "grid": "grid.png"}  # fmt: skip
    assert _eval_bars(flat) == ({"latent_mse": 0.1, "noise_mse": 1.0}, {"latent_psnr": 20.0})
    columns = {"records": 4, "num_inference_steps": 2, "columns": [
        {"name": "teacher@8", "role": "reference", "latent_mse": 0.0, "latent_psnr": 99.0},
        {"name": "student@2", "role": "student", "latent_mse": 0.2, "latent_psnr": 21.0,
         "image_psnr": 30.0},
        {"name": "noise", "role": "noise", "latent_mse": 1.0, "latent_psnr": math.nan},
    ]}  # fmt: skip
    assert _eval_bars(columns) == (
        {"student@2": 0.2, "noise": 1.0},
        {"student@2": 21.0, "student@2 (image)": 30.0},
    )


def test_a_legacy_runs_config_json_becomes_run_json(tmp_path: Path) -> None:
    from wandistill.io import outputs
    from wandistill.train.records import write_run_settings

    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "config.json").write_text(json.dumps({"train": {"steps": 2}}))
    assert outputs.owner(tmp_path) == "run"  # an earlier version's run is still adopted
    write_run_settings(tmp_path, {"train": {"steps": 4}})
    assert json.loads((tmp_path / "run.json").read_text()) == {"train": {"steps": 4}}
    assert not (tmp_path / "config.json").exists()


def test_published_folders_get_umask_modes_and_links_are_left_alone(tmp_path: Path) -> None:
    mask = fsutil.umask()
    tmp = fsutil.make_temp_dir(tmp_path, "out")
    (tmp / "sub").mkdir(mode=0o700)
    (tmp / "sub" / "w.safetensors").write_bytes(b"x")
    (tmp / "sub" / "w.safetensors").chmod(0o600)
    (tmp / "tool").write_bytes(b"#!/bin/sh\n")
    (tmp / "tool").chmod(0o700)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp / "link").symlink_to(tmp_path / "elsewhere")
    fsutil.publish(tmp, tmp_path / "out")
    out = tmp_path / "out"

    def mode(p: Path) -> int:
        return stat.S_IMODE(p.lstat().st_mode)

    assert mode(out) == mode(out / "sub") == mode(out / "tool") == 0o777 & ~mask
    assert mode(out / "sub" / "w.safetensors") == 0o666 & ~mask
    assert mode(tmp_path / "elsewhere") == 0o700  # a link's target is not ours to change
