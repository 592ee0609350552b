"""Where a cache lives: a local folder or an fsspec URL (`s3://`, `gs://`, ...), one interface.

Every byte of a cache (manifest, journals, shared tensors, shards) goes through a `Storage`, so
the commit protocol is written once:

- a whole small file (manifest, journal, marker) is `put`: locally a temp sibling + fsync +
  rename (`wandistill.io.fsutil`), on an object store one PUT of the whole object, which S3 and GCS
  make visible all at once or not at all;
- `create` is create-if-absent: a hard link locally, a conditional PUT (`If-None-Match: *`)
  on an object store, so racing writers agree on one manifest and one lock;
- a shard is streamed with `upload`: locally into a temp sibling renamed on success, on an
  object store straight to its final key (a multipart upload only becomes an object when it is
  completed on close; a killed writer leaves no object). A shard becomes part of the cache only
  when the journal that names it is `put`, so a shard object no journal names is never read;
- reads are byte ranges: `pread` on a cached descriptor locally, `cat_file`/`cat_ranges` (ranged
  GETs, concurrent for several ranges) on an object store.

A local path (or `file://` URL) gives `LocalStorage`, which keeps the POSIX behaviour (fsync,
flock) unchanged. Any other URL gives `FsspecStorage` over `fsspec.core.url_to_fs`. Endpoint and
credentials come from the backend's usual sources (for S3: the standard AWS environment
variables and files, `AWS_ENDPOINT_URL` for an S3-compatible server; docs/cache-format.md).
Object-store errors become one line naming the URL and the fix (`StorageError`).

Where the parts live: the `Storage` interface and the location rules (`is_url`, `join`) in
storage_base.py, `FsspecStorage` in storage_fsspec.py, its errors in storage_errors.py; this
module opens a location (`open_storage`) and holds `LocalStorage`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from wandistill.checks.validate import read_capped
from wandistill.io.fsutil import atomic_open, atomic_write_bytes, fsync_dir, temp_name, writing
from wandistill.io.storage_base import Storage, describe, is_url, join, local_path
from wandistill.io.storage_fsspec import FsspecStorage

__all__ = [
    "MAX_OPEN_FILES",
    "FsspecStorage",
    "LocalStorage",
    "Storage",
    "describe",
    "is_transient",
    "is_url",
    "join",
    "local_path",
    "open_storage",
    "storage_at",
]
"""The front door: callers import every storage name from here (the interface and the object
store live in storage_base.py and storage_fsspec.py)."""

TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EINTR, errno.EAGAIN})
"""OSErrors about the process or the machine, not the file being read: a reader re-raises them
as they are, never as a corrupt record (which `--skip-corrupt` would drop)."""


def is_transient(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS


MAX_OPEN_FILES = 128
"""Read descriptors a `LocalStorage` keeps open (least recently used closed first): a cache of
100k shards must not need 100k descriptors (the usual limit is 1,024)."""


class _Descriptors:
    """Read-only descriptors by path, at most `limit` kept open, least recently used closed
    first. A descriptor is leased for each read: one evicted while a thread still reads through
    it is closed when that read ends, never under it (a reused descriptor number would read
    another file)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: OrderedDict[Path, list[int]] = OrderedDict()
        """path -> [fd, leases]."""
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def lease(self, path: Path) -> Iterator[int]:
        with self._lock:
            slot = self._open.get(path)
            if slot is None:
                slot = self._open[path] = [os.open(path, os.O_RDONLY), 0]
            self._open.move_to_end(path)
            slot[1] += 1
            while len(self._open) > self.limit:  # evict the least recently used
                _, old = self._open.popitem(last=False)
                if old[1] == 0:
                    os.close(old[0])  # else its last lease closes it
        try:
            yield slot[0]
        finally:
            with self._lock:
                slot[1] -= 1
                if slot[1] == 0 and self._open.get(path) is not slot:
                    os.close(slot[0])  # evicted (or closed) while this read ran

    def close(self) -> None:
        with self._lock:
            slots, self._open = list(self._open.values()), OrderedDict()
            for fd, leases in slots:
                if leases == 0:
                    os.close(fd)

    def __len__(self) -> int:
        return len(self._open)


