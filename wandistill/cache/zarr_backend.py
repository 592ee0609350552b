"""zarr v3 backend: one group `<cache>/data.zarr` of per-field arrays indexed by record row.

On-disk layout (every array uses the sharding codec; inner chunks carry a crc32c checksum and are
not compressed, since float latents do not compress and partial reads stay cheap)::

    data.zarr/                       group; attrs["wandistill"] = {block_records, token_block, ...}
      noise          (N,C,F,H,W)     chunk (1,C,F,H,W)    zarr shard (block,C,F,H,W)
      final_latent   (N,C,F,H,W)     chunk (1,C,F,H,W)    zarr shard (block,C,F,H,W)
      timesteps      (N,S)           chunk (1,S)          zarr shard (block,S)
      xt             (N,S,C,F,H,W)   chunk (1,1,C,F,H,W)  zarr shard (block,S,C,F,H,W)
      teacher_out    (N,S,C,F,H,W)   chunk (1,1,C,F,H,W)  zarr shard (block,S,C,F,H,W)
      feature.<name> (N,S,...)       chunk (1,1,...)      zarr shard (block,S,...)
      prompt_embeds/values   (T,D)   ragged, NOT padded: every record's tokens back to back
      prompt_embeds/offsets  (N,2)   int64 [start, length] into values; [-1, -1] = no embedding
      negative_prompt_embeds/{values,offsets}   same, only once some record carries one

A step field is chunked one (record, step) per inner chunk, so a training sample that wants one
recorded step reads exactly that chunk (plus the zarr shard's index). bf16 has no zarr dtype: it
is stored as `uint16` (the same bits) with array attribute `{"wandistill_dtype": "bfloat16"}`.
Every other dtype is native. Dtypes and trailing shapes are fixed by the first record that
creates an array; later records must match.

Per-record metadata (key, prompt, seed, embed_len, extra) is NOT in zarr: it lives in the shard's
manifest entry as `entry["meta"]`, a list parallel to `entry["keys"]`. The manifest (plus the
per-rank journals) is the commit record anyway, and a stock reader needs it to know which rows
are committed; a zarr string array would add a non-spec dtype for no gain.

Row ownership and concurrency. zarr 3.1 rewrites a whole zarr shard on every write that touches
it (read-modify-write with no locking), so two partial writes into one zarr shard lose rows, and
`resize` is a metadata rewrite that concurrent processes race on. Hence:

* the sink buffers one writer shard (`begin..end`) in memory, each record copied once into its
  row of a preallocated block per field (reused from shard to shard); `end()` takes an exclusive
  `fcntl.flock` on `<cache>/data.zarr.lock`, creates missing arrays, re-reads each array's
  metadata, claims the next free row range (rounded up to whole zarr shards of `block` rows) and
  token range per ragged field (rounded up to whole zarr shards of `token_block` tokens), grows
  the arrays (never shrinks) and fsyncs their metadata, then releases the lock;
* outside the lock, it writes each array with a single `arr[a:b] = block`; the row/token ranges
  are disjoint and zarr-shard aligned, so no other writer ever touches those shard files;
* zarr writes through `_SealingStore`, a LocalStore that fsyncs every file it writes and hashes
  the bytes zarr hands it (so no shard file is read back to hash it); the written shard files
  are listed with size and sha256 in the entry; the CacheWriter then
  commits the entry in its journal. Rows reserved but never committed (a writer killed
  mid-shard, `abort()`, a failed `end()`) are simply never listed, and readers ignore them.

`block` is the sink's `block_records` (CacheWriter passes its shard_records; the default is
BLOCK_RECORDS = 64). It only sets the zarr shard (file) size: a writer shard of n records claims
ceil(n/block) zarr shards, and unwritten rows of its last one cost array shape only, no disk.
Once the group exists, its recorded block wins.

Shard manifest entry (CacheWriter adds name, rank, records, keys)::

    {"file": "data.zarr", "rows": [start, start+n], "reserved": [start, claimed_stop],
     "token_rows": {"prompt_embeds": [t0, t1], ...},   # this shard's tokens, per ragged field
     "fields": [tensor names present], "meta": [record.meta(), ...],
     "bytes": total size of the zarr shard files written,
     "sha256": {"<array path>/c/<k>/0/...": sha256 of that zarr shard file, ...}}

Reading with stock zarr (no wandistill code): open `zarr.open_group(cache/"data.zarr", mode="r")`,
take record i of shard entry e at row `e["rows"][0] + i`; `s, n = g["prompt_embeds/offsets"][row]`
then `g["prompt_embeds/values"][s:s+n]`; an array with attrs wandistill_dtype == "bfloat16" is
`torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)`.

Fast read path. zarr-python funnels every read through its single event-loop thread (~1 ms
each), which serialises a threaded reader. `ZarrSource` therefore reads the layout above itself:
a sharded array's shard file ends with (index_location "end"; "start" is handled too) an index of
little-endian uint64 (offset, nbytes) pairs, one per inner chunk in C order of the chunk's
position in the shard, then the index's crc32c; an inner chunk is the raw little-endian items
followed by their crc32c. Each shard file's index is read once and cached (a committed shard file
is never rewritten), and inner chunks are `os.preadv`-ed straight into the `torch.empty` tensor
that is returned (no intermediate buffer), coalescing chunks that are adjacent in the file into
one call. Checksums: every inner chunk a read touches is verified against its crc32c
(google_crc32c, ~8 GB/s), on the training hot path too. A chunk that is only partly wanted (the
first and last 32-token chunk of a ragged embedding, one timestep out of a record's row) is still
read whole, by the same preadv: the wanted bytes land in the tensor, the rest of the chunk and
the 4-byte checksums in small side buffers, and the crc32c is extended over the pieces in order,
so nothing is copied. The cost is the rest of those edge chunks (adjacent in the file, so the same
I/O request) and ~0.1 ms of crc32c per Wan sample. An inner chunk absent from the index
(offset = nbytes = 2**64-1) reads as the fill value, as in zarr. A missing, truncated or corrupt
shard file raises `ZarrChunkError` naming the shard entry, record key and file. Arrays whose
codecs are not exactly this layout (e.g. compressed by another tool) are read through zarr-python
as before; so is everything with `ZarrSource(fast=False)`.
Stock zarr reads the same files unchanged: nothing about the format differs.

This module never pickles and does not import webdataset. `fcntl` makes it POSIX-only; on a
network filesystem the cache directory must support flock (NFSv4 does; Lustre needs -o flock).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import torch
import zarr
from zarr.codecs import Crc32cCodec
from zarr.storage import LocalStore

from wandistill.cache.formats import ZarrArrayMeta, ZarrGroupAttrs, ZarrGroupMeta, ZarrNodeMeta
from wandistill.cache.schema import (
    DTYPE_NAMES,
    DTYPES_BY_NAME,
    FORMAT_NAME,
    Record,
    is_step_field,
)
from wandistill.errors import CacheError
from wandistill.fsutil import fsync_dir
from wandistill.validate import MiB, check, inside, parse_json, read_capped

DATA_NAME = "data.zarr"
LOCK_NAME = "data.zarr.lock"
BLOCK_RECORDS = 64
"""Rows per zarr shard (file) of every record-indexed array."""
TOKEN_CHUNK = 32
"""Tokens per inner chunk of a ragged values array (a record's read touches few chunks)."""
TOKEN_BLOCK = 4096
"""Tokens per zarr shard (file) of a ragged values array; a multiple of TOKEN_CHUNK."""
RAGGED = ("prompt_embeds", "negative_prompt_embeds")
DTYPE_ATTR = "wandistill_dtype"
GROUP_ATTR = "wandistill"
MAX_OPEN_SHARDS = 256
"""Shard files a ZarrSource keeps open (with their decoded index); least recently used first out."""

_WRITE_CONFIG: dict[str, Any] = {"write_empty_chunks": True}
"""Store every chunk, even one equal to the fill value, so each shard file this writer claims
exists and holds every row it wrote (verify relies on it). Not persisted by zarr."""

_NP_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "float64": np.float64,
    "int64": np.int64,
    "int32": np.int32,
    "uint8": np.uint8,
    "bfloat16": np.uint16,
}
_MISSING = 2**64 - 1
"""Index entry (offset and nbytes) of an inner chunk that was never written: read the fill value."""
_IOV_MAX = 512
"""Buffers per preadv call (Linux allows 1024)."""
_TRANSIENT = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EINTR, errno.EAGAIN}
"""OSErrors that say nothing about the record being read (re-raised as they are)."""
_MAX_GAP = 4096
"""Bytes between two chunk reads of one shard file worth reading (and discarding) to merge them."""


