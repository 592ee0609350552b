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
import json
import math
import os
import socket
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from wandistill.checks.validate import read_capped
from wandistill.errors import UsageError
from wandistill.io.fsutil import atomic_open, fsync_dir, temp_name, writing
from wandistill.runtime import waiting

EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
"""URL scheme -> the wandistill extra that installs its fsspec backend (`pip install
'wandistill[s3]'`)."""
CONNECT_TIMEOUT_S = 5.0
"""Object stores: seconds to wait for a connection before giving up (s3fs's own default: 5)."""
READ_TIMEOUT_S = 20.0
"""Object stores: seconds to wait for an answer on an open connection (botocore's default is 60,
times 5 attempts: an endpoint that accepts and never answers was silent for minutes)."""
TIMEOUT_ENV = "WANDISTILL_STORAGE_TIMEOUT"
"""Overrides READ_TIMEOUT_S (and caps the connect timeout), in seconds."""
CONNECT_ATTEMPTS = 2
"""Object stores: attempts per request at the HTTP level (botocore's default is 5 with backoff,
so an unreachable endpoint would take a minute to report). s3fs's own retry loop is set to one
try: the worst silent-free wait of one call is CONNECT_ATTEMPTS x the timeouts."""


def timeouts() -> tuple[float, float]:
    """(connect, read) seconds for object-store requests: WANDISTILL_STORAGE_TIMEOUT, checked
    like every number (finite, in (0, 600]), else the defaults."""
    from wandistill.checks.bounds import Range

    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return CONNECT_TIMEOUT_S, READ_TIMEOUT_S
    try:
        seconds = float(raw) if len(raw) < 64 else float("nan")
    except ValueError:
        seconds = float("nan")
    problem = Range(gt=0, le=600).problem(TIMEOUT_ENV, seconds)
    if problem is not None:
        raise UsageError(
            problem.replace("=nan", f"={raw[:40]!r}"),
            fix=f"set {TIMEOUT_ENV} to a number of seconds (default {READ_TIMEOUT_S:g})",
        )
    return min(CONNECT_TIMEOUT_S, seconds), seconds


class StorageError(UsageError):
    """An object store refused or could not be reached: names the URL and the fix. `kind`: the
    class of problem (`classify`), for callers that handle one (a lost conditional PUT)."""

    def __init__(self, message: str, fix: str | None = None, kind: str = "other") -> None:
        super().__init__(message, fix=fix)
        self.kind = kind


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


_WATCHED = waiting.Watched()
"""Object-store calls in flight (one line when one is slow)."""


def _limit_text() -> str:
    connect, read = timeouts()
    return (
        f"each attempt gives up after {connect:g} s to connect and {read:g} s without an "
        f"answer, {CONNECT_ATTEMPTS} attempts ({TIMEOUT_ENV} sets it)"
    )


