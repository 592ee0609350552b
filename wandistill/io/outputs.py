"""Output folders: every command writes only into a folder it owns, one writer at a time.

`claim(path, purpose)` is the one door through which `precompute --out`, `train --out`,
`eval --out`, `sample --out` and `export --out` reach the disk. It refuses, in one line naming
the folder, the reason and the fix:

- a folder inside (or being) a teacher / model folder (model_index.json, config.json next to
  weights, weight files), or inside a cache;
- a folder that is, contains or lies inside one of the command's inputs (`train --out` is never
  the cache, nor inside it, nor containing it);
- a folder holding files wandistill did not write, or one wandistill made for another purpose;
- a folder another live wandistill process is writing (named: host, pid, start time).

A folder is owned when it carries the marker `.wandistill.json` naming its purpose (cache, run,
eval, sample, export). Folders made by earlier versions, which wrote no marker, are adopted by
their own files: a cache by its wandistill manifest.json, a run by checkpoints/ (or metrics) next
to a config.json with a "train" key (runs now write run.json, `RUN_SETTINGS`), an eval by its
eval.json, a sample by its NNNN.png files, an export by its wandistill_export.json.

One writer: the claim takes an OS advisory lock (`filelock`, flock on `.wandistill.lock`) for as
long as the command runs; the kernel drops it when the process dies, so a `kill -9` leaves no
stale lock. flock is per host: two machines writing one folder on NFS are not kept apart (see
docs/reliability.md). Under torchrun rank 0 claims and broadcasts the outcome, so every rank of
a refused job raises the same error, and ranks of one job share the folder. Holding the lock, the
claim deletes the temp files of dead writers (`fsutil.temp_name`, `fsutil.make_temp_dir`, zarr's
`.partial` files): nobody else can be writing them.

A cache at an fsspec URL (`s3://...`) is claimed by `claim_remote`: the same refusals where an
object store has them, and instead of flock a lease lock object (`lease.LeaseLock`: a
conditional PUT holding host, pid, start and a heartbeat), which goes stale when its holder dies.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock, Timeout

from wandistill import __version__
from wandistill.errors import UsageError, WandistillError
from wandistill.io.folderkind import (
    BOOKKEEPING,
    HOLDER,
    LOCK,
    MARKER,
    MARKER_FORMAT,
    PURPOSES,
    _has_content,
    _is_legacy_cache,
    _printable,
    _read_json,
    is_temp,
    model_evidence,
    owner,
    remove_stale_temps,
)
from wandistill.io.fsutil import atomic_write_json
from wandistill.io.lease import LeaseLock, holder_identity, holder_text
from wandistill.io.storage import FsspecStorage, LocalStorage, Storage, is_url, open_storage

if TYPE_CHECKING:
    from wandistill.runtime.dist import DistInfo

Inputs = Mapping[str, "str | Path | None"]


@dataclass(slots=True)
class OutputFolder:
    """A claimed output folder; `release()` (or leaving the `with`) gives up the lock."""

    path: Path | str
    """The folder, or the URL of an object-store prefix (`claim_remote`)."""
    purpose: str
    _lock: FileLock | LeaseLock | None = field(default=None, repr=False)

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def release(self) -> None:
        if isinstance(self._lock, LeaseLock):
            self._lock.release()
        elif self._lock is not None and self._lock.is_locked:
            with contextlib.suppress(OSError):
                (self.path / HOLDER).unlink()
            self._lock.release()
        self._lock = None

    def __enter__(self) -> OutputFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def claim(
    path: str | Path,
    purpose: str,
    info: DistInfo | None = None,
    *,
    inputs: Inputs | None = None,
    flag: str = "--out",
) -> OutputFolder:
    """Make `path` this job's `purpose` folder (create, check, lock, mark), or refuse.

    `inputs` names the folders and files the command reads ({"--cache": path, ...}): the output
    may not be one of them, lie inside one, or contain one. Under torchrun (`info.distributed`)
    call it on every rank: rank 0 claims, the others learn the outcome and share the folder.
    """
    if info is None or not info.distributed:
        return _claim(path, purpose, inputs or {}, flag)
    from wandistill.runtime import dist

    folder: OutputFolder | None = None
    failure: dict[str, Any] | None = None
    error: Exception | None = None
    if info.is_main:
        try:
            folder = _claim(path, purpose, inputs or {}, flag)
        except Exception as e:  # every rank must hear of it, then rank 0 raises its own
            error = e
            fix = e.fix if isinstance(e, WandistillError) else None
            message = e.message if isinstance(e, WandistillError) else f"{type(e).__name__}: {e}"
            failure = {"message": message, "fix": fix, "usage": isinstance(e, UsageError)}
    failure = dist.broadcast_json(info, failure)
    if error is not None:
        raise error
    if failure is not None:
        kind = UsageError if failure["usage"] else WandistillError
        raise kind(failure["message"], fix=failure["fix"])
    return folder or OutputFolder(path if is_url(path) else _resolve(path, purpose), purpose)


def check(
    path: str | Path, purpose: str, *, inputs: Inputs | None = None, flag: str = "--out"
) -> Path:
    """Every refusal `claim` can make without the lock, writing nothing; the resolved path."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown output purpose {purpose!r}")
    target = _resolve(path, purpose)
    label = f"{flag} {str(path)!r}"
    _refuse_blockers(target, purpose, path)
    _refuse_overlaps(target, label, inputs or {})
    _refuse_ancestors(target, label)
    _inspect(target, purpose, label)
    return target


