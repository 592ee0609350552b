"""Test-only fault injection: a stage stops, crashes or fails at an exact, counted point.

Only the tests set `WANDISTILL_FAULT`; unset (always, in real use), each hook costs one
environment lookup. It is the one fault-injection mechanism: a stage calls `at()` at a named
point (one call, no other test logic in the stage).

    WANDISTILL_FAULT=<stage>:<point>:<n>[:<rank>[:<action>]]

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
    oom    raise an out-of-memory error (torch.OutOfMemoryError), as a real one would
    nan    make `at()` return True: the caller poisons its value with NaN

Because the point is counted by the process itself, a seeded list of kill points is exact and
reproducible, and no test has to sleep on the clock to land one.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from wandistill.errors import UsageError, WandistillError

__all__ = ["ACTIONS", "ENV", "at", "wants"]

ENV = "WANDISTILL_FAULT"
ACTIONS = ("kill", "term", "int", "raise", "oom", "stop", "hang", "nan")


def at(stage: str, point: str, n: int, rank: int = 0) -> bool:
    """Act if `WANDISTILL_FAULT` names this stage, point, count and rank; True only for
    the `nan` action (the caller then poisons its value)."""
    action = wants(stage, point, n, rank)
    if action not in (None, "nan"):
        _act(action, f"rank {rank} at {stage} {point} {n}", os.environ[ENV])
    return action == "nan"


def wants(stage: str, point: str, n: int, rank: int = 0) -> str | None:
    """The action `WANDISTILL_FAULT` asks for at this exact point, else None (a caller
    with work in flight, e.g. the background cache writer, settles it before `at()` acts)."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) < 3 or len(parts) > 5 or (len(parts) == 5 and parts[4] not in ACTIONS):
        raise UsageError(
            f"{ENV}={spec!r} is not <stage>:<point>:<n>[:<rank>[:<action>]]",
            fix=f"unset {ENV} (it is a test hook), or use an action of {', '.join(ACTIONS)}",
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
            f"{ENV}: {where.replace(' at ', ' hangs at ', 1)} (t={time.time():.3f})",
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
    if action == "oom":
        raise torch.OutOfMemoryError(f"injected out-of-memory on {where} ({ENV}={spec})")
    raise WandistillError(
        f"injected failure on {where} ({ENV}={spec})",
        fix=f"unset {ENV} (it is a test hook)",
    )
