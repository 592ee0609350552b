"""`FsspecStorage`: a cache on an object store (S3, GCS, ...) through an fsspec filesystem.

Why its own module: the object-store half of `Storage` (whole-object PUTs, conditional create,
ranged GETs, each request bounded and announced if slow) beside the local one in
wandistill/io/storage.py, which opens it for a URL (`open_storage`). Errors become one line
naming the URL and the fix (wandistill/io/storage_errors.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import IO, Any

from wandistill.io.storage_base import Storage
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
        return [name for name, _ in self.list_stamped(rel)]

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
        try:
            if int(self._call(rel, self.fs.size, self.key(rel))) > max_bytes:
                raise error(
                    f"{name} is larger than the {max_bytes} bytes such a file may be "
                    "(oversized or not the file wandistill expects)",
                    fix=fix,
                )
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
            if isinstance(g, FileNotFoundError):
                raise g
            if isinstance(g, BaseException):
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