# --------------------------------------------------------------------------- the claim


def _claim(path: str | Path, purpose: str, inputs: Inputs, flag: str) -> OutputFolder:
    if is_url(path):
        return claim_remote(str(path), purpose, inputs, flag)
    target = check(path, purpose, inputs=inputs, flag=flag)
    label = f"{flag} {str(path)!r}"
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(
            f"cannot create {purpose} directory {str(path)!r}: {e.strerror}",
            fix=f"choose a writable {flag} directory",
        ) from None
    lock = _file_lock(target / LOCK)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise UsageError(
            f"{label} is in use by another wandistill process "
            f"({holder_text(_read_json(target / HOLDER))})",  # "not known yet" while it starts
            fix=f"wait for it to finish (or stop it), or choose another {flag}",
        ) from None
    except OSError as e:
        if e.errno == errno.ENOSYS:
            raise UsageError(
                f"{label} is on a filesystem without flock, so a second writer could not be "
                "kept out",
                fix=f"choose a {flag} directory on a local disk (see docs/reliability.md)",
            ) from None
        raise UsageError(  # name the file that failed: the lock, not the folder
            f"cannot open the lock file {str(target / LOCK)!r} of {label}: {e.strerror}",
            fix=f"{_lock_fix(target / LOCK)}, or choose another {flag}",
        ) from None
    try:  # the checks again, now that nobody else can change the folder
        _inspect(target, purpose, label)
        if _read_json(target / MARKER).get("purpose") != purpose:  # new, empty or adopted
            atomic_write_json(target / MARKER, _marker(purpose))
        atomic_write_json(target / HOLDER, holder_identity())
        remove_stale_temps(target)
    except BaseException:
        lock.release()
        raise
    return OutputFolder(target, purpose, lock)


def _lock_fix(path: Path) -> str:
    if path.is_dir() and not path.is_symlink():
        return f"remove the directory {str(path)!r} (wandistill keeps a lock file there)"
    return f"make {str(path)!r} a writable file (or remove it: it is re-created)"


def _file_lock(path: Path) -> FileLock:
    """flock only: filelock >= 4 would fall back to a lock file's mere existence on filesystems
    without flock, which a killed holder leaves behind (and our lock file always stays)."""
    try:
        return FileLock(str(path), thread_local=False, fallback_to_soft=False)
    except TypeError:  # filelock < 4: no soft fallback to turn off
        return FileLock(str(path), thread_local=False)


