"""How a stage fails or stops, one mechanism for precompute and train: stop signals, the
out-of-memory rule, lost peers, and the test-only fault injection.

* `StopSignals`: SIGTERM / SIGINT -> a graceful stop. The first signal is recorded; a stage
  either polls it (`check()` between units of work, `agreed()` at train's step boundaries, a
  collective) or, inside `interruptible()` (nothing being written), is interrupted at once by
  `StopRequested`. A second Ctrl-C is KeyboardInterrupt at once. Each stage turns the stop into
  `Stopped` (exit 128 + signal, "what is committed, how to resume").
* `is_oom`: the one rule for "this error means out of memory" (CUDA, Python's MemoryError and
  the CPU allocator's RuntimeErrors); the advice that follows is the stage's own
  (wandistill/placement/oom.py for placements, wandistill/train/oom.py for training levers).
* `is_collective_failure` / `collective_error` / `first_line`: a peer went away mid-collective,
  as one line instead of a gloo / nccl traceback.
* `at()` / `injected_failure()`: test-only fault injection, see below.

Only the tests set `WANDISTILL_TEST_KILL_AT` or `WANDISTILL_FAIL_AT`; unset (always, in real use),
each hook costs one environment lookup.

    WANDISTILL_TEST_KILL_AT=<stage>:<point>:<n>[:<rank>[:<action>]]

Points (the stages call `at()` there, nowhere else):

    precompute:record:<n>  after this process handed its n-th record of this run to the cache
                           writer (the record may still sit in the open, uncommitted shard);
                           n=0: right after the writer opened the cache, before any record
    train:step:<n>         right after optimizer step n, before its metrics row and checkpoint
    train:saved:<n>        right after the checkpoint of step n was published (every rank)
    train:shard:<n>        right after this rank wrote its shard of sharded (fsdp) checkpoint n,
                           before rank 0 publishes it
    train:loss:<n>         the loss of step n, right after the forward (with the `nan` action)
    precompute:encoded:<n> after this process handed its n-th prompt embedding to the embedding
                           store (it may still sit in the open, uncommitted embedding shard)
    dist:init:0            before this rank joins the job (rendezvous), with `hang`: a rank that
                           never arrives

`<rank>`: the torchrun rank that acts (default 0; `*` = every rank). `<action>`:

    kill   SIGKILL this process at once (default): a crash at exactly this point
    term   send SIGTERM to this process (the graceful-stop path, at a reproducible point)
    int    send SIGINT to this process (same, as Ctrl-C would)
    raise  raise a WandistillError (a rank failing with an error)
    stop   SIGSTOP this process: it stays alive, frozen, holding whatever it holds, until the
           test sends SIGCONT (a second job can then be started against a live one)
    hang   sleep forever (a rank that never arrives / hangs); SIGTERM ends it at once
    nan    make `at()` return True: the caller poisons its value with NaN

`WANDISTILL_FAIL_AT=<rank>:<step>[:error|oom|hang]` makes that train rank fail right after
finishing that optimizer step: `error` raises a runtime error, `oom` a (fake) out-of-memory
error, `hang` blocks forever (for kill -9 tests).

Because the point is counted by the process itself, a seeded list of kill points is exact and
reproducible, and no test has to sleep on the clock to land one.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch

from wandistill.errors import UsageError, WandistillError
from wandistill.runtime import dist

__all__ = [
    "Stopped",
    "StopRequested",
    "StopSignals",
    "at",
    "wants",
    "collective_error",
    "first_line",
    "injected_failure",
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
        self._armed = True
        try:
            self.check()
            yield
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
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        return any(t in text for t in _OOM_TEXT)
    return False


_PEER_LOST = ("gloo", "nccl", "connection reset", "connection closed", "broken pipe")


def is_collective_failure(e: BaseException) -> bool:
    """A collective that failed because a peer went away (gloo raises a plain RuntimeError)."""
    text = str(e).lower()
    return isinstance(e, torch.distributed.DistError) or (
        isinstance(e, RuntimeError) and any(m in text for m in _PEER_LOST)
    )


def first_line(e: BaseException) -> str:
    """An error's first line without gloo's "[.../pair.cc:537]" source tags, at most 300 chars."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return re.sub(r"\[[^\]]*\]:?\s*", "", first)[:300]


