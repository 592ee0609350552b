"""One failures module for both stages: the same out-of-memory rule, the same stop mechanism,
each stage's own wording kept."""

from __future__ import annotations

import signal

import pytest
import torch

from wandistill.config import TrainConfig
from wandistill.precompute.finish import _stopped
from wandistill.runtime import dist
from wandistill.runtime.failures import StopRequested, StopSignals, is_oom
from wandistill.train.loop import explain_failure, stopped

SOLO = dist.DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        MemoryError(),
        RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 GB"),
        RuntimeError("[enforce fail at alloc_cpu.cpp:117] can't allocate memory"),
    ],
)
def test_train_explains_every_out_of_memory_error_the_teacher_side_does(error: Exception) -> None:
    assert is_oom(error)
    friendly = explain_failure(error, TrainConfig(), SOLO, None)
    assert friendly is not None and "out of memory while training" in str(friendly)
    assert friendly.fix and "then re-run with --resume" in friendly.fix


def test_an_error_that_is_not_out_of_memory_keeps_its_traceback() -> None:
    assert not is_oom(RuntimeError("shape mismatch"))
    assert explain_failure(RuntimeError("shape mismatch"), TrainConfig(), SOLO, None) is None


def test_each_stage_says_how_far_it_got_and_how_to_go_on() -> None:
    pre = _stopped(signal.SIGTERM, 12, SOLO)
    assert str(pre) == "stopped by SIGTERM after 12 records; re-run the same command to resume"
    two = dist.DistInfo(rank=1, world_size=2, local_rank=1, device=SOLO.device, backend="gloo")
    train = stopped(signal.SIGINT, 40, two)
    assert str(train) == "stopped by SIGINT at step 40 (rank 1 of 2); resume with --resume"
    assert (pre.exit_code, train.exit_code) == (143, 130)


def test_a_signal_interrupts_only_inside_an_interruptible_section() -> None:
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the suite runs in the background
    with StopSignals.install() as stop:
        signal.raise_signal(signal.SIGTERM)  # outside: recorded, acted on at the next check
        assert stop.signum == signal.SIGTERM
        with pytest.raises(StopRequested):
            stop.check()
    again = StopSignals.install()
    try:
        with pytest.raises(StopRequested), again.interruptible():
            signal.raise_signal(signal.SIGINT)  # inside: at once
    finally:
        again.restore()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_stop_re_typed_by_library_code_in_an_interruptible_section_is_still_the_stop() -> None:
    """Raised while native code runs, the handler's StopRequested can come out as the library's
    own error (a ValueError that the embedding reader then called a damaged shard)."""
    stop = StopSignals.install()
    try:
        with pytest.raises(StopRequested) as got, stop.interruptible():
            try:
                signal.raise_signal(signal.SIGTERM)
            except StopRequested as e:  # what a C extension does with an error it did not raise
                raise ValueError("could not determine the shape of object type") from e
        assert isinstance(got.value.__cause__, ValueError)
    finally:
        stop.restore()
    with StopSignals.install() as quiet, pytest.raises(ValueError), quiet.interruptible():
        raise ValueError("a real error, no signal: passes through as it is")


def test_first_line_drops_library_source_tags_but_keeps_the_peer_address():
    from wandistill.runtime.dist import first_line

    c10d = RuntimeError(
        "[c10d] The client socket has failed to connect to [node-0.cluster]:29500 (errno: 110)"
        "\nmore"
    )
    gloo = RuntimeError(
        "[../third_party/gloo/transport/tcp/pair.cc:537] Connection closed by peer [10.0.0.2]:1234"
    )
    assert first_line(c10d) == (
        "The client socket has failed to connect to [node-0.cluster]:29500 (errno: 110)"
    )
    assert first_line(gloo) == "Connection closed by peer [10.0.0.2]:1234"
    assert first_line(ValueError("")) == "ValueError"
    assert len(first_line(RuntimeError("x" * 1000))) == 300