def writer_gone(store: Storage) -> str | None:
    """Why no process writes the output folder in `store` any more (nobody holds its claim
    lock), or None while one does. What `train --follow` asks, of the cache its reader opened,
    before it keeps waiting for a cache that only a live precompute could complete.

    Locally a shared `flock` probe of the lock file (a writer holds it exclusively for its whole
    run; the kernel drops it when the writer dies); on an object store the lease lock object,
    judged as a takeover would judge it (`LeaseLock.verdict`). A folder without the claim's
    marker was not written through a claim (a library caller's `CacheWriter`): unknown, None."""
    if isinstance(store, FsspecStorage):
        if not store.exists(MARKER):
            return None
        lock = LeaseLock(store, LOCK, {})
        holder = lock.holder()
        if holder is None:
            return f"there is no lock object {lock.url}"
        if lock.verdict(holder) == "stale":
            return f"its lock object {lock.url} is stale ({holder_text(holder)})"
        return None
    assert isinstance(store, LocalStorage), store
    if not store.path(MARKER).is_file():
        return None
    path = store.path(LOCK)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return f"there is no lock file {str(path)!r}"
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return None
    finally:
        os.close(fd)  # closing drops the probe's shared lock
    return f"no process holds its lock {str(path)!r}"


def _resolve(path: str | Path, purpose: str) -> Path:
    if not str(path):
        raise UsageError(f"no {purpose} directory given", fix="pass --out DIR")
    try:
        return Path(path).expanduser().resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise UsageError(
            f"{purpose} directory {str(path)!r} cannot be resolved ({e})",
            fix="choose another --out directory",
        ) from None


