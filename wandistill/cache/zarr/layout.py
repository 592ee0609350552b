"""The zarr cache's layout: its constants, the zarr store of a cache location, the checks its
metadata passes before zarr-python reads it, dtypes and shard-file arithmetic (see
`wandistill.cache.zarr`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from zarr.abc.store import Store
from zarr.storage import FsspecStore, LocalStore

from wandistill.cache.contract import (
    DTYPE_BY_NAME,
    DTYPE_NAMES,
    ZARR_DATA_NAME,
    ZARR_DTYPE_ATTR,
    DType,
)
from wandistill.cache.files import (
    ZarrArrayMeta,
    ZarrGroupAttrs,
    ZarrGroupMeta,
    ZarrNodeMeta,
)
from wandistill.checks.validate import MiB, check, parse_json
from wandistill.errors import CacheError
from wandistill.io.storage import FsspecStorage, LocalStorage, Storage, is_transient

DATA_NAME = ZARR_DATA_NAME
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


def zarr_store(storage: Storage, *, read_only: bool = False) -> Store:
    """The zarr store of the cache in `storage` (its `data.zarr`): the one place where a cache
    becomes a zarr store. A local folder gives `zarr.storage.LocalStore`; an fsspec URL gives
    `zarr.storage.FsspecStore` over the same filesystem as the rest of the cache, opened
    asynchronously (`FsspecStorage.async_fs`)."""
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
        where = f"{where}: attributes.{GROUP_ATTR}"
        check(ZarrGroupAttrs, group.attributes[GROUP_ATTR], where, fix=_META_FIX, error=CacheError)


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


def group_arrays(group: Any) -> dict[str, Any]:
    """Every array of a cache's group by path, the ragged fields' `values` and `offsets`
    included (an array whose path ends in `/values` is indexed by token, any other by record)."""
    arrays = dict(group.arrays())
    for name in RAGGED:
        for part in ("values", "offsets"):
            if f"{name}/{part}" in group:
                arrays[f"{name}/{part}"] = group[f"{name}/{part}"]
    return arrays


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
    if isinstance(err, ZarrChunkError | IndexError | KeyError) or is_transient(err):
        return err
    if not isinstance(err, OSError | ValueError):
        return err
    shown = ", ".join(f"{DATA_NAME}/{f}" for f in files)
    what = "fails zarr's crc32c check or decode (corrupt or truncated file)"
    if isinstance(err, OSError):
        what = "cannot be read"
    return ZarrChunkError(f"{shown} {what}: {type(err).__name__}: {err}")
