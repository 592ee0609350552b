"""How a stage fails or stops, one mechanism for precompute and train: stop signals, the
out-of-memory rule and lost peers.

* `StopSignals`: SIGTERM / SIGINT -> a graceful stop. The first signal is recorded; a stage
  either polls it (`check()` between units of work, `agreed()` at train's step boundaries, a
  collective) or, inside `interruptible()` (nothing being written), is interrupted at once by
  `StopRequested`. A second Ctrl-C is KeyboardInterrupt at once. Each stage turns the stop into
  `Stopped` (exit 128 + signal, "what is committed, how to resume").
* `is_oom`: the one rule for "this error means out of memory" (CUDA, Python's MemoryError and
  the CPU allocator's RuntimeErrors); the advice that follows is the stage's own
  (wandistill/placement/oom.py for placements, wandistill/train/oom.py for training levers).
* `is_collective_failure` / `collective_error`: a peer went away mid-collective, as one line
  instead of a gloo / nccl traceback.
* Test-only fault injection is `wandistill.runtime.faults` (one hook, one variable).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch

from wandistill.errors import WandistillError
from wandistill.runtime import dist

__all__ = [
    "Stopped",
    "StopRequested",
    "StopSignals",
    "collective_error",
    "is_collective_failure",
    "is_oom",
]

# --------------------------------------------------------------------------- stop signals


class Stopped(WandistillError):
    """A stage stopped on SIGTERM / SIGINT; what it wrote is committed. Exit 128 + signal.

    `progress` says how far it got ("after 12 records", "at step 40"), `resume` how to go on."""

    def __init__(
        self,
        signum: int,
        progress: str,
        info: dist.DistInfo | None,
        resume: str,
        *,
        resume_flag: str = "",
    ) -> None:
        where = f" (rank {info.rank} of {info.world_size})" if info and info.distributed else ""
        super().__init__(f"stopped by {signal.Signals(signum).name} {progress}{where}; {resume}")
        self.signum = signum
        self.exit_code = 128 + signum
        self.progress = progress
        self.info = info
        self.resume_flag = resume_flag
        """What the interrupted command needs added to resume ("--resume" for train, nothing
        for precompute and the demo, which resume themselves): the CLI prints the command."""


class StopRequested(BaseException):
    """Raised by the signal handler inside an interruptible section (nothing being written)."""


class StopSignals:
    """SIGTERM / SIGINT -> a graceful stop; installed once, around the whole stage (main thread).

    The first signal is recorded. Inside `interruptible()` (loading, encoding, denoising: nothing
    is being written) it raises `StopRequested` at once, dropping the work under way; elsewhere
    (writes, flushes, collectives) the stage stops at its next `check()` / `agreed()`, so nothing
    is published half-written and no rank is left in a collective. Later signals are ignored, the
    stop is under way (a Ctrl-C under torchrun brings SIGINT from the terminal and SIGTERM from
    torchrun), except a second Ctrl-C: KeyboardInterrupt, at once.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._armed = False
        self._previous: dict[int, Any] = {}

    @classmethod
    def install(cls) -> StopSignals:
        self = cls()
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def restore(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()

    def __enter__(self) -> StopSignals:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            if self._armed:
                self._armed = False
                raise StopRequested
        elif signum == self.signum == signal.SIGINT:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A section the first signal interrupts at once. The handler's `StopRequested` can
        reach us re-typed: raised while torch or safetensors ran native code, it comes out as
        that library's error (a ValueError from a tensor half-built, which the embedding reader
        then reported as a damaged shard). So any exception once a signal arrived here is the
        stop, with the library's error chained."""
        self._armed = True
        try:
            self.check()
            yield
        except StopRequested:
            raise
        except Exception as e:
            if self.signum is None:
                raise
            raise StopRequested from e
        finally:
            self._armed = False

    def check(self) -> None:
        if self.signum is not None:
            raise StopRequested

    def agreed(self, info: dist.DistInfo) -> int:
        """The signal to stop on if any rank got one (a collective: every rank calls it), else 0."""
        return int(dist.all_reduce_max(info, float(self.signum or 0)))


# --------------------------------------------------------------------------- classification

_OOM_TEXT = (
    "out of memory",
    "not enough memory",
    "can't allocate memory",
    "cannot allocate memory",
)


def is_oom(exc: BaseException) -> bool:
    """True for CUDA OOM, Python MemoryError and the CPU allocator's "not enough memory"."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in _OOM_TEXT)
    )


_PEER_LOST = ("gloo", "nccl", "connection reset", "connection closed", "broken pipe")


def is_collective_failure(e: BaseException) -> bool:
    """A collective that failed because a peer went away (gloo raises a plain RuntimeError)."""
    text = str(e).lower()
    return isinstance(e, torch.distributed.DistError) or (
        isinstance(e, RuntimeError) and any(m in text for m in _PEER_LOST)
    )


def collective_error(info: dist.DistInfo, e: BaseException) -> WandistillError:
    """Another rank died mid-collective: say so in one line instead of a gloo/nccl traceback."""
    missing = dist.unresponsive_ranks(info)
    who = (
        f"{dist.ranks_text(missing)} did not answer (stopped, died or hangs)"
        if missing
        else "most likely because another rank stopped"
    )
    return WandistillError(
        f"rank {info.rank}: a collective failed, {who} (see that rank's error): "
        f"{dist.first_line(e)}",
        fix="fix that rank's error, then re-run with --resume",
    )