class ZarrChunkError(CacheError, ValueError):
    """A zarr shard file is missing, truncated, or fails a crc32c check (fast read path).

    Also a ValueError, like zarr-python's own checksum error on the same data."""


MAX_META_BYTES = 16 * MiB
"""Cap on one zarr.json (ours are ~2 KB)."""
_META_FIX = "restore data.zarr's metadata, or re-run `wandistill precompute` into a new cache"


def check_metadata(root: Path) -> None:
    """Check every zarr.json of the group (the group's and each array's) against its schema
    before zarr-python parses it, so bad metadata is one CacheError naming the file.

    Chunk folders (`c/`) are not walked; a symlinked folder is refused (it could lead outside
    the cache). zarr-python itself is still the parser: this only bounds and types what it reads.
    """
    stack = [root]
    while stack:
        folder = stack.pop()
        meta = folder / "zarr.json"
        if meta.exists():
            _check_meta_file(meta, group_root=folder == root)
        for child in sorted(folder.iterdir()) if folder.is_dir() else ():
            if child.is_symlink():
                raise CacheError(
                    f"{str(child)!r} is a symlink inside {DATA_NAME}; refused", fix=_META_FIX
                )
            if child.is_dir() and child.name != "c":
                stack.append(child)


def _check_meta_file(meta: Path, *, group_root: bool) -> None:
    what = "zarr metadata"
    where = f"{what} {str(meta)!r} is corrupt"
    data = read_capped(meta, max_bytes=MAX_META_BYTES, what=what, fix=_META_FIX, error=CacheError)
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


