"""`wandistill launch`: torchrun's flags, then the stage; what it refuses before starting ranks."""

from __future__ import annotations

import pytest

from wandistill.errors import UsageError
from wandistill.runtime.launch import split

from clirun import run_cli


def test_the_flags_before_the_stage_go_to_torchrun_and_the_rest_is_the_command() -> None:
    flags, command = split(["--standalone", "--nproc_per_node", "2", "train", "tiny", "--steps"])
    assert flags == ["--standalone", "--nproc_per_node", "2"]
    assert command == ["train", "tiny", "--steps"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--nproc_per_node=2"], "needs a command to run (precompute or train)"),
        (["--nproc_per_node=2", "eval", "x"], "needs a command to run"),
        (["--nproc_per_node=2", "-m", "wandistill", "train"], "-m is not a flag it passes"),
        (["--no-python", "train"], "--no-python is not a flag it passes"),
    ],
)
def test_a_launch_without_a_stage_or_with_its_own_module_is_refused(
    args: list[str], says: str
) -> None:
    with pytest.raises(UsageError, match=says.replace("(", r"\(").replace(")", r"\)")):
        split(args)


def test_an_unknown_torchrun_flag_is_one_line_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run_cli(capsys, "launch", "--bogus-flag", "2", "train", "tiny")
    assert code == 2, err
    assert "error: torchrun's flags: unrecognized arguments: --bogus-flag" in err
    assert "fix: `torchrun --help` lists them" in err and "usage:" not in err
