"""Joining a job has a deadline and names who is missing (in-process, no torchrun: one rank of
two is started, the other never comes). torchrun cases: tests/integration/test_dist_timeouts.py.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch

from wandistill.errors import UsageError
from wandistill.runtime import dist, waiting


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    yield
    dist.cleanup()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, timeout: str = "1") -> None:
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WANDISTILL_DIST_TIMEOUT": timeout,
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)


def test_rank_0_names_the_rank_that_never_joined(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """...and, before giving up, says once what it waits for (a manual WORLD_SIZE=2 launch
    with no peer was silent for the whole timeout)."""
    _as_rank(monkeypatch, 0)
    monkeypatch.setattr(waiting, "NOTICE_S", 0.2)
    with pytest.raises(
        dist.DistTimeout,
        match=r"rank 0 of 2: rank 1 has not joined the job "
        r"within 1 s \(WANDISTILL_DIST_TIMEOUT\)",
    ):
        dist.init("cpu")
    err = capsys.readouterr().err
    assert err.count("waiting: for rank 1 of 2 to have joined the job; giving up after 1 s") == 1


def test_a_rank_whose_store_host_never_comes_names_rank_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _as_rank(monkeypatch, 1)
    monkeypatch.setattr(waiting, "NOTICE_S", 0.2)
    with pytest.raises(
        dist.DistTimeout,
        match=r"rank 1 of 2: no rendezvous at 127.0.0.1:\d+ "
        r"within 1 s; rank 0, which hosts it, never arrived",
    ):
        dist.init("cpu")
    assert "waiting: rank 1 of 2: for rank 0 to host the rendezvous" in capsys.readouterr().err


@pytest.mark.parametrize("raw", ["abc", "0", "-5", "nan", "1e9"])
def test_a_bad_timeout_in_the_environment_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv("WANDISTILL_DIST_TIMEOUT", raw)
    with pytest.raises(UsageError, match=r"WANDISTILL_DIST_TIMEOUT="):
        dist.resolve_timeout()
    assert dist.resolve_timeout(30.0) == 30.0  # the recipe's value wins


def test_the_default_timeout_is_minutes_not_half_an_hour(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDISTILL_DIST_TIMEOUT", raising=False)
    assert dist.resolve_timeout() == 300.0
