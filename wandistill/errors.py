"""Error types the CLI turns into one clear line and an exit code, never a traceback.

A user error (bad flag, missing path, wrong recipe key) exits 2; a runtime failure (corrupt cache,
disk full, out of memory) exits 1. Anything else is a bug: the CLI prints one line naming a crash
log that holds the traceback (exit 1), or the traceback itself with --debug.
"""

from __future__ import annotations


class WandistillError(Exception):
    """Base class: `str(err)` is the whole message shown to the user."""

    exit_code = 1
    same_on_every_rank = False
    """Raised from the inputs alone (flags, recipe, cache header), so under torchrun every
    rank raises it alike: rank 0 alone prints it (cli.main)."""

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        self.message = message
        self.fix = fix
        super().__init__(message if fix is None else f"{message}\n  fix: {fix}")


class UsageError(WandistillError):
    """The input is wrong: a path, a flag, a recipe key or value."""

    exit_code = 2


class ConfigError(UsageError):
    """A recipe or `--set` override does not fit the typed config."""


class CacheError(WandistillError):
    """A cache is missing, corrupt, or disagrees with what is asked of it."""


class CacheMismatchError(CacheError):
    """Writing into a cache made by another teacher or other sampler settings."""

    exit_code = 2
    same_on_every_rank = True


class CorruptRecordError(CacheError):
    """One record of one shard cannot be read as written (checksum, truncation, bad header)."""

    def __init__(self, shard: str, key: str, detail: str) -> None:
        self.shard = shard
        self.key = key
        self.detail = detail
        super().__init__(
            f"corrupt record {key} in shard {shard}: {detail}",
            fix="run `wandistill cache verify`; restore the shard, or pass --skip-corrupt",
        )