def _chain(e: BaseException) -> Iterator[BaseException]:
    """`e` and the exceptions it was raised from (s3fs keeps botocore's as `__cause__`)."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen and len(seen) < 16:
        seen.add(id(x))
        yield x
        x = x.__cause__ or x.__context__


def _types(x: BaseException) -> set[str]:
    """The names of `x`'s classes: botocore and aiohttp are optional (the s3 extra), so their
    exception types are matched by class name, through the whole hierarchy."""
    return {c.__name__ for c in type(x).__mro__}


S3_HEADERS = ("x-amz-request-id", "x-amzn-requestid", "x-amz-id-2")
"""Response headers every S3 implementation sends (AWS, MinIO, Ceph, moto): an HTTP error
without them and without an S3 error code came from some other server."""
NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}
STALLED = {"ReadTimeoutError", "ReadTimeout", "SocketTimeoutError", "ServerTimeoutError"}
UNREACHABLE = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ConnectionClosedError",
    "ClientConnectionError",
    "ConnectionError",
}
NOT_S3 = {"HTTPClientError", "ResponseParserError", "BadHttpMessage", "ClientPayloadError"}
BAD_CREDENTIALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}


def classify(e: BaseException) -> str:
    """The class of an object-store failure, from exception types and the HTTP status / S3
    error code of the response, never from the words of a message: not-found, exists (a lost
    conditional PUT), no-bucket, no-credentials, bad-credentials, forbidden, unreachable,
    stalled, not-s3, no-space, or other."""
    chain = list(_chain(e))
    for x in chain:  # the transport first: a reset connection wraps an HTTP-level error
        names = _types(x)
        if names & NO_CREDENTIALS:
            return "no-credentials"
        if names & STALLED or isinstance(x, TimeoutError):
            return "stalled"
        if names & UNREACHABLE:
            return "unreachable"
    for x in chain:
        if _types(x) & NOT_S3:
            return "not-s3"
        response = getattr(x, "response", None)
        if isinstance(response, dict):
            return _classify_response(response)
        status = getattr(x, "code", None)  # gcsfs's HttpError
        if isinstance(status, int) and not isinstance(status, bool) and 400 <= status < 600:
            return {401: "forbidden", 403: "forbidden", 404: "not-found"}.get(status, "other")
    if isinstance(e, FileNotFoundError):
        return "not-found"
    if isinstance(e, FileExistsError):
        return "exists"
    if isinstance(e, PermissionError):
        return "forbidden"
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "no-space"
    return "other"


def _classify_response(response: dict[str, Any]) -> str:
    error = response.get("Error") or {}
    meta = response.get("ResponseMetadata") or {}
    code = str(error.get("Code") or "")
    status = meta.get("HTTPStatusCode")
    headers = {str(k).lower() for k in (meta.get("HTTPHeaders") or {})}
    if not code and not headers & set(S3_HEADERS):
        return "not-s3"
    if code == "NoSuchBucket":
        return "no-bucket"
    if code in BAD_CREDENTIALS:
        return "bad-credentials"
    if code == "PreconditionFailed" or status == 412:
        return "exists"
    if code == "AccessDenied" or status in (401, 403):
        return "forbidden"
    if code in ("NoSuchKey", "NotFound", "404") or status == 404:
        return "not-found"
    return "other"


def _endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL") or "the provider's default endpoint"


def storage_error(where: str, e: BaseException) -> StorageError:
    """One line for an object-store failure, with the fix for its class of problem."""
    kind = classify(e)
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    endpoint = "check the endpoint (AWS_ENDPOINT_URL for an S3-compatible server) and the network"
    lines: dict[str, tuple[str, str]] = {
        "no-bucket": (
            f"the bucket {where.split('://', 1)[-1].split('/', 1)[0]!r} does not exist",
            "create the bucket, or fix the URL",
        ),
        "no-credentials": (
            "no credentials for the object store",
            "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for s3://, "
            "GOOGLE_APPLICATION_CREDENTIALS for gs://",
        ),
        "bad-credentials": (
            f"the object store rejected the credentials ({first})",
            "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and the endpoint",
        ),
        "forbidden": (
            f"access denied ({first})",
            "use credentials that may read and write it",
        ),
        "unreachable": (f"the object store at {_endpoint()} cannot be reached ({first})", endpoint),
        "stalled": (
            f"the object store at {_endpoint()} accepted the connection but did not answer "
            f"within {timeouts()[1]:g} s ({CONNECT_ATTEMPTS} attempts)",
            f"{endpoint}; raise {TIMEOUT_ENV} (seconds) if it is just slow",
        ),
        "not-s3": (
            f"the endpoint {_endpoint()} answered, but not as an S3 server (HTTP error "
            "without an S3 error code)",
            "point AWS_ENDPOINT_URL at the S3 API of the store (not its web console)",
        ),
        "no-space": (
            "no space left (or the object is too large)",
            "free space or choose another --out",
        ),
    }
    message, fix = lines.get(
        kind, (f"{type(e).__name__}: {first}", "check the URL, the endpoint and credentials")
    )
    if kind == "exists":
        message, fix = f"{type(e).__name__}: {first}", "another writer created it first"
    return StorageError(f"{where}: {message}", fix=fix, kind=kind)


# --------------------------------------------------------------------------- one writer

LOCK_LEASE_S = 60.0
"""An object-store lock not refreshed for this long is stale (its holder died)."""
LOCK_SETTLE_S = 0.5
"""How long a new holder waits before reading its lock back (see `LeaseLock`)."""
CLOCK_SKEW_S = 5.0
"""A heartbeat this far in the future is still believed (clocks of two hosts differ a little);
further ahead, the writer's clock is wrong and only the reader's own clock can tell."""


def holder_identity() -> dict[str, Any]:
    """Who holds a lock: host and pid (what makes a lock stale once that pid is gone on this
    host), start time and command (what a refusal shows the user)."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": " ".join(["wandistill", *sys.argv[1:3]])[:120],
    }