def open_storage(location: str | Path) -> Storage:
    """The storage at `location`: the one place where a location becomes a store."""
    if is_url(location):
        return FsspecStorage(str(location))
    return LocalStorage(local_path(location))


def storage_at(cache: str | Path | Storage) -> Storage:
    """The edge of the public cache entry points (`CacheReader(path)`, `read_manifest(path)`,
    `load_committed(path)`, the backends' sources): a path or URL is opened here, once, and a
    `Storage` the caller already opened is used as it is. Every function below those entry
    points takes the `Storage` only, so a location is never parsed or opened twice (an object
    store's filesystem, a local store's descriptor cache)."""
    return cache if isinstance(cache, Storage) else open_storage(cache)


class LocalStorage(Storage):
    """A local (or mounted POSIX) folder: temp + fsync + rename, `pread` on cached fds."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)
        self._fds = _Descriptors(MAX_OPEN_FILES)

    def path(self, rel: str) -> Path:
        return self.root / rel if rel else self.root

    def exists(self, rel: str) -> bool:
        return self.path(rel).exists()

    def isdir(self, rel: str) -> bool:
        return self.path(rel).is_dir()

    def size(self, rel: str) -> int | None:
        stamp = self.stamp(rel)
        return None if stamp is None else stamp[1]

    def stamp(self, rel: str) -> Any:
        """(inode, size, mtime): every `put` renames a new inode into place."""
        try:
            st = self.path(rel).stat()
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def list(self, rel: str) -> list[str]:
        folder = self.path(rel)
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []

    def read(self, rel: str, *, max_bytes: int, what: str, fix: str, error: type) -> bytes:
        return read_capped(self.path(rel), max_bytes=max_bytes, what=what, fix=fix, error=error)

    def put(self, rel: str, data: bytes) -> None:
        self.path(rel).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.path(rel), data)

    def create(self, rel: str, data: bytes) -> bool:
        final = self.path(rel)
        tmp = temp_name(final)
        with writing(final, partial=tmp), open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, final)  # atomic create-if-absent, unlike rename
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
            fsync_dir(final.parent)
        return True

    def rm(self, rel: str) -> None:
        self.path(rel).unlink(missing_ok=True)

    def makedirs(self, rel: str) -> None:
        self.path(rel).mkdir(parents=True, exist_ok=True)

    def upload(
        self, rel: str, *, bulk: bool = False
    ) -> contextlib.AbstractContextManager[IO[bytes]]:
        return atomic_open(self.path(rel), "wb", bulk=bulk)

    def open_read(self, rel: str) -> IO[bytes]:
        return open(self.path(rel), "rb")  # noqa: SIM115 - the caller closes it

    def read_range(self, rel: str, offset: int, size: int) -> bytes:
        with self._fds.lease(self.path(rel)) as fd:
            return os.pread(fd, size, offset)

    def read_into(self, rel: str, requests: list[tuple[int, Any]]) -> list[int]:
        """`preadv` straight into each buffer: no intermediate bytes object, no copy."""
        with self._fds.lease(self.path(rel)) as fd:
            return [os.preadv(fd, [buf], off) for off, buf in requests]

    def will_need(self, rel: str, spans: list[tuple[int, int]]) -> None:
        """`posix_fadvise(WILLNEED)` per range: the kernel starts reading them all at once, so
        a batch's reads from a cold disk overlap instead of waiting one after another."""
        if not hasattr(os, "posix_fadvise"):
            return
        with self._fds.lease(self.path(rel)) as fd:
            for off, size in spans:
                os.posix_fadvise(fd, off, size, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        self._fds.close()
