"""Where a command reads or writes: the one parser for every --out, --cache, --run, --export and
PATH a command takes (and the recipe keys behind them: cache.path, train.cache, train.out).

Why one parser: `pathlib.Path("s3://b/run")` is `s3:/b/run`, a *local* folder whose printed name
reads like S3. A command that let a URL fall into `Path` wrote `./s3:/b/...`, exited 0 and lost
the run on an ephemeral node. So a location is parsed once, at the edge, into either

- a URL (text, `//` kept) for the flags whose command reads or writes object stores end to end
  through `wandistill.io.storage` (atomic there: whole-object PUTs, multipart uploads that only
  appear on completion), or
- a local `Path`, for every other flag: a URL there is refused in one line naming the flag,
  before any work.

Either way, a local path whose first component looks like a URL scheme (`s3:`, `gs:/b`,
`https:x`: a URL with its `//` lost, by a shell variable or a `Path` upstream) is refused: it is
never what the user meant, and a folder of that name is the trap above. Spell such a folder
`./s3:x` if it really is one. `file://PATH` is the local path PATH.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from wandistill.errors import UsageError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")
"""A URL scheme (two letters or more: `C:` stays a drive letter where there are any)."""

COPY_FIX = (
    "pass a local folder, then copy it to the object store with its own tool "
    "(e.g. `aws s3 sync DIR s3://bucket/prefix`)"
)


def is_url(text: str | Path) -> bool:
    """A real URL (`scheme://...`) other than `file://`."""
    s = str(text)
    return "://" in s and bool(_SCHEME.match(s)) and not s.startswith("file://")


def problem(text: str | Path, flag: str, *, url: bool) -> str | None:
    """Why `text` cannot be `flag`'s location (one line), or None. `url`: the command supports
    an object-store URL there end to end."""
    try:
        parse(text, flag, url=url)
    except UsageError as e:
        return e.message
    return None


FULL_URL = "write the URL in full (s3://bucket/prefix), or ./NAME for a local folder of that name"


def parse(text: str | Path, flag: str, *, url: bool) -> str | Path:
    """`text` as `flag`'s location: a URL string (only where `url`), else a local `Path`."""
    s = str(text)
    if "\x00" in s or "\n" in s or "\r" in s:
        raise UsageError(f"{flag} {s[:80]!r} holds a NUL or newline character", fix="fix it")
    if s.startswith("file://"):
        s = s[len("file://") :]
    elif "://" in s:
        m = _SCHEME.match(s)
        if m is None:
            raise UsageError(
                f"{flag} {s[:200]!r} is neither a local path nor a URL (scheme://...)",
                fix="pass a local path" + (" or a scheme://bucket/prefix URL" if url else ""),
            )
        if not url:
            raise UsageError(
                f"{flag} {s[:200]!r} is a URL, but this command takes {flag} only as a path on "
                "a local (or mounted) filesystem",
                fix=COPY_FIX,
            )
        rest = s[len(m[0]) + 2 :]
        if not rest or rest.startswith("/"):
            raise UsageError(
                f"{flag} {s[:200]!r} names no bucket (expected {m[1]}://bucket/prefix)",
                fix=FULL_URL,
            )
        return s.rstrip("/")
    m = _SCHEME.match(s)
    if m is not None:
        raise UsageError(
            f"{flag} {s[:200]!r} looks like a {m[1]}:// URL that lost its '//' (it would "
            "become a local folder named like a URL)",
            fix=FULL_URL,
        )
    return Path(s)


def local(text: str | Path, flag: str) -> Path:
    p = parse(text, flag, url=False)
    assert isinstance(p, Path)
    return p


def option(flag: str, *, url: bool) -> dict[str, Any]:
    """typer.Option arguments: the value is parsed here (never by click's Path type, which
    would fold `//`) and refused in one line naming `flag`."""

    def convert(value: Any) -> str | Path:  # an empty flag clears the recipe's value, never "."
        return "" if value == "" else parse(value, flag, url=url)

    return {"parser": convert, "metavar": "URL|DIR" if url else "PATH"}