def _marker(purpose: str) -> dict[str, Any]:
    return {
        "format": MARKER_FORMAT,
        "purpose": purpose,
        "wandistill_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def claim_remote(url: str, purpose: str, inputs: Inputs, flag: str) -> OutputFolder:
    """`claim` for an object-store prefix: the same refusals where they apply (an input, a
    prefix holding objects wandistill did not write, another purpose, a live writer), with a
    lease lock (`lease.LeaseLock`) in place of flock. Holding it, removes dead writers'
    temp objects."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown output purpose {purpose!r}")
    label = f"{flag} {url!r}"
    store = open_storage(url)
    assert isinstance(store, FsspecStorage)
    root = url.rstrip("/") + "/"
    for name, given in inputs.items():
        other = str(given).rstrip("/") + "/" if given else ""
        if other and (root.startswith(other) or other.startswith(root)):
            raise UsageError(
                f"{label} overlaps {name} {str(given)!r}; a command never writes where it reads",
                fix=f"choose an output location apart from {name}",
            )
    _inspect_remote(store, purpose, label)
    lock = LeaseLock(store, LOCK, holder_identity())
    holder = lock.acquire()
    if holder is not None:
        raise lock.refusal(holder, label, flag)
    try:
        _inspect_remote(store, purpose, label)
        if _remote_marker(store).get("purpose") != purpose:
            store.put(MARKER, (json.dumps(_marker(purpose), indent=1) + "\n").encode())
        for rel in store.find():
            if is_temp(rel.rsplit("/", 1)[-1]):
                store.rm(rel)
    except BaseException:
        lock.release()
        raise
    return OutputFolder(url, purpose, lock)


def _remote_marker(store: FsspecStorage) -> dict[str, Any]:
    try:
        data = store.read(MARKER, max_bytes=1 << 20, what="marker", fix="", error=UsageError)
        obj = json.loads(data)
    except (UsageError, ValueError):
        return {"purpose": "?"} if store.exists(MARKER) else {}
    return obj if isinstance(obj, dict) and obj.get("format") == MARKER_FORMAT else {"purpose": "?"}


def _inspect_remote(store: FsspecStorage, purpose: str, label: str) -> None:
    """An object-store prefix must be new, empty, or a wandistill `purpose` prefix."""
    names = [n for n in store.list("") if n not in BOOKKEEPING]
    if names:
        found = _remote_marker(store).get("purpose")
        _refuse_foreign(label, purpose, found, names, "choose a new or empty output location")


# --------------------------------------------------------------------------- refusals


def _refuse_blockers(target: Path, purpose: str, given: str | Path) -> None:
    blocker = next((p for p in (target, *target.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UsageError(
            f"cannot create {purpose} directory {str(given)!r}: Not a directory "
            f"({str(blocker)!r} is a file)",
            fix="choose another --out directory",
        )


def _refuse_overlaps(target: Path, label: str, inputs: Inputs) -> None:
    for name, given in inputs.items():
        if given is None or not str(given) or is_url(given):
            continue  # an input at a URL is never a local folder
        other = Path(given).expanduser().resolve()
        how = (
            "is"
            if other == target
            else "is inside"
            if target.is_relative_to(other)
            else "contains"
            if other.is_relative_to(target)
            else None
        )
        if how == "contains" and other.is_file():
            continue  # a file we read inside the output folder: never one we write
        if how is not None:
            raise UsageError(
                f"{label} {how} {name} {str(given)!r}; a command never writes where it reads",
                fix=f"choose an output directory apart from {name}",
            )


def _refuse_ancestors(target: Path, label: str) -> None:
    for parent in target.parents:
        if not parent.is_dir():
            continue
        evidence = model_evidence(parent, strict=False)
        if evidence is not None:
            raise UsageError(
                f"{label} is inside the model folder {str(parent)!r} ({evidence}); wandistill "
                "never writes into a teacher or model folder",
                fix="choose an output directory outside it",
            )
        if _is_legacy_cache(parent) or ((parent / MARKER).exists() and owner(parent) == "cache"):
            raise UsageError(
                f"{label} is inside the cache {str(parent)!r}; a cache holds only what "
                "precompute writes",
                fix="choose an output directory outside it",
            )


def _inspect(target: Path, purpose: str, label: str) -> str:
    """What `target` is for this claim: missing, empty or ours; anything else is refused."""
    if not target.exists():
        return "missing"
    if not _has_content(target):  # nothing, or only a claim's bookkeeping: free for any use
        return "empty"
    found = owner(target)
    names = sorted(p.name for p in target.iterdir() if p.name not in BOOKKEEPING)
    evidence = None if found == "export" == purpose else model_evidence(target, strict=not found)
    fix = "choose a new or empty output directory"
    _refuse_foreign(label, purpose, found, names, fix, evidence)
    return "ours"


def _refuse_foreign(
    label: str,
    purpose: str,
    found: str | None,
    names: list[str],
    fix: str,
    evidence: str | None = None,
) -> None:
    """Refuse a non-empty folder or prefix that is not this `purpose`'s: its marker unreadable
    (`found` "?"), another purpose's, a model folder (`evidence`), or not wandistill's."""
    if found == "?":
        raise UsageError(f"{label} has an unreadable {MARKER}", fix=f"{fix}, or delete {MARKER}")
    if found is not None and found != purpose:
        raise UsageError(
            f"{label} is a wandistill {found} folder, not "
            f"{'an' if purpose[0] in 'aeiou' else 'a'} {purpose} folder",
            fix=fix,
        )
    if evidence is not None:
        raise UsageError(
            f"{label} is a model folder ({evidence}); wandistill never writes into a teacher "
            "or model folder",
            fix=fix,
        )
    if found is None:
        shown = ", ".join(map(_printable, names[:4]))
        shown += f", ... ({len(names)} in all)" if len(names) > 4 else ""
        raise UsageError(
            f"{label} is not empty and was not written by wandistill (holds {shown}); "
            "wandistill never overwrites files it did not write",
            fix=fix,
        )
