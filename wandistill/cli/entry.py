"""The entry point: the root options (--debug, -v, --version) and the exit-code contract.

`main()` is the only place that turns exceptions into exit codes: a `WandistillError` prints one
line (and its fix) and exits 2 for usage errors or 1 for runtime failures; any other exception is
a bug: one line naming a crash log (in the temp folder) that holds the traceback, exit 1.
`--debug` (or WANDISTILL_DEBUG=1) shows the traceback instead.
"""

from __future__ import annotations

import errno
import functools
import os
import sys
from typing import Annotated, Any

import typer
from rich.markup import escape

from wandistill import __version__
from wandistill.cli.common import (
    app,
    err,
    out,
)
from wandistill.errors import UsageError, WandistillError

_debug = bool(os.environ.get("WANDISTILL_DEBUG"))


def _version(value: bool) -> None:
    if value:
        out.print(f"wandistill {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[
        bool, typer.Option("--debug/--no-debug", help="Show tracebacks for errors.")
    ] = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose/--no-verbose",
            "-v",
            help="Show the libraries' progress bars, log messages and warnings (diffusers, "
            "transformers, torch), hidden by default. One process only: refused under torchrun.",
        ),
    ] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    from wandistill.runtime.quiet import configure

    global _debug
    _debug = _debug or debug
    world = os.environ.get("WORLD_SIZE", "1")
    if verbose and world.isdigit() and int(world) > 1:
        raise UsageError(
            f"--verbose under torchrun ({world} ranks): every rank would print the libraries' "
            "progress bars and warnings, interleaved",
            fix="drop -v/--verbose; to see the libraries' output, run the same command as one "
            "process (without torchrun)",
        )
    configure(verbose)


_PATH_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.EEXIST)
"""OSErrors that mean a path given on the command line is wrong: usage errors (exit 2)."""


_NO_FIX = "see `wandistill COMMAND --help` and docs/troubleshooting.md"
"""The fix line of an error raised without one: every error has an `error:` and a `fix:`."""


def _fail(message: str, code: int, fix: str | None = None) -> None:
    err.print(f"[bold red]error:[/bold red] {escape(message)}", highlight=False, soft_wrap=True)
    err.print(f"  [bold]fix:[/bold] {escape(fix or _NO_FIX)}", highlight=False, soft_wrap=True)
    sys.exit(code)


@functools.cache
def _command() -> Any:
    """The click command tree, built once: typer rebuilds it on every `app()` call (~0.1 s of
    signature inspection), which in-process callers (tests, the demo) would pay each time."""
    from wandistill.runtime.workarounds import hide_flag_types

    return hide_flag_types(typer.main.get_command(app))


def _stopped(e: WandistillError) -> bool:
    """A `failures.Stopped` (checked without importing torch, which failures needs: only a
    stage that imported it can raise one)."""
    failures = sys.modules.get("wandistill.runtime.failures")
    return failures is not None and isinstance(e, failures.Stopped)


def _rerun(argv: list[str], add: str = "") -> str:
    """The command that was run, exactly, plus `add` (an interruption hint names it)."""
    import shlex

    args = [*argv, add] if add and add not in argv else list(argv)
    world = os.environ.get("WORLD_SIZE", "1")
    launcher = "torchrun (the same launch flags) -m wandistill" if world != "1" else "wandistill"
    launcher = os.environ.get("WANDISTILL_LAUNCH", launcher)  # `wandistill launch ...` as typed
    return f"{launcher} {shlex.join(args)}"


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point; see the module docstring for the exit-code contract."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _command()(args=args, standalone_mode=False)
    except WandistillError as e:
        if _stopped(e):  # a graceful stop: the fix is the exact command that resumes it
            _fail(e.message, e.exit_code, f"to resume, run: {_rerun(args, e.resume_flag)}")
        if _debug:
            raise
        if e.same_on_every_rank and os.environ.get("RANK", "0") != "0":
            # rank 0 says it once for all ranks; torchrun stops every rank as soon as one
            # exits, so this one waits a moment for rank 0 to print first
            import time

            time.sleep(2.0)
            sys.exit(e.exit_code)
        _fail(e.message, e.exit_code, e.fix)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        _fail("interrupted", 130)
    except typer.TyperException as e:  # click usage errors: unknown command, bad option
        if not str(e):  # a group run without a command: click printed its help
            sys.exit(int(getattr(e, "exit_code", 2)))
        _fail(*_click_error(e))
    except KeyboardInterrupt:
        again = "--resume" if "train" in args[:3] else ""  # (after --debug / -v at most)
        _fail("interrupted", 130, f"to resume, run: {_rerun(args, again)}")
    except OSError as e:
        if _debug:
            raise
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):  # fsutil.name_target
            what = {
                errno.ENOSPC: "disk full",
                errno.EDQUOT: "disk quota exceeded",
                errno.EFBIG: "file too large (over the file size limit: `ulimit -f`, or the "
                "filesystem's)",
            }[e.errno]
            target = f" while writing {e.filename}" if e.filename else ""
            _fail(
                f"{what}{target}",
                1,
                "free space (or raise the limit), or choose another output directory; re-run "
                "to resume",
            )
        text = f"{e.strerror or e}: {e.filename}" if e.filename else str(e)
        if e.errno in (errno.EMFILE, errno.ENFILE):
            _fail(text, 1, "raise the open-file limit (`ulimit -n 65536`) or lower data_threads")
        if e.errno in _PATH_ERRNOS:  # a path the user gave: unreadable, read-only, not a dir
            _fail(text, 2, "check the path and its permissions, or choose another one")
        _fail(text, 1)
    except Exception as e:  # a bug: one line and a crash log, not a traceback
        if _debug:
            raise
        _crash(e)
    if isinstance(code, int) and code:
        sys.exit(code)


def _click_error(e: Exception) -> tuple[str, int, str]:
    """A click usage error as our two lines: click's message (with its "Did you mean"), and
    the --help of the command it was parsing as the fix."""
    # (typer vendors its own click: read the exception by its attributes, not its class)
    message = e.format_message() if hasattr(e, "format_message") else str(e)
    opts = getattr(getattr(e, "param", None), "opts", None)
    if opts and opts[0] not in message:
        message = f"{'/'.join(opts)}: {message}"
    ctx = getattr(e, "ctx", None)
    path = ctx.command_path if ctx is not None else "wandistill"
    group = ctx is not None and hasattr(ctx.command, "commands")
    what = "its commands" if group else "its arguments and flags"
    return message, int(getattr(e, "exit_code", 2)), f"`{path} --help` lists {what}"


def _crash(e: Exception) -> None:
    """Write the traceback of an unexpected error to a crash log and say where, in one line."""
    import tempfile
    import traceback

    text = "".join(traceback.format_exception(e))
    first = (str(e).strip().splitlines() or [""])[0][:200]
    what = f"{type(e).__name__}: {first}" if first else type(e).__name__
    rank = os.environ.get("RANK")
    try:
        fd, log = tempfile.mkstemp(
            prefix=f"wandistill-crash-{'' if rank is None else f'rank{rank}-'}", suffix=".log"
        )
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"wandistill {__version__}\nargv: {sys.argv}\n\n{text}")
    except OSError:  # nowhere to write it: show it rather than lose it
        err.print(text, highlight=False, markup=False)
        log = "(shown above)"
    _fail(
        f"internal error ({what}); the traceback is in {log}",
        1,
        "this is a bug in wandistill: please report it with that log (--debug or "
        "WANDISTILL_DEBUG=1 shows the traceback here)",
    )
