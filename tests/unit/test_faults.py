"""Fault injection is one mechanism: `wandistill.runtime.faults.at`, driven by WANDISTILL_FAULT."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wandistill.errors import UsageError, WandistillError
from wandistill.runtime import faults

PACKAGE = Path(__file__).parents[2] / "wandistill"


def test_unset_the_hook_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.at("train", "step", 3, 0) is False
    assert faults.wants("train", "step", 3, 0) is None


def test_only_the_named_point_count_and_rank_act(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.ENV, "train:step:3:1:raise")
    assert faults.wants("train", "step", 3, 1) == "raise"
    for other in (("train", "step", 2, 1), ("train", "step", 3, 0), ("train", "saved", 3, 1)):
        assert faults.at(*other) is False
    with pytest.raises(WandistillError, match="injected failure on rank 1 at train step 3"):
        faults.at("train", "step", 3, 1)


def test_the_oom_action_raises_what_a_real_out_of_memory_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(faults.ENV, "train:step:2:*:oom")
    with pytest.raises(torch.OutOfMemoryError, match="injected out-of-memory on rank 5"):
        faults.at("train", "step", 2, 5)


def test_the_nan_action_is_returned_to_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.ENV, "train:loss:4:0:nan")
    assert faults.at("train", "loss", 4, 0) is True


def test_a_malformed_spec_is_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(faults.ENV, "train:step:2:0:explode")
    with pytest.raises(UsageError, match=faults.ENV):
        faults.at("train", "step", 2, 0)


def test_no_other_fault_channel_is_read_anywhere_in_the_package() -> None:
    sources = {p: p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py")}
    old_channels = (
        "WANDISTILL_" + "FAIL_AT",
        "WANDISTILL_" + "TEST_KILL_AT",
        "injected_" + "failure",
    )
    for old in old_channels:  # spelled in pieces so that layout_rewrite.py leaves them
        assert [p for p, s in sources.items() if old in s] == [], old
    readers = [p.name for p, s in sources.items() if "faults.ENV" in s or '"WANDISTILL_FAULT"' in s]
    assert readers == ["faults.py"]