def collective_error(info: dist.DistInfo, e: BaseException) -> WandistillError:
    """Another rank died mid-collective: say so in one line instead of a gloo/nccl traceback."""
    missing = dist.unresponsive_ranks(info)
    who = (
        f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not answer "
        "(stopped, died or hangs)"
        if missing
        else "most likely because another rank stopped"
    )
    return WandistillError(
        f"rank {info.rank}: a collective failed, {who} (see that rank's error): {first_line(e)}",
        fix="fix that rank's error, then re-run with --resume",
    )


# --------------------------------------------------------------------------- fault injection

KILL_ENV = "WANDISTILL_TEST_KILL_AT"
FAIL_ENV = "WANDISTILL_FAIL_AT"
ACTIONS = ("kill", "term", "int", "raise", "stop", "hang", "nan")


def at(stage: str, point: str, n: int, rank: int = 0) -> bool:
    """Act if `WANDISTILL_TEST_KILL_AT` names this stage, point, count and rank; True only for
    the `nan` action (the caller then poisons its value)."""
    action = wants(stage, point, n, rank)
    if action is None:
        return False
    if action == "nan":
        return True
    _act(action, f"rank {rank} at {stage} {point} {n}", os.environ[KILL_ENV])
    return False


def wants(stage: str, point: str, n: int, rank: int = 0) -> str | None:
    """The action `WANDISTILL_TEST_KILL_AT` asks for at this exact point, else None (a caller
    with work in flight, e.g. the background cache writer, settles it before `at()` acts)."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) < 3 or len(parts) > 5 or (len(parts) == 5 and parts[4] not in ACTIONS):
        raise UsageError(
            f"{KILL_ENV}={spec!r} is not <stage>:<point>:<n>[:<rank>[:<action>]]",
            fix=f"unset {KILL_ENV} (it is a test hook), or use an action of {', '.join(ACTIONS)}",
        )
    if parts[0] != stage or parts[1] != point or parts[2] != str(n):
        return None
    who = parts[3] if len(parts) > 3 and parts[3] else "0"
    if who != "*" and who != str(rank):
        return None
    return parts[4] if len(parts) > 4 else "kill"


def _act(action: str, where: str, spec: str) -> None:
    if action == "hang":  # stuck, but torchrun's SIGTERM still ends it (no 30 s SIGKILL grace)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        print(
            f"{KILL_ENV}: {where.replace(' at ', ' hangs at ', 1)} (t={time.time():.3f})",
            file=sys.stderr,
            flush=True,
        )
        while True:
            time.sleep(3600)
    sig = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "int": signal.SIGINT,
           "stop": signal.SIGSTOP}.get(action)  # fmt: skip
    if sig is not None:
        os.kill(os.getpid(), sig)
        return
    raise WandistillError(
        f"injected failure on {where} ({KILL_ENV}={spec})",
        fix=f"unset {KILL_ENV} (it is a test hook)",
    )


def injected_failure(rank: int, step: int) -> None:
    """`WANDISTILL_FAIL_AT`: make train rank `rank` fail right after optimizer step `step`."""
    spec = os.environ.get(FAIL_ENV)
    if not spec:
        return
    parts = spec.split(":")
    if int(parts[0]) != rank or int(parts[1]) != step:
        return
    kind = parts[2] if len(parts) > 2 else "error"
    if kind == "hang":
        while True:
            time.sleep(3600)
    if kind == "oom":
        raise torch.OutOfMemoryError(f"injected out-of-memory on rank {rank} at step {step}")
    raise WandistillError(f"injected failure on rank {rank} at step {step} ({FAIL_ENV}={spec})")
