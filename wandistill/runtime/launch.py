"""`wandistill launch [TORCHRUN FLAGS] {precompute|train} ...`: torchrun, with wandistill's errors.

Raw `torchrun -m wandistill ...` prints a ChildFailedError traceback after any rank exits
non-zero, even when that rank already said what went wrong in one `error:`/`fix:` pair (a
refused resume, a bad flag): torchrun treats every non-zero exit code as a crash, and no exit
code or error-file protocol makes it stay quiet while still failing. This command is a drop-in
for `torchrun [FLAGS] -m wandistill COMMAND ...`, as `accelerate launch` is for a script: it
runs torch.distributed.run's own parser and elastic agent in this process with the same flags,
and when a rank fails it exits with that rank's exit code, without a traceback (the rank printed
the error). A rank killed by a signal printed nothing: that gets one line here. torchrun's own
log lines (the OMP_NUM_THREADS banner, "Sending process ... closing signal") are library output,
hidden unless `wandistill -v launch ...`.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from collections.abc import Sequence
from typing import NoReturn

from wandistill.errors import UsageError, WandistillError

STAGES = ("precompute", "train")
"""The commands that run as a torchrun job."""
LAUNCH_ENV = "WANDISTILL_LAUNCH"
"""Set for the ranks: the launch command as typed, so an interruption hint names it exactly."""
_OWN = ("-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path")


class RankFailed(WandistillError):
    """A rank was killed by a signal (it could not say why itself)."""


def split(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """torchrun's flags (everything before the stage) and the wandistill command."""
    at = next((i for i, a in enumerate(args) if a in STAGES), None)
    if at is None:
        raise UsageError(
            f"launch needs a command to run ({' or '.join(STAGES)}) after torchrun's flags",
            fix="e.g. wandistill launch --standalone --nproc_per_node=2 precompute tiny ...",
        )
    flags, command = list(args[:at]), list(args[at:])
    if own := [f for f in flags if f.split("=", 1)[0] in _OWN]:
        raise UsageError(
            f"launch runs `-m wandistill` itself; {own[0]} is not a flag it passes to torchrun",
            fix=f"drop {own[0]} (and the module name): wandistill launch [FLAGS] {command[0]} ...",
        )
    return flags, command


def launch(args: Sequence[str], *, verbose: bool = False) -> NoReturn:
    """Run `wandistill COMMAND` as a torchrun job with torchrun's `flags`; exit as the job did."""
    flags, command = split(args)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    parser = torchrun.get_args_parser()
    parser.prog = "wandistill launch"

    def refuse(message: str) -> NoReturn:
        raise UsageError(f"torchrun's flags: {message}", fix="`torchrun --help` lists them")

    parser.error = refuse  # type: ignore[method-assign]  # one line, not argparse's usage box
    parsed = parser.parse_args([*flags, "-m", "wandistill", *command])
    os.environ[LAUNCH_ENV] = shlex.join(["wandistill", "launch", *flags])
    # torchrun's loggers set their own levels and torch's handlers print them: this process
    # runs only the agent, so its log records are all torchrun's (the ranks are other processes)
    logging.disable(logging.NOTSET if verbose else logging.CRITICAL)
    try:
        torchrun.run(parsed)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode >= 0:  # the rank said why (our error:/fix: lines): exit as it did
            sys.exit(failure.exitcode or 1)
        error = RankFailed(
            f"rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}; the job "
            "stopped",
            fix="see the system log (an out-of-memory kill?) and re-run the same command to resume",
        )
        error.exit_code = 128 - failure.exitcode
        raise error from None
    except SignalException as e:  # the ranks got the signal too and said how to resume
        sys.exit(128 + int(e.sigval))
    finally:
        logging.disable(logging.NOTSET)
    sys.exit(0)
