"""Library noise off by default: one switch for every command, `--verbose` brings it back.

diffusers, transformers and huggingface_hub draw tqdm bars ("Loading pipeline components...",
"Loading weights", "Writing model shards") and log advice; torch, diffusers, accelerate and numpy
raise DeprecationWarning / FutureWarning / UserWarning about their own internals. None of it is
about the user's input, and it buries wandistill's one-line summaries and errors. wandistill itself
never reports through `warnings` or library loggers, so hiding them hides only library noise.

Why environment variables rather than each library's `set_verbosity_error()` /
`disable_progress_bar()`: importing `diffusers.utils.logging` imports diffusers (seconds), and
commands like `recipes` or `--help` never load it. The variables are read when the libraries are
imported (after the CLI callback runs) and are inherited by every process the command starts.
Libraries already imported (an in-process caller such as the demo or a test) get the function calls.

The CLI refuses `--verbose` under torchrun (WORLD_SIZE > 1: every rank would print the same bars
and warnings, interleaved); `configure` still keeps a non-zero rank quiet for in-process callers.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # huggingface_hub, and transformers' bars follow it
    "TQDM_DISABLE": "1",  # tqdm's own default (tqdm>=4.66): diffusers' bars and any other
    "DIFFUSERS_VERBOSITY": "error",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "PYTHONWARNINGS": "ignore",  # child processes that do not go through the CLI
}
"""Read by the libraries at import; see the module docstring."""

LOGGERS = (
    "torch",
    "accelerate",
    "diffusers",
    "transformers",
    "huggingface_hub",
    "zarr",
    "matplotlib",  # "building the font cache" on a first plot
)
"""Standard-library loggers of the libraries we call, held at ERROR unless verbose."""

_set_by_us: dict[str, str] = {}


def configure(verbose: bool = False) -> bool:
    """Silence (or, verbose, restore) library progress bars, advice and warnings for this
    process and its children. Returns whether output is verbose (False off rank 0)."""
    verbose = verbose and os.environ.get("RANK", "0") == "0"
    if verbose:
        for key, value in list(_set_by_us.items()):
            if os.environ.get(key) == value:
                del os.environ[key]
            del _set_by_us[key]
        warnings.resetwarnings()
    else:
        for key, value in QUIET_ENV.items():
            if key not in os.environ:  # a user's own setting wins
                os.environ[key] = _set_by_us[key] = value
        warnings.simplefilter("ignore")
    for name in LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.ERROR)
    _apply_loaded(verbose)
    return verbose


def _apply_loaded(verbose: bool) -> None:
    """The same settings for libraries this process imported before `configure` ran."""
    for name in ("diffusers.utils.logging", "transformers.utils.logging"):
        if (lib := sys.modules.get(name)) is not None:
            (lib.set_verbosity_warning if verbose else lib.set_verbosity_error)()
            (lib.enable_progress_bar if verbose else lib.disable_progress_bar)()
    hub = sys.modules.get("huggingface_hub.utils")
    if hub is not None:
        (hub.enable_progress_bars if verbose else hub.disable_progress_bars)()