def to_numpy(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """An owned numpy copy of `t` and its dtype name; bf16 becomes its uint16 bit pattern."""
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise CacheError(f"the zarr cache cannot store dtype {t.dtype}")
    t = t.detach().cpu().contiguous()
    if name == "bfloat16":
        return t.view(torch.int16).numpy().view(np.uint16).copy(), name
    return t.numpy().copy(), name


def to_torch(a: np.ndarray, dtype: str) -> torch.Tensor:
    """A tensor over `a` (zarr hands out fresh, writable arrays); uint16 bits back to bf16."""
    a = np.asarray(a)
    if not a.flags.c_contiguous:  # (np.ascontiguousarray would turn 0-d into 1-d)
        a = a.copy(order="C")
    if dtype == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _numpy_view(t: torch.Tensor, dtype: str) -> np.ndarray:
    """A numpy array over a CPU tensor's memory (no copy); bf16 as its uint16 bits."""
    if dtype == "bfloat16":
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """The bytes of a fresh, contiguous tensor as a writable flat uint8 numpy array (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _array_dtype(arr: Any) -> str:
    name = arr.attrs.get(DTYPE_ATTR, np.dtype(arr.dtype).name)
    if name not in DTYPES_BY_NAME:
        raise CacheError(
            f"{DATA_NAME}/{arr.path} holds {str(name)[:40]!r} items, not a dtype wandistill writes",
            fix=_META_FIX,
        )
    return str(name)


def _ceil_to(n: int, block: int) -> int:
    return -(-n // block) * block


def _shard_keys(arr: Any, start: int, stop: int) -> list[str]:
    """Store keys (relative to the array) of the zarr shards covering axis-0 range [start, stop)."""
    if stop <= start:
        return []
    block = int(arr.shards[0])
    tail = (0,) * (len(arr.shape) - 1)
    return [
        arr.metadata.encode_chunk_key((k, *tail)) for k in range(start // block, -(-stop // block))
    ]


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock across processes and threads (each call opens its own fd)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last fd of this open file description drops the lock


def _hash_file(path: Path, *, fsync: bool = False) -> tuple[int, str]:
    """Size and sha256 of a file; with `fsync`, also flush it to disk (zarr does not)."""
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            sha.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(f.fileno())
    return size, sha.hexdigest()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _parents_below(path: Path, root: Path) -> list[Path]:
    """Directories from `path`'s parent up to and including `root` (to fsync new entries)."""
    out = []
    d = path.parent
    while d != root and root in d.parents:
        out.append(d)
        d = d.parent
    return [*out, root]


def _check_node_name(name: str) -> None:
    if not name or "/" in name or name.startswith("__") or name in (".", ".."):
        raise CacheError(f"tensor name {name!r} cannot be a zarr array name")


class _SealingStore(LocalStore):
    """A LocalStore that fsyncs every file zarr writes through it and remembers the file's size
    and sha256, hashed from the bytes zarr handed over: no shard file is read back to hash it.

    zarr's LocalStore writes each value with one `write` into a temp file that it renames over
    the key, so the file holds exactly `value`. Hashing and fsync run in a worker thread
    (hashlib releases the GIL), like zarr's own file write."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.sealed: dict[str, tuple[int, str]] = {}

    async def set(self, key: str, value: Any) -> None:
        await super().set(key, value)
        self.sealed[key] = await asyncio.to_thread(self._seal, key, value)

    def _seal(self, key: str, value: Any) -> tuple[int, str]:
        data = value.as_buffer_like()
        digest = hashlib.sha256(data).hexdigest()
        _fsync_path(self.root / key)
        return memoryview(data).nbytes, digest


class ZarrSink:
    """Buffers one writer shard; `end()` claims rows under a file lock and writes whole shards."""

    suffix = ".zarr"

    def __init__(
        self,
        cache: str | Path,
        *,
        block_records: int | None = None,
        token_chunk: int | None = None,
        token_block: int | None = None,
    ) -> None:
        """Layout defaults are the module constants, read at call time; they only matter when
        this sink creates the group; an existing group's recorded layout always wins."""
        block_records = BLOCK_RECORDS if block_records is None else block_records
        token_chunk = TOKEN_CHUNK if token_chunk is None else token_chunk
        token_block = TOKEN_BLOCK if token_block is None else token_block
        if block_records <= 0 or token_chunk <= 0 or token_block % token_chunk:
            raise ValueError("need block_records > 0 and token_block a multiple of token_chunk")
        self.cache = Path(cache)
        self.root = self.cache / DATA_NAME
        self.lock_path = self.cache / LOCK_NAME
        self.block_records = block_records
        self.token_chunk = token_chunk
        self.token_block = token_block
        self._pool: dict[str, np.ndarray] = {}
        """Per-field block buffers, reused from shard to shard (fresh memory costs page faults)."""
        self._reset(None)

    def _reset(self, name: str | None) -> None:
        self.name = name
        self._meta: list[dict[str, Any]] = []
        self._dtypes: dict[str, str] = {}
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

    def _block(self, key: str, rows: int, item: tuple[int, ...], dtype: str) -> np.ndarray:
        """A (>= rows, *item) buffer for field `key`, from the pool when one fits."""
        np_dtype = np.dtype(_NP_DTYPES[dtype])
        buf = self._pool.get(key)
        if buf is None or buf.shape[0] < rows or buf.shape[1:] != item or buf.dtype != np_dtype:
            buf = np.empty((rows, *item), dtype=np_dtype)
            self._pool[key] = buf
        return buf

    def _grow_block(
        self, key: str, buf: np.ndarray, used: int, rows: int, dtype: str
    ) -> np.ndarray:
        """`buf` with room for `rows` rows, keeping its first `used` rows."""
        if buf.shape[0] >= rows:
            return buf
        self._pool.pop(key, None)
        new = self._block(key, max(rows, 2 * buf.shape[0]), buf.shape[1:], dtype)
        new[:used] = buf[:used]
        return new

    def add(self, record: Record) -> None:
        where = f"record {record.key}"
        tensors = record.tensors()
        dense = {k for k in tensors if k not in RAGGED}
        n = len(self._meta)
        if n and dense != set(self._dense):
            raise CacheError(
                f"{where} has tensors {sorted(dense)}, the shard's first record had "
                f"{sorted(self._dense)}"
            )
        # Check everything first: a rejected record leaves the buffered shard as it was.
        checked: list[tuple[str, torch.Tensor, str]] = []
        for name, t in tensors.items():
            _check_node_name(name)
            dtype = DTYPE_NAMES.get(t.dtype)
            if dtype is None:
                raise CacheError(f"the zarr cache cannot store dtype {t.dtype}")
            known = self._dtypes.get(name, dtype)
            if known != dtype:
                raise CacheError(f"{where}: {name} is {dtype}, earlier records have {known}")
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

    def _open_group(self) -> tuple[Any, _SealingStore]:
        store = _SealingStore(self.root)
        check_metadata(self.root)
        group = _zarr_call(
            f"{DATA_NAME} in {str(self.root.parent)!r}",
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
            _fsync_path(self.root / "zarr.json")
            fsync_dir(self.root)
            fsync_dir(self.root.parent)
        return group, store

    def _require(
        self,
        group: Any,
        path: str,
        item: tuple[int, ...],
        dtype: str,
        chunks: tuple[int, ...],
        shards: tuple[int, ...],
        fill: Any,
    ) -> Any:
        """Open array `path`, re-reading its metadata, or create it with zero rows."""
        np_dtype = np.dtype(_NP_DTYPES[dtype])
        if path in group:
            arr = group[path]
            have = (_array_dtype(arr), tuple(arr.shape[1:]), np.dtype(arr.dtype))
            if have != (dtype, item, np_dtype):
                raise CacheError(
                    f"zarr array {DATA_NAME}/{path} holds {have[0]} items of shape "
                    f"{list(have[1])}, this shard has {dtype} {list(item)}",
                    fix="write to a new cache directory",
                )
            if tuple(arr.shards) != shards:
                raise CacheError(f"zarr array {path} has shards {arr.shards}, expected {shards}")
            # write_empty_chunks is runtime config, not stored metadata: set it on every open.
            return arr.with_config(_WRITE_CONFIG)
        attrs = {DTYPE_ATTR: dtype} if dtype == "bfloat16" else {}
        return group.create_array(
            path,
            shape=(0, *item),
            dtype=np_dtype,
            chunks=chunks,
            shards=shards,
            compressors=[Crc32cCodec()],
            fill_value=fill,
            attributes=attrs,
            config=_WRITE_CONFIG,
        )

    def _dense_layout(self, name: str, item: tuple[int, ...], block: int) -> tuple[Any, Any]:
        full = tuple(max(1, d) for d in item)
        if is_step_field(name) and len(item) >= 2:
            chunks = (1, 1, *full[1:])
        else:
            chunks = (1, *full)
        return chunks, (block, *full)

    def end(self) -> dict[str, Any]:
        n = len(self._meta)
        if n == 0:
            raise CacheError("ZarrSink.end() with no records")
        self.root.parent.mkdir(parents=True, exist_ok=True)
        with _flock(self.lock_path):
            group, store = self._open_group()
            cfg = dict(group.attrs[GROUP_ATTR])
            block = int(cfg["block_records"])
            tchunk, tblock = int(cfg["token_chunk"]), int(cfg["token_block"])
            dense: dict[str, Any] = {}
            for name in self._dense:
                item = self._items[name]
                chunks, shards = self._dense_layout(name, item, block)
                dense[name] = self._require(
                    group, name, item, self._dtypes[name], chunks, shards, 0
                )
            ragged: dict[str, tuple[Any, Any]] = {}
            for name in self._spans:
                (width,) = self._items[name]
                values = self._require(
                    group,
                    f"{name}/values",
                    (width,),
                    self._dtypes[name],
                    (tchunk, max(1, width)),
                    (tblock, max(1, width)),
                    0,
                )
                offsets = self._require(
                    group, f"{name}/offsets", (2,), "int64", (block, 2), (block, 2), -1
                )
                ragged[name] = (values, offsets)
            # The next free row: past every record-indexed array (all grow in whole blocks).
            used = [int(a.shape[0]) for a in self._record_arrays(group)]
            start = _ceil_to(max(used, default=0), block)
            reserved = start + _ceil_to(n, block)
            to_grow = [*dense.values(), *(off for _, off in ragged.values())]
            token_rows: dict[str, list[int]] = {}
            for name, (values, _) in ragged.items():
                total = self._used.get(name, 0)
                t0 = _ceil_to(int(values.shape[0]), tblock)
                token_rows[name] = [t0, t0 + total]
                if total:
                    self._grow(values, t0 + _ceil_to(total, tblock), store)
            for arr in to_grow:
                self._grow(arr, reserved, store)
            fsync_dir(self.root)

        # Outside the lock: these zarr shards belong to this writer alone. One write per array,
        # straight from the shard's block (zarr copies it into its shard files).
        written: list[tuple[Any, str, int, int]] = []  # (array, path, first, stop) on axis 0
        try:
            for name, arr in dense.items():
                arr[start : start + n] = self._dense[name][:n]
                written.append((arr, name, start, start + n))
            for name, (values, offsets) in ragged.items():
                t0, t1 = token_rows[name]
                offs = np.full((n, 2), -1, dtype=np.int64)
                for i, span in enumerate(self._spans[name]):
                    if span is not None:
                        offs[i] = (t0 + span[0], span[1])
                offsets[start : start + n] = offs
                written.append((offsets, f"{name}/offsets", start, start + n))
                if t1 > t0:
                    values[t0:t1] = self._tokens[name][: t1 - t0]
                    written.append((values, f"{name}/values", t0, t1))
            sha: dict[str, str] = {}
            total_bytes = 0
            dirs: set[Path] = set()
            for arr, path, a, b in written:
                for key in _shard_keys(arr, a, b):
                    rel = f"{path}/{key}"
                    sealed = store.sealed.get(rel)
                    if sealed is None:  # not written through the store's set(): read it back
                        sealed = _hash_file(self.root / rel, fsync=True)
                    size, sha[rel] = sealed
                    total_bytes += size
                    dirs.update(_parents_below(self.root / rel, self.root))
            for d in sorted(dirs, key=lambda p: -len(p.parts)):
                fsync_dir(d)
            fields = sorted([*self._dense, *self._spans])
            meta = self._meta
        finally:
            if n < self.block_records:  # a short shard is usually a writer's last: free memory
                self._pool.clear()
            self._reset(None)
        return {
            "file": DATA_NAME,
            "rows": [start, start + n],
            "reserved": [start, reserved],
            "token_rows": token_rows,
            "fields": fields,
            "meta": meta,
            "bytes": total_bytes,
            "sha256": sha,
        }

    @staticmethod
    def _record_arrays(group: Any) -> list[Any]:
        out = [arr for _, arr in group.arrays()]
        for name in RAGGED:
            if f"{name}/offsets" in group:
                out.append(group[f"{name}/offsets"])
        return out

    def _grow(self, arr: Any, rows: int, store: _SealingStore) -> None:
        """Grow axis 0 to `rows` (never shrink) and make the new metadata durable."""
        if int(arr.shape[0]) >= rows:
            return
        arr.resize((rows, *arr.shape[1:]))
        meta = self.root / arr.path / "zarr.json"
        if f"{arr.path}/zarr.json" not in store.sealed:  # (the store fsyncs what it writes)
            _fsync_path(meta)
        for d in _parents_below(meta, self.root):
            fsync_dir(d)


# ------------------------------------------------------------------------------ fast reads


@dataclass(frozen=True, slots=True)
class _Geometry:
    """Where one array's items live in its shard files, for reads without zarr-python.

    Supported chunkings (what ZarrSink writes), with the trailing axes whole in every chunk:
    one inner chunk per `chunks[0]` rows (`per_step` False), or per (row, step) (`per_step`)."""

    path: str
    tail: tuple[int, ...]
    """shape[1:] (one row)."""
    tdtype: torch.dtype
    itemsize: int
    cps: tuple[int, ...]
    """Inner chunks per shard, per axis."""
    strides: tuple[int, ...]
    """C-order strides of `cps`: an inner chunk's position in its shard's index."""
    rows_per_chunk: int
    per_step: bool
    chunk_nbytes: int
    """Payload bytes of one inner chunk (its crc32c excluded)."""
    crc: bool
    index_nbytes: int
    index_crc: bool
    index_at_end: bool
    fill: bytes
    """One item of the fill value."""
    encode_key: Callable[[tuple[int, ...]], str]


def _endian_ok(codec: Any) -> bool:
    if not isinstance(codec, dict) or codec.get("name") != "bytes":
        return False
    return (codec.get("configuration") or {}).get("endian", "little") == "little"


def _crc_suffix(codecs: Any) -> bool | None:
    """For [bytes(little)] or [bytes(little), crc32c]: whether crc32c is there; else None."""
    if not isinstance(codecs, list | tuple) or not 1 <= len(codecs) <= 2:
        return None
    if not _endian_ok(codecs[0]):
        return None
    if len(codecs) == 1:
        return False
    return True if isinstance(codecs[1], dict) and codecs[1].get("name") == "crc32c" else None


def _geometry(path: str, arr: Any, dtype: str) -> _Geometry | None:
    """The fast-path geometry of `arr`, or None to read it through zarr-python."""
    try:
        meta = arr.metadata.to_dict()
        tdtype = DTYPES_BY_NAME.get(dtype)
        np_dtype = np.dtype(arr.dtype)
        codecs = meta.get("codecs")
        grid = meta.get("chunk_grid") or {}
        if (
            sys.byteorder != "little"
            or tdtype is None
            or np_dtype.byteorder not in "=<|"
            or torch.empty((), dtype=tdtype).element_size() != np_dtype.itemsize
            or not isinstance(codecs, list | tuple)
            or len(codecs) != 1
            or codecs[0].get("name") != "sharding_indexed"
            or grid.get("name") != "regular"
        ):
            return None
        cfg = codecs[0].get("configuration") or {}
        crc, index_crc = _crc_suffix(cfg.get("codecs")), _crc_suffix(cfg.get("index_codecs"))
        location = cfg.get("index_location", "end")
        shape = tuple(int(d) for d in arr.shape)
        chunks = tuple(int(d) for d in cfg["chunk_shape"])
        shards = tuple(int(d) for d in grid["configuration"]["chunk_shape"])
        if (
            crc is None
            or index_crc is None
            or location not in ("start", "end")
            or not len(shape) == len(chunks) == len(shards) >= 1
            or any(c <= 0 or s % c for s, c in zip(shards, chunks, strict=True))
            or prod(shape[1:]) == 0
        ):
            return None
        tail = shape[1:]
        if chunks[1:] == tail:
            per_step = False
        elif len(shape) >= 2 and chunks[:2] == (1, 1) and chunks[2:] == tail[1:]:
            per_step = True
        else:
            return None
        cps = tuple(s // c for s, c in zip(shards, chunks, strict=True))
        strides = tuple(prod(cps[j + 1 :]) for j in range(len(cps)))
        fill = np.array(arr.metadata.fill_value, dtype=np_dtype).tobytes()
        n_chunks = prod(cps)
        return _Geometry(
            path=path,
            tail=tail,
            tdtype=tdtype,
            itemsize=np_dtype.itemsize,
            cps=cps,
            strides=strides,
            rows_per_chunk=chunks[0],
            per_step=per_step,
            chunk_nbytes=prod(chunks) * np_dtype.itemsize,
            crc=crc,
            index_nbytes=16 * n_chunks + 4 * index_crc,
            index_crc=index_crc,
            index_at_end=location == "end",
            fill=fill,
            encode_key=arr.metadata.encode_chunk_key,
        )
    except Exception:  # anything unexpected in the metadata: zarr-python knows best
        return None


Piece = tuple[tuple[int, ...], int, int, int]
"""(inner chunk coords, byte offset in the chunk's payload, length, byte offset in the output)."""


def _row_pieces(g: _Geometry, a: int, b: int) -> list[Piece]:
    """Rows [a, b) of the array, into an output of shape (b - a, *tail)."""
    zeros = (0,) * (len(g.tail) - (1 if g.per_step else 0))
    if g.per_step:
        steps = g.tail[0]
        size = g.chunk_nbytes
        return [
            ((r, t, *zeros), 0, size, ((r - a) * steps + t) * size)
            for r in range(a, b)
            for t in range(steps)
        ]
    per = g.rows_per_chunk
    row = g.chunk_nbytes // per
    out = []
    for c in range(a // per, -(-b // per)):
        lo, hi = max(a, c * per), min(b, (c + 1) * per)
        out.append(((c, *zeros), (lo - c * per) * row, (hi - lo) * row, (lo - a) * row))
    return out


def _step_pieces(g: _Geometry, r: int, t: int) -> list[Piece]:
    """Item [r, t] of the array, into an output of shape tail[1:]."""
    if g.per_step:
        return [((r, t, *(0,) * (len(g.tail) - 1)), 0, g.chunk_nbytes, 0)]
    per = g.rows_per_chunk
    row = g.chunk_nbytes // per
    step = row // g.tail[0]
    c = r // per
    return [((c, *(0,) * len(g.tail)), (r - c * per) * row + t * step, step, 0)]


class _ShardFile:
    """One open shard file and its decoded index; closed once evicted and no longer in use."""

    __slots__ = ("data_end", "data_start", "dropped", "fd", "index", "rel", "users")

    def __init__(self, rel: str, fd: int, index: np.ndarray, start: int, end: int) -> None:
        self.rel = rel
        self.fd = fd
        self.index = index
        self.data_start = start
        self.data_end = end
        self.users = 0
        self.dropped = False


def _open_shard(root: Path, rel: str, g: _Geometry) -> _ShardFile:
    where = f"{DATA_NAME}/{rel}"
    try:
        fd = os.open(root / rel, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ZarrChunkError(f"{where} is missing") from None
    try:
        size = os.fstat(fd).st_size
        need = g.index_nbytes
        if size < need:
            raise ZarrChunkError(
                f"{where} is truncated: {size} bytes, its shard index alone is {need}"
            )
        raw = os.pread(fd, need, size - need if g.index_at_end else 0)
        if len(raw) != need:
            raise ZarrChunkError(f"{where}: short read of its shard index (file truncated?)")
        if g.index_crc and google_crc32c.value(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
            raise ZarrChunkError(
                f"{where}: shard index crc32c checksum mismatch (file truncated or corrupt)"
            )
        index = np.frombuffer(raw, dtype="<u8", count=need // 16 * 2).reshape(-1, 2)
        start, end = (0, size - need) if g.index_at_end else (need, size)
        return _ShardFile(rel, fd, index, start, end)
    except BaseException:
        os.close(fd)
        raise


class ZarrSource:
    """Reads committed rows, thread-safe.

    The fast path (see the module docstring) preads inner chunks straight into fresh tensors;
    `fast=False`, or an array in a layout it does not know, reads through zarr-python. Arrays
    are opened once (and re-opened only when a writer has grown one past what this reader saw);
    shard files stay open, with their decoded index, up to `max_open` of them."""

    def __init__(
        self, cache: str | Path, *, fast: bool = True, max_open: int | None = None
    ) -> None:
        self.cache = Path(cache)
        self.root = self.cache / DATA_NAME
        self.fast = fast
        self.max_open = max(1, MAX_OPEN_SHARDS if max_open is None else max_open)
        self._lock = threading.Lock()
        self._group: Any = None
        self._arrays: dict[str, tuple[Any, str, _Geometry | None]] = {}
        self._offsets: dict[tuple[str, int, str], np.ndarray] = {}
        self._files: OrderedDict[str, _ShardFile] = OrderedDict()
        if self.root.is_dir():  # bad metadata: one error at open, not one per record read
            check_metadata(self.root)

    def _open_group(self) -> Any:
        if self._group is None:
            if not (self.root / "zarr.json").is_file():
                raise CacheError(f"cache {str(self.cache)!r} has no {DATA_NAME} group")
            check_metadata(self.root)
            self._group = _zarr_call(
                f"{DATA_NAME} in {str(self.cache)!r}",
                lambda: zarr.open_group(str(self.root), mode="r", zarr_format=3),
            )
        return self._group

    def _array(self, path: str, rows: int) -> tuple[Any, str, _Geometry | None]:
        """Array `path` with at least `rows` rows, its stored dtype name and fast geometry."""
        got = self._arrays.get(path)
        if got is None or got[0].shape[0] < rows:
            with self._lock:
                got = self._arrays.get(path)
                if got is None or got[0].shape[0] < rows:
                    group = self._open_group()
                    where = f"{DATA_NAME}/{path}/zarr.json"
                    if not _zarr_call(where, lambda: path in group):
                        raise KeyError(f"{DATA_NAME} has no array {path!r}")
                    arr = _zarr_call(where, lambda: group[path])
                    dtype = _array_dtype(arr)
                    geom = _geometry(path, arr, dtype) if self.fast else None
                    got = (arr, dtype, geom)
                    self._arrays[path] = got
            if got[0].shape[0] < rows:
                raise CacheError(
                    f"{DATA_NAME}/{path} has {got[0].shape[0]} rows, the manifest needs {rows}"
                )
        return got

    # -------------------------------------------------------------- shard files

    def _acquire(self, rel: str, g: _Geometry) -> _ShardFile:
        with self._lock:
            f = self._files.get(rel)
            if f is not None:
                self._files.move_to_end(rel)
                f.users += 1
                return f
        new = _open_shard(self.root, rel, g)  # outside the lock: this is I/O
        with self._lock:
            f = self._files.get(rel)
            if f is not None:  # another thread opened it meanwhile
                os.close(new.fd)
                self._files.move_to_end(rel)
                f.users += 1
                return f
            new.users = 1
            self._files[rel] = new
            while len(self._files) > self.max_open:
                _, old = self._files.popitem(last=False)
                old.dropped = True
                if old.users == 0:
                    os.close(old.fd)
            return new

    def _release(self, f: _ShardFile) -> None:
        with self._lock:
            f.users -= 1
            if f.dropped and f.users == 0:
                os.close(f.fd)

    def _fill(self, g: _Geometry, pieces: list[Piece], out: np.ndarray) -> None:
        """Read the pieces' bytes into `out` (flat uint8), shard file by shard file."""
        by_shard: dict[tuple[int, ...], list[tuple[int, int, int, int]]] = {}
        for coords, skip, size, dest in pieces:
            if size == 0:
                continue
            shard = tuple(c // k for c, k in zip(coords, g.cps, strict=True))
            local = sum((c % k) * s for c, k, s in zip(coords, g.cps, g.strides, strict=True))
            by_shard.setdefault(shard, []).append((local, skip, size, dest))
        for shard, items in by_shard.items():
            f = self._acquire(f"{g.path}/{g.encode_key(shard)}", g)
            try:
                self._read_shard(f, g, items, out)
            finally:
                self._release(f)

    def _read_shard(
        self, f: _ShardFile, g: _Geometry, items: list[tuple[int, int, int, int]], out: np.ndarray
    ) -> None:
        """Read inner chunks (or parts of them) of one shard file into `out`, verifying each
        chunk's crc32c. The wanted bytes land in `out` directly; the rest of a partly wanted
        chunk and every checksum land in small side buffers filled by the same preadv, and the
        crc32c is extended over the pieces in order, so nothing is copied."""
        where = f"{DATA_NAME}/{f.rel}"
        stored = g.chunk_nbytes + 4 * g.crc
        reads: list[tuple[int, list[np.ndarray]]] = []  # (file offset, buffers filled in order)
        checks: list[tuple[int, list[np.ndarray], np.ndarray]] = []  # (chunk, payload, crc32c)
        for local, skip, size, dest in items:
            off, nbytes = (int(x) for x in f.index[local])
            target = out[dest : dest + size]
            if off == _MISSING and nbytes == _MISSING:  # never written: the fill value
                target[:] = np.frombuffer(g.fill * (size // g.itemsize), dtype=np.uint8)
                continue
            if nbytes != stored or off < f.data_start or off + nbytes > f.data_end:
                raise ZarrChunkError(
                    f"{where}: inner chunk {local} is {nbytes} bytes at offset {off}, expected "
                    f"{stored} bytes within [{f.data_start}, {f.data_end}) (file truncated, or "
                    "not the layout this reader knows)"
                )
            if not g.crc:  # nothing to check: read just the wanted bytes
                reads.append((off + skip, [target]))
                continue
            rest = g.chunk_nbytes - skip - size
            payload = [
                *([np.empty(skip, dtype=np.uint8)] if skip else []),
                target,
                *([np.empty(rest, dtype=np.uint8)] if rest else []),
            ]
            crc = np.empty(4, dtype=np.uint8)
            reads.append((off, [*payload, crc]))
            checks.append((local, payload, crc))
        reads.sort(key=lambda r: r[0])
        run_off, run_end, run = 0, 0, []  # coalesce reads that are (nearly) adjacent in the file
        for off, bufs in reads:
            length = sum(b.nbytes for b in bufs)
            if run and 0 <= off - run_end <= _MAX_GAP and len(run) + len(bufs) < _IOV_MAX:
                if off > run_end:
                    run.append(np.empty(off - run_end, dtype=np.uint8))
                run.extend(bufs)
                run_end = off + length
                continue
            if run:
                self._preadv(f, run, run_off, run_end - run_off, where)
            run_off, run_end, run = off, off + length, list(bufs)
        if run:
            self._preadv(f, run, run_off, run_end - run_off, where)
        for local, payload, crc in checks:
            value = 0
            for part in payload:
                value = google_crc32c.extend(value, part)
            if value != int(crc.view("<u4")[0]):
                raise ZarrChunkError(f"{where}: inner chunk {local} fails its crc32c checksum")

    @staticmethod
    def _preadv(f: _ShardFile, bufs: list[np.ndarray], off: int, size: int, where: str) -> None:
        got = os.preadv(f.fd, bufs, off)
        if got != size:
            raise ZarrChunkError(
                f"{where}: short read ({got} of {size} bytes at {off}; file truncated?)"
            )

    # -------------------------------------------------------------- tensors

    def _rows(self, path: str, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) of array `path`."""
        arr, dtype, g = self._array(path, b)
        if g is None:
            return to_torch(arr[a:b], dtype)
        t = torch.empty((b - a, *g.tail), dtype=g.tdtype)
        self._fill(g, _row_pieces(g, a, b), _bytes_of(t))
        return t

    def _item(self, path: str, row: int, step: int | None) -> torch.Tensor:
        """Row `row` of array `path`, or only its step `step` (index on axis 1)."""
        arr, dtype, g = self._array(path, row + 1)
        if g is None:
            return to_torch(arr[row] if step is None else arr[row, step], dtype)
        if step is None:
            t = torch.empty(g.tail, dtype=g.tdtype)
            self._fill(g, _row_pieces(g, row, row + 1), _bytes_of(t))
            return t
        steps = g.tail[0] if g.tail else 0
        if not -steps <= step < steps:
            raise IndexError(f"step {step} is out of range for {path} with {steps} steps")
        t = torch.empty(g.tail[1:], dtype=g.tdtype)
        self._fill(g, _step_pieces(g, row, step % steps), _bytes_of(t))
        return t

    def offsets(self, entry: dict[str, Any], name: str) -> np.ndarray:
        """(records, 2) [start, length] of ragged field `name` for one shard entry."""
        start, stop = entry["rows"]
        key = (entry["name"], int(start), name)
        got = self._offsets.get(key)
        if got is None:
            got = self._rows(f"{name}/offsets", int(start), int(stop)).numpy()
            got = np.asarray(got, dtype=np.int64)
            self._offsets[key] = got
        return got

    def _read(
        self,
        entry: dict[str, Any],
        i: int,
        wanted: dict[str, int | None],
        *,
        missing_ok: bool,
    ) -> dict[str, torch.Tensor]:
        n = int(entry["records"])
        if not 0 <= i < n:
            raise IndexError(f"shard {entry['name']} has {n} records, no record {i}")
        row = int(entry["rows"][0]) + i
        fields = entry.get("fields", ())
        out: dict[str, torch.Tensor] = {}
        for name, step in wanted.items():
            if name not in fields:
                raise KeyError(f"shard {entry['name']} record {entry['keys'][i]} has no {name!r}")
            try:
                if name in RAGGED:
                    s, length = (int(x) for x in self.offsets(entry, name)[i])
                    if length < 0:
                        if missing_ok:
                            continue
                        raise KeyError(
                            f"shard {entry['name']} record {entry['keys'][i]} has no {name!r}"
                        )
                    out[name] = self._rows(f"{name}/values", s, s + length)
                else:
                    out[name] = self._item(name, row, step)
            except (ZarrChunkError, OSError) as e:
                if isinstance(e, OSError) and e.errno in _TRANSIENT:
                    raise  # the process's trouble, not the record's
                msg = e.message if isinstance(e, ZarrChunkError) else f"{type(e).__name__}: {e}"
                raise ZarrChunkError(
                    f"shard {entry['name']} record {entry['keys'][i]}: {name}: {msg}"
                ) from None
        return out

    def read_tensors(
        self, entry: dict[str, Any], i: int, wanted: dict[str, int | None]
    ) -> dict[str, torch.Tensor]:
        return self._read(entry, i, wanted, missing_ok=False)

    def read_record(self, entry: dict[str, Any], i: int) -> Record:
        tensors = self._read(entry, i, dict.fromkeys(entry["fields"]), missing_ok=True)
        return Record.from_parts(entry["meta"][i], tensors)

    def _affected(self, entry: dict[str, Any], rel: str) -> list[int]:
        """Indices of the entry's records stored (partly) in zarr shard file `rel`."""
        n = int(entry["records"])
        everything = list(range(n))
        path, sep, coords = rel.partition("/c/")
        try:
            k = int(coords.split("/")[0])
            arr = self._array(path, 0)[0]
            lo, hi = k * int(arr.shards[0]), (k + 1) * int(arr.shards[0])
            if path.endswith("/values"):
                offs = self.offsets(entry, path.rsplit("/", 1)[0])
                return [i for i, (s, m) in enumerate(offs) if m > 0 and s < hi and s + m > lo]
            start = int(entry["rows"][0])
            return [i for i in everything if lo <= start + i < hi]
        except Exception:  # the metadata itself is broken: blame every record of the shard
            return everything

    def verify(self, entry: dict[str, Any]) -> list[str]:
        """Check every zarr shard file the entry lists exists and matches its sha256, then decode
        every record. A missing file is checked for first: zarr would read fill values."""
        name = entry["name"]
        keys = entry["keys"]
        if not (self.root / "zarr.json").is_file():
            return [f"shard {name}: {DATA_NAME} is missing"]
        problems: list[str] = []
        skip: set[int] = set()
        total = 0
        missing = False
        for rel, digest in entry["sha256"].items():
            try:
                path = inside(self.root, rel, f"shard {name}: file", CacheError)
            except CacheError as e:
                problems.append(e.message)
                continue
            if not path.is_file():
                missing = True
                hit = self._affected(entry, rel)
                skip.update(hit)
                problems.extend(
                    f"shard {name} record {keys[i]}: {DATA_NAME}/{rel} is missing" for i in hit
                )
                continue
            size, got = _hash_file(path)
            total += size
            if got != digest:
                hit = self._affected(entry, rel)
                shown = ", ".join(keys[i] for i in hit[:4]) + (" ..." if len(hit) > 4 else "")
                problems.append(
                    f"shard {name}: {DATA_NAME}/{rel} sha256 mismatch (changed after it was "
                    f"written; records {shown})"
                )
        if not missing and total != int(entry["bytes"]):
            problems.append(f"shard {name}: {total} bytes on disk, manifest says {entry['bytes']}")
        for i, key in enumerate(keys):
            if i in skip:
                continue
            try:
                meta = entry["meta"][i]
                if meta.get("key") != key:
                    raise ValueError(f"metadata names key {meta.get('key')!r}")
                rec = self.read_record(entry, i)
                if rec.prompt_embeds.shape[0] != int(meta.get("embed_len", -1)):
                    raise ValueError(
                        f"prompt_embeds has {rec.prompt_embeds.shape[0]} tokens, "
                        f"metadata says {meta.get('embed_len')}"
                    )
                for t in rec.tensors().values():
                    if t.is_floating_point() and not bool(t.float().isfinite().all()):
                        raise ValueError("non-finite values")
            except Exception as e:  # every decode failure is reported, none is fatal here
                what = e.message if isinstance(e, CacheError) else f"{type(e).__name__}: {e}"
                problems.append(f"shard {name} record {key}: {what}")
        return problems

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.dropped = True
                if f.users == 0:
                    os.close(f.fd)
            self._files.clear()
            self._arrays.clear()
            self._offsets.clear()
            self._group = None
