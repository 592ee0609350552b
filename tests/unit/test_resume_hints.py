"""Every interruption hint names the command that resumes it, exactly: train's adds --resume to
the command as run, the demo's is the demo itself (it resumes its runs), precompute's is itself."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from wandistill import demo
from wandistill.config import TrainConfig
from wandistill.runtime.failures import Stopped

from clirun import run_cli


def _stop(resume: str, flag: str = "") -> Stopped:
    return Stopped(signal.SIGTERM, "at step 3", None, resume, resume_flag=flag)


def test_a_stopped_train_names_its_own_command_plus_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def stopped(*_: object, **__: object) -> None:
        raise _stop("resume with --resume", "--resume")

    monkeypatch.setattr("wandistill.train.run", stopped)
    args = ["train", "tiny", "--cache", str(tmp_path / "c"), "--out", str(tmp_path / "r")]
    code, _, err = run_cli(capsys, *args, "--steps", "5")
    assert code == 128 + signal.SIGTERM
    fix = [line.strip() for line in err.splitlines() if "fix:" in line]
    assert fix == [f"fix: to resume, run: wandistill {' '.join(args)} --steps 5 --resume"]


def test_a_stopped_demo_says_to_re_run_the_demo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def stopped(*_: object, **__: object) -> None:
        raise _stop("resume with --resume", "--resume")

    monkeypatch.setattr("wandistill.train.run", stopped)
    with pytest.raises(Stopped) as caught:
        demo._train(TrainConfig(out=str(tmp_path / "run")))
    assert caught.value.resume_flag == ""  # `wandistill demo --resume` does not exist
    assert "re-run the demo to resume" in caught.value.message
    assert "--resume" not in caught.value.message


def test_a_stopped_rank_of_wandistill_launch_names_the_launch_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from wandistill.runtime.dist import DistInfo

    def stopped(*_: object, **__: object) -> None:
        raise _stop("resume with --resume", "--resume")

    alone = DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), backend=None)
    monkeypatch.setattr("wandistill.train.job.join", lambda *_, **__: alone)  # no rendezvous
    monkeypatch.setattr("wandistill.train.run", stopped)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("WANDISTILL_LAUNCH", "wandistill launch --standalone --nproc_per_node=2")
    args = ["train", "tiny", "--cache", str(tmp_path / "c"), "--out", str(tmp_path / "r")]
    code, _, err = run_cli(capsys, *args)
    assert code == 128 + signal.SIGTERM
    fix = [line.strip() for line in err.splitlines() if "fix:" in line]
    launch = "wandistill launch --standalone --nproc_per_node=2"
    assert fix == [f"fix: to resume, run: {launch} {' '.join(args)} --resume"]
