"""zarr v3 backend, read and written through zarr-python's public API.

On-disk layout: one group `<cache>/data.zarr` of per-field arrays indexed by record row. Every
array uses zarr's ShardingCodec; inner chunks carry a crc32c checksum (zarr's Crc32cCodec) and
are not compressed (float latents do not compress: zstd gains ~1.09x)::

    data.zarr/                       group; attrs["wandistill"] = {block_records, token_block, ...}
      noise          (N,C,F,H,W)     chunk (1,C,F,H,W)    zarr shard (block,C,F,H,W)
      final_latent   (N,C,F,H,W)     chunk (1,C,F,H,W)    zarr shard (block,C,F,H,W)
      timesteps      (N,S)           chunk (1,S)          zarr shard (block,S)
      xt             (N,S,C,F,H,W)   chunk (1,1,C,F,H,W)  zarr shard (block,S,C,F,H,W)
      teacher_out    (N,S,C,F,H,W)   chunk (1,1,C,F,H,W)  zarr shard (block,S,C,F,H,W)
      feature.<name> (N,S,...)       chunk (1,1,...)      zarr shard (block,S,...)
      prompt_embeds/values   (T,D)   ragged, NOT padded: every record's tokens back to back
      prompt_embeds/offsets  (N,2)   int64 [start, length] into values; [-1, -1] = no embedding
      negative_prompt_embeds/{values,offsets}   same, once some record carries one

A step field is chunked one (record, step) per inner chunk, so a training sample that wants one
recorded step reads that chunk (plus the zarr shard's index). Dtypes come from the one table in
`schema.DTYPES`: bf16 (fp8) has no zarr dtype and is stored as its uint16 (uint8) bits with array
attribute {"wandistill_dtype": "bfloat16"} ("float8_e4m3fn"). With `cache.compression = "zstd"`
each inner chunk is zstd-compressed (zarr's ZstdCodec) before its crc32c. Dtypes and trailing
shapes are fixed by the first record that creates an array. Per-record metadata (key, prompt,
seed, extra) lives in the shard's manifest entry (`schema.ZarrEntry.meta`), which is the
commit record anyway.

Row ownership and concurrency. zarr 3.1 rewrites a whole zarr shard on every write that touches
it (read-modify-write, no locking), so two partial writes into one zarr shard lose rows, and
`resize` is a metadata rewrite that concurrent processes race on. Hence:

* the sink buffers one writer shard (`begin..end`) in memory, each record copied once into its
  row of a preallocated block per field (reused from shard to shard);
* `end()` takes an exclusive `fcntl.flock` on `<cache>/data.zarr.lock` (on an object store, a
  lease lock object of that name: `claim_lock`), creates missing arrays,
  claims the next free row range (rounded up to whole zarr shards of `block` rows) and token
  range per ragged field (whole zarr shards of `token_block` tokens), grows EVERY record-indexed
  array to the claimed stop (so each `offsets` array has a row for every record; rows no writer
  filled read as the fill value, [-1, -1] for offsets), then releases the lock;
* outside the lock it writes each array with one `setitem(a:b, block)`, arrays together in
  `asyncio.gather`s of at most WRITE_GATHER_BYTES on zarr's event loop (zarr
  `codec_pipeline.batch_size` WRITE_BATCH_CHUNKS): the ranges are disjoint and zarr-shard
  aligned, so no other writer touches those files;
* every byte goes through `_SealingStore`, a `zarr.storage.WrapperStore` that hashes what zarr
  hands to `set` (no file is read back). On a local disk each file is fsynced once: a shard file
  by the hashing worker right after its write (overlapping the other arrays' encoding), the
  metadata rewritten under the lock at the end of `end()`, then the directories. The shard
  files and their sha256 go in the entry; the CacheWriter then commits it in its journal.
  Rows claimed but never committed (a writer killed mid-shard, `abort()`, a failed `end()`)
  are never listed, and readers ignore them.

`block` is the sink's `block_records` (the CacheWriter passes its shard_records; default
BLOCK_RECORDS = 64); once the group exists, its recorded layout wins.

Reads (`ZarrSource`) go through `zarr.AsyncArray.getitem`, all fields of one sample in one
`asyncio.gather` handed to zarr's event loop (one thread hop per sample, not per field); the
training reader's `read_batch` gathers every field of a whole batch at once, each with
`AsyncArray.get_orthogonal_selection(..., out=<its row of the batch tensor>)`, so zarr decodes
each chunk straight into the batch. Reading one inner chunk costs one ranged read of the shard
index and one of the chunk; the index read is served by `zarr.experimental.cache_store.CacheStore`
(in memory, LRU, INDEX_CACHE_BYTES), so each shard file's index is read once. Small per-record
arrays (offsets, timesteps) are read once per shard entry. zarr checks every chunk's crc32c;
`_ReadStore` turns a missing shard file (zarr would read fill values) or a short read into
`ZarrChunkError`, and read errors name the shard entry, the record key, the field and the zarr
shard file(s).

Stock `zarr.open_group(<cache>/data.zarr, mode="r")` reads the same files: see
docs/cache-format.md. This module never pickles. A local cache directory must support flock
(NFSv4 does; Lustre needs -o flock). A cache at an fsspec URL is the same layout through zarr's
`FsspecStore` (`zarr_store`): objects are written whole (nothing to fsync), and the same claim
protocol runs under the lease lock.

Library notes (zarr >= 3.1.6): `zarr.experimental.cache_store` is experimental upstream
(https://zarr.readthedocs.io/en/stable/api/zarr/experimental/); `zarr.core.sync.sync` is the
runner zarr's own synchronous API uses (https://github.com/zarr-developers/zarr-python,
src/zarr/core/sync.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from zarr.abc.store import RangeByteRequest, Store, SuffixByteRequest
from zarr.codecs import Crc32cCodec, ZstdCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.experimental.cache_store import CacheStore
from zarr.storage import FsspecStore, LocalStore, MemoryStore, WrapperStore

from wandistill.cache.batch import BatchBuffers, Shape
from wandistill.cache.contract import (
    DTYPE_BY_NAME,
    DTYPE_NAMES,
    FORMAT_NAME,
    ZARR_DATA_NAME,
    ZARR_DTYPE_ATTR,
    DType,
    Record,
    is_step_field,
)
from wandistill.cache.files import (
    ZarrArrayMeta,
    ZarrEntry,
    ZarrGroupAttrs,
    ZarrGroupMeta,
    ZarrNodeMeta,
)
from wandistill.checks.validate import MiB, check, inside, parse_json
from wandistill.errors import CacheError
from wandistill.io.fsutil import drop_cached, fsync_dir
from wandistill.io.lease import LeaseLock, holder_identity, holder_text
from wandistill.io.storage import FsspecStorage, LocalStorage, Storage, is_transient, open_storage
from wandistill.io.storage_errors import storage_error
from wandistill.runtime import waiting

DATA_NAME = ZARR_DATA_NAME
LOCK_NAME = "data.zarr.lock"
BLOCK_RECORDS = 64
"""Rows per zarr shard (file) of every record-indexed array."""
TOKEN_CHUNK = 32
"""Tokens per inner chunk of a ragged values array (a record's read touches few chunks)."""
TOKEN_BLOCK = 4096
"""Tokens per zarr shard (file) of a ragged values array; a multiple of TOKEN_CHUNK."""
RAGGED = ("prompt_embeds", "negative_prompt_embeds")
GROUP_ATTR = "wandistill"
INDEX_CACHE_BYTES = 64 << 20
"""Shard indexes a ZarrSource keeps in memory (a Wan xt shard's index is 8 KiB)."""
SMALL_ROW_BYTES = 1024
"""Arrays whose row is at most this big (offsets, timesteps) are read once per shard entry."""
FSYNC_THREADS = 8
"""fsyncs in flight at once when a shard commits (the device merges their writeback)."""
CLAIM_WAIT_S = 300.0
"""How long a writer on an object store waits for the row-claim lock (longer than a dead
holder's lease, `lease.LOCK_LEASE_S`)."""

_WRITE_CONFIG: dict[str, Any] = {"write_empty_chunks": True}
"""Store every chunk, even one equal to the fill value, so each shard file this writer claims
exists and holds every row it wrote (verify relies on it). Not persisted by zarr."""
WRITE_BATCH_CHUNKS = 64
"""zarr's `codec_pipeline.batch_size` while a shard is written: inner chunks the sharding codec
encodes per batch (zarr's default, 1, schedules some ten asyncio tasks per chunk; 64 cut the
event loop's CPU by about a third in three of four measured pairs, docs/benchmarks.md). Read at
write time."""
WRITE_GATHER_BYTES = 512 * MiB
"""Block bytes written in one `asyncio.gather`; a bigger shard goes out in several, biggest
arrays first. zarr-python holds about three more copies of what it encodes at once (chunk
buffers, crc32c appends, the combined shard), so all arrays of a big shard at once cost memory
and, with fresh pages, time: 16 records of 81-frame Wan 480p (1.29 GB) took +5.1 GB peak RSS and
17.6 s in one gather, +2.8 GB and 10.5 s one array at a time (2-core VM, 2026-11-23). Below it,
one gather lets one array's hashing and file writes overlap the next one's encoding. Read at
write time."""
_WRITE_CONFIG_LOCK = threading.Lock()
"""zarr's config is process-global and `config.set` restores what it saw on entry, so two
threads overlapping their `set` blocks would leave the write setting behind: one at a time."""


class ZarrChunkError(CacheError, ValueError):
    """A zarr shard file is missing, truncated, or fails zarr's crc32c check.

    Also a ValueError, like zarr-python's own checksum error on the same data."""


def storage_of(cache: str | Path | Storage) -> Storage:
    """The cache's `Storage` (sinks and sources take a path, a URL, or the storage itself)."""
    return cache if isinstance(cache, Storage) else open_storage(cache)


def zarr_store(cache: str | Path | Storage, *, read_only: bool = False) -> Store:
    """The zarr store of the cache at `cache` (its `data.zarr`): the one place where a location
    becomes a zarr store. A local folder gives `zarr.storage.LocalStore`; an fsspec URL gives
    `zarr.storage.FsspecStore` over the same filesystem as the rest of the cache, opened
    asynchronously (`FsspecStorage.async_fs`)."""
    storage = storage_of(cache)
    if isinstance(storage, LocalStorage):
        return LocalStore(storage.root / DATA_NAME, read_only=read_only)
    assert isinstance(storage, FsspecStorage), storage
    return FsspecStore(storage.async_fs(), read_only=read_only, path=storage.key(DATA_NAME))


MAX_META_BYTES = 16 * MiB
"""Cap on one zarr.json (ours are ~2 KB)."""
_META_FIX = "restore data.zarr's metadata, or re-run `wandistill precompute` into a new cache"


def check_metadata(storage: Storage) -> None:
    """Check every zarr.json of the group (the group's and each array's) against its schema
    before zarr-python parses it, so bad metadata is one CacheError naming the file.

    Chunk folders (`c/`) are not walked; on a local disk a symlink is refused (it could lead
    outside the cache). zarr-python itself is still the parser: this only bounds and types what
    it reads."""
    local = storage.root if isinstance(storage, LocalStorage) else None
    stack = [DATA_NAME]
    while stack:
        folder = stack.pop()
        names = storage.list(folder)
        if "zarr.json" in names:
            _check_meta_file(storage, f"{folder}/zarr.json", group_root=folder == DATA_NAME)
        for name in names:
            rel = f"{folder}/{name}"
            if local is not None and (local / rel).is_symlink():
                raise CacheError(
                    f"{str(local / rel)!r} is a symlink inside {DATA_NAME}; refused", fix=_META_FIX
                )
            if name not in ("c", "zarr.json") and storage.isdir(rel):
                stack.append(rel)


def _check_meta_file(storage: Storage, rel: str, *, group_root: bool) -> None:
    what = "zarr metadata"
    where = f"{what} {storage.name(rel)!r} is corrupt"
    data = storage.read(rel, max_bytes=MAX_META_BYTES, what=what, fix=_META_FIX, error=CacheError)
    obj = parse_json(data, where, fix=_META_FIX, error=CacheError)
    node = check(ZarrNodeMeta, obj, where, fix=_META_FIX, error=CacheError)
    if node.node_type == "array":
        check(ZarrArrayMeta, obj, where, fix=_META_FIX, error=CacheError)
        return
    group = check(ZarrGroupMeta, obj, where, fix=_META_FIX, error=CacheError)
    if group_root and GROUP_ATTR in group.attributes:
        attrs = group.attributes[GROUP_ATTR]
        check(
            ZarrGroupAttrs,
            attrs,
            f"{where}: attributes.{GROUP_ATTR}",
            fix=_META_FIX,
            error=CacheError,
        )


def _zarr_call(what: str, fn: Callable[[], Any]) -> Any:
    """Run a zarr-python call that parses metadata; its errors become one CacheError line."""
    try:
        return fn()
    except (CacheError, OSError):
        raise
    except Exception as e:  # zarr raises many types for metadata it cannot make sense of
        raise CacheError(
            f"{what}: zarr cannot read it ({type(e).__name__}: {e})", fix=_META_FIX
        ) from None


def _dtype_of(t: torch.Tensor) -> DType:
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise CacheError(f"the zarr cache cannot store dtype {t.dtype}")
    return DTYPE_BY_NAME[name]


def _numpy_view(t: torch.Tensor, dtype: DType) -> np.ndarray:
    """A numpy array over a CPU tensor's memory (no copy); bf16 / fp8 as their integer bits."""
    if dtype.as_bits:
        return t.view(dtype.bits).numpy().view(dtype.numpy)
    return t.numpy()


def to_torch(a: Any, dtype: DType) -> torch.Tensor:
    """A tensor over `a` (zarr hands out fresh, writable arrays); stored bits back to bf16."""
    a = np.asarray(a)
    if not a.flags.c_contiguous:  # (np.ascontiguousarray would turn 0-d into 1-d)
        a = a.copy(order="C")
    if dtype.as_bits:
        return torch.from_numpy(a.view(np.dtype(dtype.numpy))).view(dtype.bits).view(dtype.torch)
    return torch.from_numpy(a)


def _array_dtype(arr: Any) -> DType:
    name = str(arr.attrs.get(ZARR_DTYPE_ATTR, np.dtype(arr.dtype).name))
    if name not in DTYPE_BY_NAME:
        raise CacheError(
            f"{DATA_NAME}/{arr.path} holds {name[:40]!r} items, not a dtype wandistill writes",
            fix=_META_FIX,
        )
    return DTYPE_BY_NAME[name]


def _ceil_to(n: int, block: int) -> int:
    return -(-n // block) * block


def _shard_files(arr: Any, start: int, stop: int) -> list[str]:
    """Store keys of the zarr shard files holding axis-0 range [start, stop) of `arr`."""
    block = int(arr.shards[0])
    tail = (0,) * (len(arr.shape) - 1)
    first, last = start // block, max(start + 1, stop) - 1
    return [
        f"{arr.path}/{arr.metadata.encode_chunk_key((k, *tail))}"
        for k in range(first, last // block + 1)
    ]


def _by_bytes(writes: list[tuple[Any, slice, np.ndarray]], budget: int) -> list[list[Any]]:
    """The writes in groups of at most `budget` block bytes (one bigger write alone), biggest
    first: what one `asyncio.gather` of a shard's writes may hold in memory at once."""
    groups: list[list[Any]] = []
    size = 0
    for w in sorted(writes, key=lambda w: -w[2].nbytes):
        if not groups or size + w[2].nbytes > budget:
            groups.append([])
            size = 0
        groups[-1].append(w)
        size += w[2].nbytes
    return groups


async def _gather(coros: list[Any]) -> list[Any]:
    """Run zarr reads concurrently on zarr's event loop; exceptions come back as values."""
    return await asyncio.gather(*coros, return_exceptions=True)


def _as_chunk_error(err: BaseException, files: list[str]) -> BaseException:
    """zarr's exception while reading `files` as a ZarrChunkError naming them; an error that
    says nothing about the data (bad index, EMFILE, a bug) as it is."""
    if isinstance(err, ZarrChunkError | IndexError | KeyError):
        return err
    if is_transient(err):
        return err
    if not isinstance(err, OSError | ValueError):
        return err
    shown = ", ".join(f"{DATA_NAME}/{f}" for f in files)
    what = "fails zarr's crc32c check or decode (corrupt or truncated file)"
    if isinstance(err, OSError):
        what = "cannot be read"
    return ZarrChunkError(f"{shown} {what}: {type(err).__name__}: {err}")


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock across processes and threads (each call opens its own fd)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last fd of this open file description drops the lock


@contextlib.contextmanager
def claim_lock(storage: Storage) -> Iterator[None]:
    """The lock every writer takes to claim rows: `flock` on `data.zarr.lock` on a local disk;
    on an object store (no flock) a lease lock object of that name (`lease.LeaseLock`),
    waited for. A claim holds it for a few metadata rewrites, so holders come and go; a dead
    holder's lock goes stale after its lease (at once on its own host)."""
    if isinstance(storage, LocalStorage):
        with _flock(storage.root / LOCK_NAME):
            yield
        return
    assert isinstance(storage, FsspecStorage), storage
    lock = LeaseLock(storage, LOCK_NAME, holder_identity())
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


def _check_node_name(name: str) -> None:
    if not name or "/" in name or name.startswith("__") or name in (".", ".."):
        raise CacheError(f"tensor name {name!r} cannot be a zarr array name")


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


# -------------------------------------------------------------------------------------- sink


class ZarrSink:
    """Buffers one writer shard; `end()` claims rows under a file lock and writes whole shards."""

    suffix = ".zarr"

    def __init__(
        self,
        cache: str | Path | Storage,
        *,
        block_records: int | None = None,
        token_chunk: int | None = None,
        token_block: int | None = None,
        compression: tuple[str, int] | None = None,
    ) -> None:
        """Layout defaults are the module constants, read at call time; they only matter when
        this sink creates the group; an existing group's recorded layout always wins."""
        block_records = BLOCK_RECORDS if block_records is None else block_records
        token_chunk = TOKEN_CHUNK if token_chunk is None else token_chunk
        token_block = TOKEN_BLOCK if token_block is None else token_block
        if block_records <= 0 or token_chunk <= 0 or token_block % token_chunk:
            raise ValueError("need block_records > 0 and token_block a multiple of token_chunk")
        self.storage = storage_of(cache)
        self.block_records = block_records
        self.token_chunk = token_chunk
        self.token_block = token_block
        self.compression = compression
        """(codec, level) for new arrays' inner chunks (the manifest's fields declare it)."""
        self._pool: dict[str, np.ndarray] = {}
        """Per-field block buffers, reused from shard to shard (fresh memory costs page faults)."""
        self._reset(None)

    def _reset(self, name: str | None) -> None:
        self.name = name
        self._meta: list[dict[str, Any]] = []
        self._dtypes: dict[str, DType] = {}
        self._items: dict[str, tuple[int, ...]] = {}
        """Dense field -> item shape; ragged field -> (width,)."""
        self._dense: dict[str, np.ndarray] = {}
        """Dense field -> (capacity, *item) block; rows [0, records) are filled."""
        self._tokens: dict[str, np.ndarray] = {}
        """Ragged field -> (capacity, width) block; its records' tokens back to back."""
        self._spans: dict[str, list[tuple[int, int] | None]] = {}
        """Ragged field -> per record (first token in the block, length), None when absent."""
        self._used: dict[str, int] = {}

    # ----------------------------------------------------------------- buffering

    def begin(self, name: str) -> None:
        self._reset(name)

    def _block(self, key: str, rows: int, item: tuple[int, ...], dtype: DType) -> np.ndarray:
        """A (>= rows, *item) buffer for field `key`, from the pool when one fits."""
        np_dtype = np.dtype(dtype.numpy)
        buf = self._pool.get(key)
        if buf is None or buf.shape[0] < rows or buf.shape[1:] != item or buf.dtype != np_dtype:
            buf = np.empty((rows, *item), dtype=np_dtype)
            self._pool[key] = buf
        return buf

    def _grow_block(
        self, key: str, buf: np.ndarray, used: int, rows: int, dtype: DType
    ) -> np.ndarray:
        """`buf` with room for `rows` rows, keeping its first `used` rows."""
        if buf.shape[0] >= rows:
            return buf
        self._pool.pop(key, None)
        new = self._block(key, max(rows, 2 * buf.shape[0]), buf.shape[1:], dtype)
        new[:used] = buf[:used]
        return new

    def _check(self, record: Record) -> list[tuple[str, torch.Tensor, DType]]:
        """Every tensor of `record` with its dtype, or CacheError: nothing is buffered yet."""
        where = f"record {record.key}"
        tensors = record.tensors()
        dense = {k for k in tensors if k not in RAGGED}
        if self._meta and dense != set(self._dense):
            raise CacheError(
                f"{where} has tensors {sorted(dense)}, the shard's first record had "
                f"{sorted(self._dense)}"
            )
        checked = []
        for name, t in tensors.items():
            _check_node_name(name)
            dtype = _dtype_of(t)
            known = self._dtypes.get(name, dtype)
            if known != dtype:
                raise CacheError(
                    f"{where}: {name} is {dtype.name}, earlier records have {known.name}"
                )
            shape = tuple(int(d) for d in t.shape)
            item = self._items.get(name)
            if name in RAGGED:
                if len(shape) != 2:
                    raise CacheError(f"{where}: {name} must be (L, D), got {list(shape)}")
                if item is not None and item[0] != shape[1]:
                    raise CacheError(f"{where}: {name} width {shape[1]} != {item[0]}")
            elif item is not None and item != shape:
                raise CacheError(
                    f"{where}: {name} has shape {list(shape)}, earlier records have {list(item)}"
                )
            checked.append((name, t.detach().cpu(), dtype))
        return checked

    def add(self, record: Record) -> None:
        checked = self._check(record)
        n = len(self._meta)
        # Copy each tensor once, straight into its row of the shard's block. (numpy, not torch's
        # copy_: that wakes the OpenMP pool, whose threads then spin for nothing.)
        for name, t, dtype in checked:
            self._dtypes[name] = dtype
            if name in RAGGED:
                length, width = (int(d) for d in t.shape)
                self._items.setdefault(name, (width,))
                spans = self._spans.setdefault(name, [None] * n)
                pos = self._used.get(name, 0)
                buf = self._tokens.get(name)
                if buf is None:
                    buf = self._block(
                        name, max(pos + length, 4 * self.block_records), (width,), dtype
                    )
                buf = self._grow_block(name, buf, pos, pos + length, dtype)
                self._tokens[name] = buf
                buf[pos : pos + length] = _numpy_view(t, dtype)
                spans.append((pos, length))
                self._used[name] = pos + length
            else:
                self._items.setdefault(name, tuple(t.shape))
                buf = self._dense.get(name)
                if buf is None:
                    buf = self._block(name, self.block_records, self._items[name], dtype)
                buf = self._grow_block(name, buf, n, n + 1, dtype)
                self._dense[name] = buf
                buf[n] = _numpy_view(t, dtype)
        for spans in self._spans.values():
            if len(spans) == n:  # this record has no such tensor
                spans.append(None)
        self._meta.append(record.meta())

    def abort(self) -> None:
        """Drop the buffered records (and the buffers); nothing was claimed, or what was stays
        unused."""
        self._pool.clear()
        self._reset(None)

    # ----------------------------------------------------------------- publishing

    def _open_group(self, store: _SealingStore) -> tuple[Any, dict[str, Any]]:
        """The group (created with this sink's layout if new) and its recorded layout."""
        check_metadata(self.storage)
        group = _zarr_call(
            f"{DATA_NAME} in {self.storage.url!r}",
            lambda: zarr.open_group(store=store, mode="a", zarr_format=3),
        )
        if GROUP_ATTR not in group.attrs:
            group.attrs[GROUP_ATTR] = {
                "format": FORMAT_NAME,
                "block_records": self.block_records,
                "token_chunk": self.token_chunk,
                "token_block": self.token_block,
                "note": "rows are committed only via manifest.json / journal entries",
            }
            store.make_durable()
            if isinstance(self.storage, LocalStorage):
                fsync_dir(self.storage.root)
        return group, dict(group.attrs[GROUP_ATTR])

    def _require(
        self,
        group: Any,
        path: str,
        item: tuple[int, ...],
        dtype: DType,
        chunks: tuple[int, ...],
        shards: tuple[int, ...],
        fill: int,
    ) -> Any:
        """Open array `path` or create it with zero rows."""
        if path in group:
            arr = group[path]
            have = (_array_dtype(arr), tuple(arr.shape[1:]))
            if have != (dtype, item) or tuple(arr.shards) != shards:
                raise CacheError(
                    f"zarr array {DATA_NAME}/{path} holds {have[0].name} items of shape "
                    f"{list(have[1])} in shards {arr.shards}, this shard has {dtype.name} "
                    f"{list(item)} in shards {shards}",
                    fix="write to a new cache directory",
                )
            # write_empty_chunks is runtime config, not stored metadata: set it on every open.
            return arr.with_config(_WRITE_CONFIG)
        return group.create_array(
            path,
            shape=(0, *item),
            dtype=dtype.numpy,
            chunks=chunks,
            shards=shards,
            compressors=[*self._compressors(), Crc32cCodec()],
            fill_value=fill,
            attributes={ZARR_DTYPE_ATTR: dtype.name} if dtype.as_bits else {},
            config=_WRITE_CONFIG,
        )

    def _compressors(self) -> list[Any]:
        if self.compression is None:
            return []
        codec, level = self.compression
        assert codec == "zstd", codec  # the only codec formats.FieldSpecModel admits
        return [ZstdCodec(level=level)]

    def _arrays(self, group: Any, cfg: dict[str, Any]) -> dict[str, Any]:
        """Every array this shard writes, by path, created when missing."""
        block, tchunk, tblock = (
            int(cfg[k]) for k in ("block_records", "token_chunk", "token_block")
        )
        out: dict[str, Any] = {}
        for name in self._dense:
            item = self._items[name]
            full = tuple(max(1, d) for d in item)
            per_step = is_step_field(name) and len(item) >= 2
            chunks = (1, 1, *full[1:]) if per_step else (1, *full)
            dtype = self._dtypes[name]
            out[name] = self._require(group, name, item, dtype, chunks, (block, *full), 0)
        offsets = DTYPE_BY_NAME["int64"]
        for name in self._spans:
            (width,) = self._items[name]
            w = max(1, width)
            dtype = self._dtypes[name]
            out[f"{name}/values"] = self._require(
                group, f"{name}/values", (width,), dtype, (tchunk, w), (tblock, w), 0
            )
            out[f"{name}/offsets"] = self._require(
                group, f"{name}/offsets", (2,), offsets, (block, 2), (block, 2), -1
            )
        return out

    @staticmethod
    def _record_arrays(group: Any) -> list[Any]:
        """Every record-indexed array of the group (ragged offsets included, values not)."""
        out = [arr for _, arr in group.arrays()]
        out.extend(group[f"{name}/offsets"] for name in RAGGED if f"{name}/offsets" in group)
        return out

    def _claim(self, store: _SealingStore, n: int) -> tuple[dict[str, Any], int, int, dict]:
        """Under the lock: create arrays, claim rows and tokens, grow every array to cover them.
        Returns (arrays by path, first row, reserved stop, token range per ragged field)."""
        group, cfg = self._open_group(store)
        block, tblock = int(cfg["block_records"]), int(cfg["token_block"])
        arrays = self._arrays(group, cfg)
        record_arrays = self._record_arrays(group)
        start = _ceil_to(max((int(a.shape[0]) for a in record_arrays), default=0), block)
        reserved = start + _ceil_to(n, block)
        token_rows: dict[str, tuple[int, int]] = {}
        for name in self._spans:
            values, total = arrays[f"{name}/values"], self._used.get(name, 0)
            t0 = _ceil_to(int(values.shape[0]), tblock)
            token_rows[name] = (t0, t0 + total)
            if total:
                values.resize((t0 + _ceil_to(total, tblock), *values.shape[1:]))
        for arr in record_arrays:  # all of them: every offsets array covers every record
            if int(arr.shape[0]) < reserved:
                arr.resize((reserved, *arr.shape[1:]))
        arrays = {path: group[path].with_config(_WRITE_CONFIG) for path in arrays}  # new shapes
        return arrays, start, reserved, token_rows

    def _write(
        self, arrays: dict[str, Any], start: int, token_rows: dict[str, tuple[int, int]]
    ) -> None:
        """Outside the lock: these zarr shards belong to this writer alone. One write per array,
        straight from the shard's block, all arrays at once on zarr's event loop (one array's
        hashing and file writes overlap the next one's encoding)."""
        n = len(self._meta)
        writes = [
            (arrays[name], slice(start, start + n), self._dense[name][:n]) for name in self._dense
        ]
        for name, spans in self._spans.items():
            t0, t1 = token_rows[name]
            offs = np.full((n, 2), -1, dtype=np.int64)
            for i, span in enumerate(spans):
                if span is not None:
                    offs[i] = (t0 + span[0], span[1])
            writes.append((arrays[f"{name}/offsets"], slice(start, start + n), offs))
            if t1 > t0:
                writes.append(
                    (arrays[f"{name}/values"], slice(t0, t1), self._tokens[name][: t1 - t0])
                )
        for group in _by_bytes(writes, WRITE_GATHER_BYTES):
            results = sync(_gather([arr.async_array.setitem(sel, b) for arr, sel, b in group]))
            for err in results:
                if isinstance(err, BaseException):
                    raise err

    def end(self) -> dict[str, Any]:
        n = len(self._meta)
        if n == 0:
            raise CacheError("ZarrSink.end() with no records")
        self.storage.makedirs("")
        store = _SealingStore(zarr_store(self.storage))
        try:
            with claim_lock(self.storage):
                arrays, start, reserved, token_rows = self._claim(store, n)
            store.sealed.clear()  # from here on, only this shard's zarr shard files are written
            store.sync_on_write = True  # outside the lock: sync each file as soon as it is written
            with (
                _WRITE_CONFIG_LOCK,
                zarr.config.set({"codec_pipeline.batch_size": WRITE_BATCH_CHUNKS}),
            ):
                self._write(arrays, start, token_rows)
            store.make_durable()  # the claim's zarr.json rewrites and this shard's files
            entry = entry_json(
                rows=(start, start + n),
                reserved=(start, reserved),
                token_rows=token_rows,
                fields=sorted([*self._dense, *self._spans]),
                meta=self._meta,
                sha256={key: digest for key, (_, digest) in sorted(store.sealed.items())},
                nbytes=sum(size for size, _ in store.sealed.values()),
            )
        finally:
            if n < self.block_records:  # a short shard is usually a writer's last: free memory
                self._pool.clear()
            self._reset(None)
        return entry


def entry_json(
    *,
    rows: tuple[int, int],
    reserved: tuple[int, int],
    token_rows: dict[str, tuple[int, int]],
    fields: list[str],
    meta: list[dict[str, Any]],
    sha256: dict[str, str],
    nbytes: int,
) -> dict[str, Any]:
    """A zarr shard entry as the sink commits it (`files.ZarrEntry` once the CacheWriter adds
    name, rank, records and keys): the rows it committed and reserved, each ragged field's
    tokens, its tensor names, per-record metadata and every zarr shard file it wrote."""
    return {
        "file": DATA_NAME,
        "rows": list(rows),
        "reserved": list(reserved),
        "token_rows": {k: list(v) for k, v in token_rows.items()},
        "fields": list(fields),
        "meta": list(meta),
        "bytes": nbytes,
        "sha256": dict(sha256),
    }


# ------------------------------------------------------------------------------------ source


class ZarrSource:
    """Reads committed rows through zarr-python, thread-safe.

    Arrays are opened once (and again only when a writer has grown one past what this reader
    saw); shard indexes are cached by zarr's CacheStore (`index_cache_bytes`)."""

    def __init__(
        self, cache: str | Path | Storage, *, index_cache_bytes: int = INDEX_CACHE_BYTES
    ) -> None:
        self.storage = storage_of(cache)
        self.store = _ReadStore(zarr_store(self.storage, read_only=True), index_cache_bytes)
        self._listing: frozenset[str] | None = None
        self._group: Any = None
        self._arrays: dict[str, tuple[Any, DType]] = {}
        self._small: dict[tuple[str, int, str], np.ndarray] = {}
        if self._has_group():  # bad metadata: one error at open, not one per record read
            check_metadata(self.storage)

    def _has_group(self) -> bool:
        return self.storage.exists(f"{DATA_NAME}/zarr.json")

    def _open_group(self) -> Any:
        if self._group is None:
            if not self._has_group():
                raise CacheError(f"cache {self.storage.url!r} has no {DATA_NAME} group")
            check_metadata(self.storage)
            self._group = _zarr_call(
                f"{DATA_NAME} in {self.storage.url!r}",
                lambda: zarr.open_group(store=self.store, mode="r", zarr_format=3),
            )
        return self._group

    def _array(self, path: str, rows: int) -> tuple[Any, DType]:
        """Array `path` with at least `rows` rows, and its stored dtype."""
        got = self._arrays.get(path)
        if got is None or got[0].shape[0] < rows:
            group = self._open_group()
            where = f"{DATA_NAME}/{path}/zarr.json"
            if not _zarr_call(where, lambda: path in group):
                raise KeyError(f"{DATA_NAME} has no array {path!r}")
            arr = _zarr_call(where, lambda: group[path])
            got = (arr, _array_dtype(arr))
            self._arrays[path] = got  # (a racing thread stores an equal pair)
            if arr.shape[0] < rows:
                raise CacheError(
                    f"{DATA_NAME}/{path} has {arr.shape[0]} rows, the manifest needs {rows}"
                )
        return got

    # -------------------------------------------------------------- reads

    def _small_rows(self, e: ZarrEntry, path: str) -> np.ndarray | None:
        """Rows of a small-row array (offsets, timesteps) for a whole shard entry, read once;
        None when that read fails (a damaged record among them): then each record's row is read
        on its own, so one bad record does not take its neighbours down."""
        key = (e.name, e.rows[0], path)
        got = self._small.get(key)
        if got is None:
            arr, _ = self._array(path, e.rows[1])
            try:
                got = np.asarray(arr[e.rows[0] : e.rows[1]])
            except (ValueError, OSError) as err:
                if isinstance(_as_chunk_error(err, []), ZarrChunkError):
                    return None
                raise
            self._small[key] = got
        return got

    def _row(self, path: str, row: int) -> np.ndarray:
        """One row of array `path`, read on its own."""
        arr, _ = self._array(path, row + 1)
        try:
            return np.asarray(arr[row])
        except Exception as err:
            raise _as_chunk_error(err, _shard_files(arr, row, row + 1)) from None

    def _is_small(self, path: str) -> bool:
        arr, _ = self._array(path, 0)
        return int(np.prod(arr.shape[1:])) * arr.dtype.itemsize <= SMALL_ROW_BYTES

    def _plan(
        self, e: ZarrEntry, i: int, name: str, step: int | None
    ) -> tuple[str, Any, int, int] | torch.Tensor | None:
        """How to read field `name` of record i: (array path, selection, first and stop index
        on axis 0) for zarr, a tensor (a copy) from a small-row cache, or None when absent."""
        row = e.rows[0] + i
        if name in RAGGED:
            offsets = self._small_rows(e, f"{name}/offsets")
            pair = self._row(f"{name}/offsets", row) if offsets is None else offsets[i]
            start, length = (int(x) for x in pair)
            if length < 0:
                return None
            return f"{name}/values", slice(start, start + length), start, start + length
        sel: Any = row if step is None else (row, step)
        rows = self._small_rows(e, name) if self._is_small(name) else None
        if rows is None:
            return name, sel, row, row + 1
        value = rows[i] if step is None else rows[i, step]
        return to_torch(np.array(value), self._array(name, 0)[1])

    def _read(
        self, data: ZarrEntry, i: int, wanted: dict[str, int | None], *, missing_ok: bool
    ) -> dict[str, torch.Tensor]:
        e = data
        if not 0 <= i < e.records:
            raise IndexError(f"shard {e.name} has {e.records} records, no record {i}")
        key = e.keys[i] if i < len(e.keys) else f"#{i}"
        where = f"shard {e.name} record {key}"
        out: dict[str, torch.Tensor] = {}
        reads: list[tuple[str, str, Any, int, int]] = []
        for name, step in wanted.items():
            if name not in e.fields:
                raise KeyError(f"{where} has no {name!r}")
            try:
                plan = self._plan(e, i, name, step)
            except ZarrChunkError as err:
                raise ZarrChunkError(f"{where}: {name}: {err.message}") from None
            if plan is None:
                if not missing_ok:
                    raise KeyError(f"{where} has no {name!r}")
            elif isinstance(plan, torch.Tensor):
                out[name] = plan
            else:
                reads.append((name, *plan))
        if not reads:
            return out
        arrays = [self._array(path, stop) for _, path, _, _, stop in reads]
        got = sync(
            _gather(
                [arr.async_array.getitem(r[2]) for (arr, _), r in zip(arrays, reads, strict=True)]
            )
        )
        for (name, _, _, a, b), (arr, dtype), value in zip(reads, arrays, got, strict=True):
            if isinstance(value, BaseException):
                err = _as_chunk_error(value, _shard_files(arr, a, b))
                if isinstance(err, ZarrChunkError):
                    raise ZarrChunkError(f"{where}: {name}: {err.message}") from None
                raise err
            out[name] = to_torch(value, dtype)
        return out

    def read_tensors(
        self, entry: ZarrEntry, i: int, wanted: dict[str, int | None]
    ) -> dict[str, torch.Tensor]:
        return self._read(entry, i, wanted, missing_ok=False)

    def _shape(self, plan: tuple[str, Any, int, int] | torch.Tensor) -> Shape:
        """(shape, torch dtype) of what a `_plan` reads."""
        if isinstance(plan, torch.Tensor):
            return tuple(plan.shape), plan.dtype
        path, sel, a, b = plan
        arr, dtype = self._array(path, b)
        if isinstance(sel, slice):
            return (b - a, *arr.shape[1:]), dtype.torch
        return tuple(arr.shape[1 if isinstance(sel, int) else len(sel) :]), dtype.torch

    def read_batch(
        self, samples: list[tuple[ZarrEntry, int, dict[str, int | None]]], out: BatchBuffers
    ) -> list[BaseException | None]:
        """Read each (entry, record, wanted) sample straight into its row of `out` (the
        training reader's hot path): every field of every sample is one
        `AsyncArray.get_orthogonal_selection(..., out=<its row>)`, all of them in one
        `asyncio.gather` on zarr's event loop, so zarr decodes each chunk (and checks its
        crc32c) into the batch tensor itself. Returns each sample's error, or None."""
        plans: list[dict[str, Any] | None] = []
        errors: list[BaseException | None] = []
        for entry, i, wanted in samples:
            try:
                e = entry
                if not 0 <= i < e.records:
                    raise IndexError(f"shard {e.name} has {e.records} records, no record {i}")
                where = f"shard {e.name} record {e.keys[i] if i < len(e.keys) else f'#{i}'}"
                plan: dict[str, Any] = {}
                for name, step in wanted.items():
                    got = self._plan(e, i, name, step) if name in e.fields else None
                    if got is None:
                        raise KeyError(f"{where} has no {name!r}")
                    plan[name] = got
                plans.append(plan)
                errors.append(None)
            except Exception as err:
                plans.append(None)
                errors.append(err)
        problems = out.allocate(
            [None if p is None else {n: self._shape(x) for n, x in p.items()} for p in plans]
        )
        reads: list[tuple[int, str, tuple[str, Any, int, int]]] = []
        coros = []
        proto = default_buffer_prototype()
        for b, plan in enumerate(plans):
            if plan is None or problems[b] is not None:
                errors[b] = errors[b] or (ValueError(problems[b]) if problems[b] else None)
                continue
            for name, x in plan.items():
                row = out.row(b, name)
                if isinstance(x, torch.Tensor):
                    row.copy_(x)
                elif row.numel():
                    arr, dtype = self._array(x[0], x[3])
                    dest = proto.nd_buffer.from_numpy_array(_numpy_view(row, dtype))
                    coros.append(arr.async_array.get_orthogonal_selection(x[1], out=dest))
                    reads.append((b, name, x))
        for (b, name, (path, _, a, stop)), value in zip(reads, sync(_gather(coros)), strict=True):
            if isinstance(value, BaseException) and errors[b] is None:
                err = _as_chunk_error(value, _shard_files(self._array(path, stop)[0], a, stop))
                if isinstance(err, ZarrChunkError):
                    entry, i, _ = samples[b]
                    err = ZarrChunkError(
                        f"shard {entry.name} record {entry.keys[i]}: {name}: {err.message}"
                    )
                errors[b] = err
        return errors

    def read_record(self, entry: ZarrEntry, i: int) -> Record:
        e = entry
        tensors = self._read(entry, i, dict.fromkeys(e.fields), missing_ok=True)
        return Record.from_parts(e.meta[i], tensors)

    def offsets(self, entry: ZarrEntry, name: str) -> np.ndarray:
        """(records, 2) [start, length] of ragged field `name` for one shard entry."""
        e = entry
        got = self._small_rows(e, f"{name}/offsets")
        if got is None:
            got = np.stack([self._row(f"{name}/offsets", r) for r in range(*e.rows)])
        return got

    # -------------------------------------------------------------- verify

    def _affected(self, e: ZarrEntry, rel: str) -> list[int]:
        """Indices of the entry's records stored (partly) in zarr shard file `rel`."""
        everything = list(range(e.records))
        path, _, coords = rel.partition("/c/")
        try:
            k = int(coords.split("/")[0])
            block = int(self._array(path, 0)[0].shards[0])
            lo, hi = k * block, (k + 1) * block
            if path.endswith("/values"):
                offs = self._small_rows(e, path.rsplit("/", 1)[0] + "/offsets")
                if offs is None:
                    return everything
                return [i for i, (s, m) in enumerate(offs) if m > 0 and s < hi and s + m > lo]
            return [i for i in everything if lo <= e.rows[0] + i < hi]
        except Exception:  # the metadata itself is broken: blame every record of the shard
            return everything

    def _file_problems(self, e: ZarrEntry) -> tuple[list[str], set[int]]:
        """Each listed zarr shard file against its sha256 (and the sum of sizes): problems, and
        the records whose file is missing (not decoded: zarr would read fill values)."""
        problems: list[str] = []
        skip: set[int] = set()
        total, missing = 0, False
        for rel, digest in e.sha256.items():
            try:
                self._local_file(e, rel)
            except CacheError as err:
                problems.append(err.message)
                continue
            size = self.storage.size(f"{DATA_NAME}/{rel}")
            if size is None:
                missing = True
                hit = self._affected(e, rel)
                skip.update(hit)
                problems.extend(
                    f"shard {e.name} record {e.keys[i]}: {DATA_NAME}/{rel} is missing" for i in hit
                )
                continue
            total += size
            if self.storage.sha256(f"{DATA_NAME}/{rel}") != digest:
                hit = self._affected(e, rel)
                shown = ", ".join(e.keys[i] for i in hit[:4]) + (" ..." if len(hit) > 4 else "")
                problems.append(
                    f"shard {e.name}: {DATA_NAME}/{rel} sha256 mismatch (changed after it was "
                    f"written; records {shown})"
                )
        if not missing and total != e.bytes:
            problems.append(f"shard {e.name}: {total} bytes on disk, manifest says {e.bytes}")
        return problems, skip

    def check_file(self, entry: ZarrEntry) -> str | None:
        """Why the shard entry cannot be read at all (a zarr shard file it lists is missing or
        outside the cache), or None. Locally a stat per file; on an object store one listing of
        data.zarr, refreshed when a file is not in it (a HEAD per file would be one request per
        zarr shard file of the whole cache)."""
        e = entry
        for rel in e.sha256:
            try:
                found = self._local_file(e, rel)
            except CacheError as err:
                return err.message
            if found is not None:
                there = found.is_file()
            else:
                there = rel in self._listed(refresh=False) or rel in self._listed(refresh=True)
            if not there:
                return f"shard {e.name}: file {DATA_NAME}/{rel} is missing"
        return None

    def _local_file(self, e: ZarrEntry, rel: str) -> Path | None:
        """The local path of zarr shard file `rel`, refused (CacheError) when it resolves
        outside the cache (a symlink); None on an object store, which has no links to follow
        (the entry's schema already refuses `..` and absolute names)."""
        if not isinstance(self.storage, LocalStorage):
            return None
        return inside(self.storage.root / DATA_NAME, rel, f"shard {e.name}: file", CacheError)

    def _listed(self, *, refresh: bool) -> frozenset[str]:
        """Every object under data.zarr on an object store, relative to it."""
        if refresh or self._listing is None:
            assert isinstance(self.storage, FsspecStorage), self.storage
            cut = len(DATA_NAME) + 1
            self._listing = frozenset(k[cut:] for k in self.storage.find(DATA_NAME))
        return self._listing

    def verify(self, entry: ZarrEntry) -> list[str]:
        """Check every zarr shard file the entry lists exists and matches its sha256, then decode
        every record."""
        e = entry
        if not self._has_group():
            return [f"shard {e.name}: {DATA_NAME} is missing"]
        problems, skip = self._file_problems(e)
        for i, key in enumerate(e.keys):
            if i in skip:
                continue
            try:
                meta = e.meta[i]
                if meta.key != key:
                    raise ValueError(f"metadata names key {meta.key!r}")
                rec = self.read_record(entry, i)
                if rec.prompt_embeds.shape[0] != meta.embed_len:
                    raise ValueError(
                        f"prompt_embeds has {rec.prompt_embeds.shape[0]} tokens, "
                        f"metadata says {meta.embed_len}"
                    )
                for t in rec.tensors().values():
                    if t.is_floating_point() and not bool(t.float().isfinite().all()):
                        raise ValueError("non-finite values")
            except Exception as err:  # every decode failure is reported, none is fatal here
                what = (
                    err.message if isinstance(err, CacheError) else f"{type(err).__name__}: {err}"
                )
                problems.append(f"shard {e.name} record {key}: {what}")
        return problems

    def close(self) -> None:
        self._arrays.clear()
        self._small.clear()
        self._group = None
        sync(self.store.indexes.clear_cache())