class LeaseLock:
    """One writer on an object store, where there is no flock: a lock object created with a
    conditional PUT (`If-None-Match: *`), holding host, pid, start, a random token and a
    heartbeat that a thread refreshes every lease / 4 seconds.

    When a lock is stale (`verdict`). Its lifetime is bounded whatever its heartbeat says: a
    reader remembers, on its own monotonic clock, when it first saw each version of the lock
    object, and a version unchanged for a whole lease is stale, since a live holder rewrites it
    every lease / 4. That holds for a heartbeat in the future (a writer whose clock runs
    ahead), NaN, missing or garbage. Shortcuts: a believable heartbeat (a number, not more than
    CLOCK_SKEW_S ahead) older than the lease is stale at once (a crashed writer's lock is taken
    over without waiting), and so is a lock whose holder ran on this host under a pid that is
    gone (a `kill -9`). An unbelievable heartbeat is watched (`acquire(watch=True)`) for up to
    a lease, with one line saying so, and taken over if it does not change.

    A stale lock is deleted and taken. The delete is not conditional (S3 has no
    compare-and-delete that s3fs exposes), so two runs taking over one stale lock at once could
    each delete the other's fresh lock. Tokens fence that: a new holder reads its lock back
    after LOCK_SETTLE_S and yields to the token it finds there; a heartbeat never overwrites
    another run's lock (it marks this one `lost` and stops); release deletes the lock only if
    it is still this run's.
    """

    def __init__(
        self, store: FsspecStorage, rel: str, me: dict[str, Any], lease_s: float | None = None
    ) -> None:
        self.store, self.rel, self.me = store, rel, me
        self.lease_s = LOCK_LEASE_S if lease_s is None else lease_s
        self.token = uuid.uuid4().hex
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: dict[bytes, float] = {}
        """Each version of the lock object seen -> when, on this process's monotonic clock."""

    @property
    def is_locked(self) -> bool:
        return self._thread is not None

    @property
    def url(self) -> str:
        return self.store.name(self.rel)

    def _body(self) -> bytes:
        beat = {**self.me, "token": self.token, "heartbeat": time.time(), "lease_s": self.lease_s}
        return json.dumps(beat).encode()

    def _raw(self) -> bytes | None:
        """The lock object's bytes (None if there is none)."""
        size = self.store.size(self.rel)
        if size is None:
            return None
        if size > 1 << 16:
            return b"(oversized)"
        try:
            return bytes(
                self.store._call(self.rel, self.store.fs.cat_file, self.store.key(self.rel))
            )
        except FileNotFoundError:
            return None

    def holder(self) -> dict[str, Any] | None:
        """The lock object's content (None if there is none; {} if unreadable)."""
        raw = self._raw()
        if raw is None:
            return None
        self._seen.setdefault(raw, time.monotonic())
        try:
            info = json.loads(raw)
        except (ValueError, RecursionError):
            return {"_raw": raw}
        return {**info, "_raw": raw} if isinstance(info, dict) else {"_raw": raw}

    def verdict(self, holder: dict[str, Any]) -> str:
        """ "stale", "alive" or "watch" (a heartbeat that cannot be believed, not yet watched
        for a whole lease): see the class docstring."""
        raw = holder.get("_raw", b"")
        first = self._seen.setdefault(raw, time.monotonic())
        if time.monotonic() - first > self.lease_s:
            return "stale"  # unchanged for a whole lease on this reader's clock
        pid = holder.get("pid")
        if holder.get("host") == socket.gethostname() and type(pid) is int and 0 < pid < 1 << 31:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return "stale"
            except PermissionError:
                pass
        beat = holder.get("heartbeat")
        if type(beat) in (int, float) and math.isfinite(beat):
            age = time.time() - beat
            if age > self.lease_s:
                return "stale"
            if age >= -CLOCK_SKEW_S:
                return "alive"
        return "watch"

    def _settle(self) -> None:
        time.sleep(LOCK_SETTLE_S)

    def _mine(self, holder: dict[str, Any] | None) -> bool:
        return holder is not None and holder.get("token") == self.token

    def acquire(self, *, watch: bool = True) -> dict[str, Any] | None:
        """Take the lock (None), or return the live holder's details. `watch`: a lock whose
        heartbeat cannot be believed is watched here (up to a lease, announced) until it
        changes (alive) or not (stale); else it counts as held and a later call decides."""
        for _ in range(3):
            if self.store.create(self.rel, self._body()):
                self._settle()  # a racing takeover's delete + create shows by now
                holder = self.holder()
                if holder is None:
                    continue  # deleted by a racing takeover that has not created yet: again
                if not self._mine(holder):
                    return holder  # that run took it: it is the live holder
                self._thread = threading.Thread(
                    target=self._beat, name="wandistill-lock-heartbeat", daemon=True
                )
                self._thread.start()
                return None
            holder = self.holder()
            if holder is None:
                continue  # released between our create and our read: try again
            state = self.verdict(holder)
            if state == "watch" and watch:
                state = self._watch(holder)
            if state != "stale":
                return holder
            self.store.rm(self.rel)
        return self.holder() or {}

    def _watch(self, holder: dict[str, Any]) -> str:
        """Watch a lock with an unbelievable heartbeat until it changes or a lease passes."""
        waiting.say(
            f"lock object {self.url} has heartbeat {str(holder.get('heartbeat'))[:40]!r} "
            f"({_beat_text(holder.get('heartbeat'))}); watching it for up to {self.lease_s:g} s "
            "on this machine's clock: a live holder rewrites it, a dead one's is taken over"
        )
        raw = holder.get("_raw")
        while True:
            time.sleep(min(1.0, self.lease_s / 8))
            now = self.holder()
            if now is None or now.get("_raw") != raw:
                return "alive"  # rewritten (a live holder) or released: let the caller retry
            state = self.verdict(now)
            if state != "watch":
                return state

    def refusal(self, holder: dict[str, Any], label: str, flag: str) -> UsageError:
        """The one-line refusal for a live holder: who, and how to remove the lock safely."""
        return UsageError(
            f"{label} is in use by another wandistill process ({holder_text(holder)}); its "
            f"lock object is {self.url}",
            fix=f"wait for it to finish, or choose another {flag}; if that process is gone "
            f"(check its host and pid), delete the lock object (`aws s3 rm {self.url}`, or "
            f"any tool for the store) and re-run; an abandoned lock is taken over by itself "
            f"once it has not changed for {self.lease_s:g} s",
        )

    def beat_once(self) -> bool:
        """Refresh the heartbeat unless another run holds the lock now (then mark it lost)."""
        holder = self.holder()
        if holder is not None and not self._mine(holder):
            self.lost = True
            return False
        self.store.put(self.rel, self._body())
        return True

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            try:
                if not self.beat_once():
                    return
            except Exception:  # a missed beat is retried; the lease is long
                continue

    def release(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        with contextlib.suppress(Exception):
            if self._mine(self.holder()):
                self.store.rm(self.rel)


def _beat_text(beat: Any) -> str:
    if type(beat) in (int, float) and math.isfinite(beat):
        return f"{beat - time.time():.0f} s in the future: is the writer's clock ahead?"
    return "not a time"


def _printable(value: Any) -> str:
    """One line, whatever a lock object or holder file holds (newlines, escapes)."""
    return str(value).encode("unicode_escape").decode("ascii")[:200]


def holder_text(info: dict[str, Any]) -> str:
    """Who holds a lock, as a refusal shows it (every field made printable and short)."""
    if not {k for k in info if k != "_raw"}:
        return "holder not known yet: it is starting, or its lock object is unreadable"
    fields = {k: _printable(info.get(k, "?")) for k in ("command", "host", "pid", "started")}
    return (
        f"{fields['command']}: host {fields['host']}, pid {fields['pid']}, "
        f"started {fields['started']}"
    )
