"""The zarr stores wandistill wraps around zarr-python's: the row-claim lock, the sealing store
that hashes and fsyncs what the writer puts, and the reader's shard-index cache."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import random
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from zarr.abc.store import RangeByteRequest, Store, SuffixByteRequest
from zarr.experimental.cache_store import CacheStore
from zarr.storage import FsspecStore, LocalStore, MemoryStore, WrapperStore

from wandistill.cache.contract import ZARR_LOCK_NAME
from wandistill.cache.zarr.layout import (
    CLAIM_WAIT_S,
    DATA_NAME,
    FSYNC_THREADS,
    INDEX_CACHE_BYTES,
    ZarrChunkError,
)
from wandistill.errors import CacheError
from wandistill.io.fsutil import drop_cached, fsync_dir
from wandistill.io.lease import LeaseLock, holder_identity, holder_text
from wandistill.io.storage import FsspecStorage, LocalStorage, Storage
from wandistill.io.storage_errors import storage_error
from wandistill.runtime import waiting


@contextlib.contextmanager
def claim_lock(storage: Storage) -> Iterator[None]:
    """The lock every writer takes to claim rows: `flock` on `data.zarr.lock` on a local disk;
    on an object store (no flock) a lease lock object of that name (`lease.LeaseLock`),
    waited for. A claim holds it for a few metadata rewrites, so holders come and go; a dead
    holder's lock goes stale after its lease (at once on its own host)."""
    if isinstance(storage, LocalStorage):  # its own fd: excludes other threads too
        fd = os.open(storage.root / ZARR_LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the last fd of this open file description drops the lock
        return
    assert isinstance(storage, FsspecStorage), storage
    lock = LeaseLock(storage, ZARR_LOCK_NAME, holder_identity())
    start = time.monotonic()
    announced = False
    while (holder := lock.acquire()) is not None:
        waited = time.monotonic() - start
        if waited > CLAIM_WAIT_S:
            raise CacheError(
                f"cache {storage.url!r}: lock object {lock.url} has been held by another "
                f"writer for {CLAIM_WAIT_S:g} s ({holder_text(holder)})",
                fix="stop the writer that holds it; if none runs, delete the lock object "
                f"(`aws s3 rm {lock.url}`) and re-run",
            )
        if not announced and waited > waiting.NOTICE_S:
            announced = True
            waiting.say(
                f"for lock object {lock.url} ({holder_text(holder)}); giving up after "
                f"{CLAIM_WAIT_S:g} s"
            )
        time.sleep(random.uniform(0.05, 0.5))
    try:
        yield
    finally:
        lock.release()


def _fsync_path(path: Path, *, bulk: bool = False) -> None:
    """fsync a file zarr wrote; `bulk` (shard data): then drop it from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if bulk:
            drop_cached(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------ stores


@contextlib.contextmanager
def _store_errors(store: Store, key: str) -> Iterator[None]:
    """An object store's failure (no connection, no credentials, denied) as one StorageError
    line naming the object, as every other access to a cache on an object store reports it."""
    try:
        yield
    except (CacheError, asyncio.CancelledError):
        raise
    except Exception as e:
        if not isinstance(store, FsspecStore):
            raise
        protocol = store.fs.protocol
        protocol = protocol[0] if isinstance(protocol, tuple | list) else protocol
        raise storage_error(f"{protocol}://{store.path}/{key}", e) from None


class _SealingStore(WrapperStore[Store]):
    """Remembers the size and sha256 of every value zarr writes, hashed from the bytes zarr
    hands to `set` (one pass, no read-back), and fsyncs each file it wrote once.

    zarr's LocalStore writes each value with one `write` into a temp file that it renames over
    the key, so the file holds exactly `value`. Hashing runs in a worker thread (hashlib
    releases the GIL), like zarr's own file write. With `sync_on_write` the same worker fsyncs
    the file right away, so its writeback overlaps the encoding of the arrays still being
    written, and then drops it from the page cache (`fsutil.drop_cached`: shard data is
    write-once bulk); otherwise (metadata rewritten under the claim lock) the file waits for
    `make_durable`, which fsyncs each pending file once, concurrently, and then every directory
    written into, right before the caller commits the entry that names them."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.sealed: dict[str, tuple[int, str]] = {}
        """Key -> (size, sha256) of the values written since the caller last cleared it."""
        self.sync_on_write = False
        self._pending: set[str] = set()
        """Keys written but not fsynced yet."""
        self._touched: set[str] = set()
        """Keys written since the last `make_durable` (their directories get fsynced)."""

    @property
    def local_root(self) -> Path | None:
        return self._store.root if isinstance(self._store, LocalStore) else None

    async def set(self, key: str, value: Any) -> None:
        with _store_errors(self._store, key):
            await self._store.set(key, value)
        self._touched.add(key)
        eager = self.sync_on_write and self.local_root is not None
        if not eager:
            self._pending.add(key)
        self.sealed[key] = await asyncio.to_thread(self._seal, key, value, eager)

    async def set_if_not_exists(self, key: str, value: Any) -> None:
        """How zarr writes the implicit parent groups of a nested array (`a/values` -> `a`):
        not hashed (no entry names it), but made durable with the rest."""
        if await self._store.exists(key):
            return
        await self._store.set_if_not_exists(key, value)
        self._touched.add(key)
        self._pending.add(key)

    def _seal(self, key: str, value: Any, fsync: bool) -> tuple[int, str]:
        data = memoryview(value.as_buffer_like()).cast("B")
        digest = hashlib.sha256(data).hexdigest()
        if fsync:
            _fsync_path(self.local_root / key, bulk=True)  # type: ignore[operator]
        return data.nbytes, digest

    def make_durable(self, keys: Iterable[str] = ()) -> None:
        """fsync every written file not synced yet (FSYNC_THREADS at a time), then the
        directories holding what was written and `keys` (new entries, renames), deepest first."""
        root = self.local_root
        pending, self._pending = sorted(self._pending), set()
        touched, self._touched = sorted(self._touched), set()
        if root is None:
            return
        with ThreadPoolExecutor(max_workers=FSYNC_THREADS) as pool:
            list(pool.map(_fsync_path, [root / key for key in pending]))
        dirs: set[Path] = {root}
        for key in [*touched, *keys]:
            d = (root / key).parent
            while d != root and root in d.parents:
                dirs.add(d)
                d = d.parent
        for d in sorted(dirs, key=lambda p: -len(p.parts)):
            fsync_dir(d)


class _ReadStore(WrapperStore[Store]):
    """Read side: shard-index reads (suffix requests) go through zarr's CacheStore, so each
    shard file's index is read once; a missing or short chunk file is an error, not fill values.

    Committed shard files are never rewritten (every writer claims fresh whole zarr shards), so
    a cached index never goes stale. The missing-file check stands in for a zarr option:
    zarr-python <= 3.1.6 reads a missing chunk as fill values; upstream
    https://github.com/zarr-developers/zarr-python/pull/3748 (merged 2026-04, in no release
    yet) adds a config to raise `MissingChunkError` instead, which can replace it once released."""

    def __init__(self, store: Store, index_cache_bytes: int = INDEX_CACHE_BYTES) -> None:
        super().__init__(store)
        self.indexes = CacheStore(
            store, cache_store=MemoryStore(), max_size=index_cache_bytes, cache_set_data=False
        )

    def _with_store(self, store: Store) -> _ReadStore:
        return type(self)(store, self.indexes.max_size or INDEX_CACHE_BYTES)

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        source = self.indexes if isinstance(byte_range, SuffixByteRequest) else self._store
        with _store_errors(self._store, key):
            buf = await source.get(key, prototype, byte_range)
        if key.endswith("zarr.json"):
            return buf
        where = f"{DATA_NAME}/{key}"
        if buf is None:
            raise ZarrChunkError(f"{where} is missing")
        if isinstance(byte_range, SuffixByteRequest):
            want = byte_range.suffix
        elif isinstance(byte_range, RangeByteRequest):
            want = byte_range.end - byte_range.start
        else:
            return buf
        if len(buf) != want:
            raise ZarrChunkError(f"{where}: short read, {len(buf)} of {want} bytes (truncated)")
        return buf
