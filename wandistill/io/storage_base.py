"""The `Storage` interface every cache byte goes through, and the location rules it names files by.

Why its own module: `LocalStorage` (wandistill/io/storage.py) and `FsspecStorage`
(wandistill/io/storage_fsspec.py) both implement it, and `open_storage` picks one of them, so the
interface sits below both. What the methods promise (atomic `put`, create-if-absent `create`,
streamed `upload`, byte-range reads) is told in wandistill/io/storage.py's docstring.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
from pathlib import Path
from typing import IO, Any

from wandistill.io.location import is_url


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
