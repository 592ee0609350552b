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
"""

from __future__ import annotations

import abc
import contextlib
import errno
import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from wandistill.checks.validate import read_capped
from wandistill.io.fsutil import atomic_open, fsync_dir, temp_name, writing
from wandistill.io.storage_errors import (
    _WATCHED,
    CONNECT_ATTEMPTS,
    StorageError,
    _limit_text,
    classify,
    storage_error,
    timeouts,
)

EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
"""URL scheme -> the wandistill extra that installs its fsspec backend (`pip install
'wandistill[s3]'`)."""
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
            self._evict()
        try:
            yield slot[0]
        finally:
            with self._lock:
                slot[1] -= 1
                if slot[1] == 0 and self._open.get(path) is not slot:
                    os.close(slot[0])  # evicted (or closed) while this read ran

    def _evict(self) -> None:
        while len(self._open) > self.limit:
            _, slot = self._open.popitem(last=False)
            if slot[1] == 0:
                os.close(slot[0])  # else its last lease closes it

    def close(self) -> None:
        with self._lock:
            slots, self._open = list(self._open.values()), OrderedDict()
            for fd, leases in slots:
                if leases == 0:
                    os.close(fd)

    def __len__(self) -> int:
        return len(self._open)


def is_url(location: str | Path) -> bool:
    """True for an fsspec URL other than `file://` (which is a local path): the one rule,
    `wandistill.io.location.is_url`."""
    from wandistill.io.location import is_url as url

    return url(location)


def local_path(location: str | Path) -> Path:
    text = str(location)
    return Path(text[len("file://") :] if text.startswith("file://") else text)


def join(location: str | Path, *parts: str) -> str:
    """`location/part/...` as text: a URL keeps its `//` (Path would fold it)."""
    if is_url(location):
        return "/".join([str(location).rstrip("/"), *parts])
    return str(local_path(location).joinpath(*parts))


def describe(location: str | Path) -> str:
    return str(location) if is_url(location) else str(local_path(location))


def open_storage(location: str | Path) -> Storage:
    """The storage at `location`: the one place where a location becomes a store."""
    if is_url(location):
        return FsspecStorage(str(location))
    return LocalStorage(local_path(location))


class Storage(abc.ABC):
    """Files under one root, by relative `/`-separated name (see the module docstring)."""

    url: str
    remote: bool = False

    def name(self, rel: str) -> str:
        return join(self.url, rel) if rel else self.url

    @abc.abstractmethod
    def exists(self, rel: str) -> bool: ...

    @abc.abstractmethod
    def isdir(self, rel: str) -> bool: ...

    @abc.abstractmethod
    def size(self, rel: str) -> int | None: ...

    def stamp(self, rel: str) -> Any:
        """A value that changes whenever the file at `rel` is replaced, or None where the
        store cannot say cheaply (then callers re-read it: always correct, never stale)."""
        return None

    def list_stamped(self, rel: str) -> list[tuple[str, Any]]:
        """`list(rel)` with each file's `stamp` (one listing request on an object store)."""
        return [(name, self.stamp(f"{rel}/{name}")) for name in self.list(rel)]

    @abc.abstractmethod
    def list(self, rel: str) -> list[str]: ...

    @abc.abstractmethod
    def read(self, rel: str, *, max_bytes: int, what: str, fix: str, error: type) -> bytes: ...

    @abc.abstractmethod
    def put(self, rel: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def create(self, rel: str, data: bytes) -> bool: ...

    @abc.abstractmethod
    def rm(self, rel: str) -> None: ...

    @abc.abstractmethod
    def makedirs(self, rel: str) -> None: ...

    @abc.abstractmethod
    def upload(
        self, rel: str, *, bulk: bool = False
    ) -> contextlib.AbstractContextManager[IO[bytes]]:
        """Write `rel` atomically; `bulk`: write-once data kept out of the local page cache
        once durable (`fsutil.drop_cached`)."""

    @abc.abstractmethod
    def open_read(self, rel: str) -> IO[bytes]: ...

    @abc.abstractmethod
    def read_range(self, rel: str, offset: int, size: int) -> bytes: ...

    def read_ranges(self, rel: str, spans: list[tuple[int, int]]) -> list[bytes]:
        return [self.read_range(rel, off, n) for off, n in spans]

    def read_into(self, rel: str, requests: list[tuple[int, Any]]) -> list[int]:
        """Fill each writable buffer from its offset; the bytes each one got."""
        got = self.read_ranges(rel, [(off, memoryview(buf).nbytes) for off, buf in requests])
        for (_, buf), data in zip(requests, got, strict=True):
            memoryview(buf).cast("B")[: len(data)] = data
        return [len(d) for d in got]

    def will_need(self, rel: str, spans: list[tuple[int, int]]) -> None:
        """Hint that these (offset, size) ranges are read next (a no-op where it means
        nothing)."""
        return None

    def sha256(self, rel: str) -> str:
        """sha256 of a whole file, read in 4 MiB pieces (verify: nothing is held whole)."""
        sha = hashlib.sha256()
        with self.open_read(rel) as f:
            while chunk := f.read(1 << 22):
                sha.update(chunk)
        return sha.hexdigest()

    def close(self) -> None:
        return None


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
        try:
            return self.path(rel).stat().st_size
        except FileNotFoundError:
            return None

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
        path = self.path(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(path, "wb") as f:
            f.write(data)

    def create(self, rel: str, data: bytes) -> bool:
        final = self.path(rel)
        tmp = temp_name(final)
        with writing(final, partial=tmp), open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, final)  # atomic create-if-absent, unlike rename
            won = True
        except FileExistsError:
            won = False
        finally:
            os.unlink(tmp)
        fsync_dir(final.parent)
        return won

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


def _object_stamp(info: dict[str, Any]) -> Any:
    """An object's version from its listing or HEAD entry (ETag on S3, md5Hash or generation on
    GCS), or None where the backend gives none (then it is read every time)."""
    for name in ("ETag", "etag", "md5Hash", "generation"):
        if info.get(name):
            return (info[name], info.get("size"))
    return None


class FsspecStorage(Storage):
    """An fsspec filesystem (S3, GCS, ...): whole-object PUTs, conditional create, ranged GETs."""

    remote = True

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = _filesystem(url, url.split("://", 1)[0])
        self._async_fs: Any = None

    def async_fs(self) -> Any:
        """This filesystem as an fsspec `AsyncFileSystem`, for zarr's `FsspecStore`: fsspec's
        `AsyncFileSystemWrapper`, which runs each call of the synchronous instance above in a
        worker thread. Not a second `asynchronous=True` instance: that one's HTTP session
        belongs to zarr's event loop and must be closed by whoever opened it (aiohttp warns
        "Unclosed client session" at exit otherwise); the synchronous instance's session is
        fsspec's, closed by fsspec."""
        if self._async_fs is None:
            from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

            self._async_fs = AsyncFileSystemWrapper(self.fs, asynchronous=True)
        return self._async_fs

    def key(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def _call(self, rel: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """One request: bounded by the client's timeouts, announced if slow (`waiting`), its
        failure classified by type and status (`classify`). A plain missing object stays a
        FileNotFoundError (callers treat it as absent), a lost create-if-absent a
        FileExistsError; everything else is one StorageError line."""
        what = f"object store {self.name(rel)} ({getattr(fn, '__name__', 'request')})"
        call = _WATCHED.start(what, _limit_text())
        try:
            return fn(*args, **kwargs)
        except (FileNotFoundError, FileExistsError) as e:
            if classify(e) in ("not-found", "exists"):
                raise
            raise storage_error(self.name(rel), e) from None
        except Exception as e:
            raise storage_error(self.name(rel), e) from None
        finally:
            _WATCHED.end(call)

    def exists(self, rel: str) -> bool:
        found = bool(self._call(rel, self.fs.exists, self.key(rel)))
        if not found and not rel:  # name the real problem: no bucket at all
            bucket = self.root.split("/", 1)[0]
            if bucket != self.root and not self._call(rel, self.fs.exists, bucket):
                raise StorageError(
                    f"{self.url}: the bucket {bucket!r} does not exist",
                    fix="create the bucket, or fix the URL",
                )
        return found

    def isdir(self, rel: str) -> bool:
        return bool(self._call(rel, self.fs.isdir, self.key(rel)))

    def size(self, rel: str) -> int | None:
        try:
            return int(self._call(rel, self.fs.size, self.key(rel)))
        except FileNotFoundError:
            return None

    def list(self, rel: str) -> list[str]:
        try:
            found = self._call(rel, self.fs.ls, self.key(rel), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in found)

    def stamp(self, rel: str) -> Any:
        """The object's ETag (content-derived on S3; GCS's md5Hash) and size, asked afresh."""
        key = self.key(rel)
        self.fs.invalidate_cache(key)
        try:
            return _object_stamp(self._call(rel, self.fs.info, key))
        except FileNotFoundError:  # missing: the read says so, clearly
            return None
        except StorageError as e:
            if e.kind in ("no-bucket", "not-found"):
                return None  # the read names the bucket
            raise  # unreachable, stalled, not S3, denied: at once, not after every later call

    def list_stamped(self, rel: str) -> list[tuple[str, Any]]:
        try:
            found = self._call(rel, self.fs.ls, self.key(rel), detail=True, refresh=True)
        except FileNotFoundError:
            return []
        named = [(i["name"].rstrip("/").rsplit("/", 1)[-1], _object_stamp(i)) for i in found]
        return sorted(named, key=lambda pair: pair[0])

    def find(self, rel: str = "") -> list[str]:
        """Every object under `rel`, as names relative to the root."""
        try:
            found = self._call(rel, self.fs.find, self.key(rel))
        except FileNotFoundError:
            return []
        return sorted(p[len(self.root) + 1 :] for p in found if p.startswith(self.root + "/"))

    def read(self, rel: str, *, max_bytes: int, what: str, fix: str, error: type) -> bytes:
        name = f"{what} {self.name(rel)!r}"
        size = self.size(rel)
        if size is None:
            raise error(f"{name} does not exist", fix=fix)
        if size > max_bytes:
            raise error(
                f"{name} is larger than the {max_bytes} bytes such a file may be "
                "(oversized or not the file wandistill expects)",
                fix=fix,
            )
        try:
            return bytes(self._call(rel, self.fs.cat_file, self.key(rel)))
        except FileNotFoundError:
            raise error(f"{name} does not exist", fix=fix) from None

    def put(self, rel: str, data: bytes) -> None:
        self._call(rel, self.fs.pipe_file, self.key(rel), data)

    def create(self, rel: str, data: bytes) -> bool:
        try:
            self._call(rel, self.fs.pipe_file, self.key(rel), data, mode="create")
        except FileExistsError:
            return False
        except StorageError as e:
            if e.kind == "exists":  # HTTP 412 on If-None-Match: another writer won
                return False
            raise
        return True

    def rm(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._call(rel, self.fs.rm_file, self.key(rel))

    def makedirs(self, rel: str) -> None:
        return None  # object stores have no folders

    @contextlib.contextmanager
    def upload(self, rel: str, *, bulk: bool = False) -> Iterator[IO[bytes]]:
        """Stream to the final key; the object exists only once the upload completes on close
        (a failure aborts it: nothing half-written is ever visible)."""
        f = self._call(rel, self.fs.open, self.key(rel), "wb")
        try:
            yield f
        except BaseException:
            with contextlib.suppress(Exception):
                f.discard()  # aborts a multipart upload already under way
            f.closed = True  # discarded: closing must not upload what was buffered
            raise
        self._call(rel, f.close)

    def open_read(self, rel: str) -> IO[bytes]:
        return self._call(rel, self.fs.open, self.key(rel), "rb")

    def read_range(self, rel: str, offset: int, size: int) -> bytes:
        if size <= 0:
            return b""
        key = self.key(rel)
        return bytes(self._call(rel, self.fs.cat_file, key, start=offset, end=offset + size))

    def read_ranges(self, rel: str, spans: list[tuple[int, int]]) -> list[bytes]:
        """Several ranges of one object in one call: fsspec issues the GETs concurrently."""
        if len(spans) <= 1:
            return [self.read_range(rel, off, n) for off, n in spans]
        key = self.key(rel)
        starts = [off for off, _ in spans]
        ends = [off + n for off, n in spans]
        got = self._call(rel, self.fs.cat_ranges, [key] * len(spans), starts, ends)
        for g in got:
            if isinstance(g, BaseException):
                if isinstance(g, FileNotFoundError):
                    raise g
                raise storage_error(self.name(rel), g)
        return [bytes(g) for g in got]


def _filesystem(url: str, scheme: str) -> tuple[Any, str]:
    extra = EXTRAS.get(scheme)
    install = (
        f"pip install 'wandistill[{extra}]'"
        if extra
        else f"install the fsspec backend for {scheme}://"
    )
    # Never answer from a cached listing: another rank or node may have committed since.
    options: dict[str, Any] = {"use_listings_cache": False} if extra else {}
    if scheme in ("s3", "s3a"):
        connect, read = timeouts()
        options |= {
            "config_kwargs": {
                "connect_timeout": connect,
                "read_timeout": read,
                "retries": {"max_attempts": CONNECT_ATTEMPTS, "mode": "standard"},
            },
        }
    try:
        import fsspec

        fs, root = fsspec.core.url_to_fs(url, **options)
    except ImportError:
        raise StorageError(
            f"{url!r}: no fsspec backend for {scheme}:// is installed", fix=install
        ) from None
    except ValueError as e:
        if "Protocol not known" in str(e):
            raise StorageError(f"{url!r}: unknown URL scheme {scheme}://", fix=install) from None
        raise StorageError(f"{url!r}: {e}", fix="check the URL") from None
    if hasattr(fs, "retries"):  # s3fs's own retry loop (on top of botocore's): one try
        fs.retries = 1
    return fs, root.rstrip("/")
