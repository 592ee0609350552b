"""Test-only fault injection: make one process crash, stop or fail at an exact point of its run.

Only the tests set `WANDISTILL_TEST_KILL_AT`; unset (always, in real use), `at()` costs one
environment lookup. The grammar follows `WANDISTILL_FAIL_AT` (wandistill/train/failures.py):

    WANDISTILL_TEST_KILL_AT=<stage>:<point>:<n>[:<rank>[:<action>]]

Points (the stages call `at()` there, nowhere else):

    precompute:record:<n>  after this process handed its n-th record of this run to the cache
                           writer (the record may still sit in the open, uncommitted shard);
                           n=0: right after the writer opened the cache, before any record
    train:step:<n>         right after optimizer step n, before its metrics row and checkpoint
    train:saved:<n>        right after the checkpoint of step n was published (every rank)
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

Because the point is counted by the process itself, a seeded list of kill points is exact and
reproducible, and no test has to sleep on the clock to land one.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from wandistill.errors import UsageError, WandistillError

KILL_ENV = "WANDISTILL_TEST_KILL_AT"
ACTIONS = ("kill", "term", "int", "raise", "stop", "hang", "nan")


def at(stage: str, point: str, n: int, rank: int = 0) -> bool:
    """Act if `WANDISTILL_TEST_KILL_AT` names this stage, point, count and rank; True only for
    the `nan` action (the caller then poisons its value)."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return False
    parts = spec.split(":")
    if len(parts) < 3 or len(parts) > 5 or (len(parts) == 5 and parts[4] not in ACTIONS):
        raise UsageError(
            f"{KILL_ENV}={spec!r} is not <stage>:<point>:<n>[:<rank>[:<action>]]",
            fix=f"unset {KILL_ENV} (it is a test hook), or use an action of {', '.join(ACTIONS)}",
        )
    if parts[0] != stage or parts[1] != point or parts[2] != str(n):
        return False
    who = parts[3] if len(parts) > 3 and parts[3] else "0"
    if who != "*" and who != str(rank):
        return False
    action = parts[4] if len(parts) > 4 else "kill"
    if action == "nan":
        return True
    if action == "hang":  # stuck, but torchrun's SIGTERM still ends it (no 30 s SIGKILL grace)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        print(f"{KILL_ENV}: rank {rank} hangs at {stage} {point} {n} (t={time.time():.3f})",
              file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif action == "int":
        os.kill(os.getpid(), signal.SIGINT)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        raise WandistillError(
            f"injected failure on rank {rank} at {stage} {point} {n} ({KILL_ENV}={spec})",
            fix=f"unset {KILL_ENV} (it is a test hook)",
        )
    return False
