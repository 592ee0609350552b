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

* the sink buffers one writer shard (`begin..end`) in memory; `end()` takes an exclusive
  `fcntl.flock` on `<cache>/data.zarr.lock`, creates missing arrays, re-reads each array's
  metadata, claims the next free row range (rounded up to whole zarr shards of `block` rows) and
  token range per ragged field (rounded up to whole zarr shards of `token_block` tokens), grows
  the arrays (never shrinks) and fsyncs their metadata, then releases the lock;
* outside the lock, it writes each array with a single `arr[a:b] = data`; the row/token ranges are
  disjoint and zarr-shard aligned, so no other writer ever touches those shard files;
* the written shard files are fsynced, hashed, and listed in the entry; the CacheWriter then
  commits the entry in its journal. Rows reserved but never committed (a writer killed
  mid-shard, `abort()`, a failed `end()`) are simply never listed, and readers ignore them.

`block` cannot come from the writer (`_make_sink` passes no shard_records), so it is a constant,
BLOCK_RECORDS = 64 = CacheWriter's default shard_records. It only sets the zarr shard (file)
size: a writer shard of n records claims ceil(n/block) zarr shards, and unwritten rows of its
last one cost array shape only, no disk. Once the group exists, its recorded block wins.

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

This module never pickles and does not import webdataset. `fcntl` makes it POSIX-only; on a
network filesystem the cache directory must support flock (NFSv4 does; Lustre needs -o flock).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from zarr.codecs import Crc32cCodec

from wandistill.cache.schema import DTYPE_NAMES, FORMAT_NAME, Record, is_step_field
from wandistill.errors import CacheError
from wandistill.fsutil import fsync_dir

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


def _array_dtype(arr: Any) -> str:
    return str(arr.attrs.get(DTYPE_ATTR, np.dtype(arr.dtype).name))


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
        self._reset(None)

    def _reset(self, name: str | None) -> None:
        self.name = name
        self._meta: list[dict[str, Any]] = []
        self._dense: dict[str, list[np.ndarray]] = {}
        self._ragged: dict[str, list[np.ndarray | None]] = {}
        self._dtypes: dict[str, str] = {}

    # ----------------------------------------------------------------- buffering

    def begin(self, name: str) -> None:
        self._reset(name)

    def add(self, record: Record) -> None:
        where = f"record {record.key}"
        tensors = record.tensors()
        dense = {k: v for k, v in tensors.items() if k not in RAGGED}
        if self._meta and set(dense) != set(self._dense):
            raise CacheError(
                f"{where} has tensors {sorted(dense)}, the shard's first record had "
                f"{sorted(self._dense)}"
            )
        converted: dict[str, np.ndarray] = {}
        for name, t in tensors.items():
            _check_node_name(name)
            a, dtype = to_numpy(t)
            known = self._dtypes.setdefault(name, dtype)
            if known != dtype:
                raise CacheError(f"{where}: {name} is {dtype}, earlier records have {known}")
            if name in RAGGED:
                if a.ndim != 2:
                    raise CacheError(f"{where}: {name} must be (L, D), got {list(a.shape)}")
                first = next((x for x in self._ragged.get(name, []) if x is not None), None)
                if first is not None and first.shape[1] != a.shape[1]:
                    raise CacheError(f"{where}: {name} width {a.shape[1]} != {first.shape[1]}")
            else:
                rows = self._dense.get(name)
                if rows and rows[0].shape != a.shape:
                    raise CacheError(
                        f"{where}: {name} has shape {list(a.shape)}, earlier records have "
                        f"{list(rows[0].shape)}"
                    )
            converted[name] = a
        n = len(self._meta)
        for name in RAGGED:
            if name in converted:
                self._ragged.setdefault(name, [None] * n).append(converted[name])
            elif name in self._ragged:
                self._ragged[name].append(None)
        for name, a in converted.items():
            if name not in RAGGED:
                self._dense.setdefault(name, []).append(a)
        self._meta.append(record.meta())

    def abort(self) -> None:
        """Drop the buffered records; nothing was claimed, or what was stays unused."""
        self._reset(None)

    # ----------------------------------------------------------------- publishing

    def _open_group(self) -> Any:
        group = zarr.open_group(str(self.root), mode="a", zarr_format=3)
        if GROUP_ATTR not in group.attrs:
            group.attrs[GROUP_ATTR] = {
                "format": FORMAT_NAME,
                "block_records": self.block_records,
                "token_chunk": self.token_chunk,
                "token_block": self.token_block,
                "note": "rows are committed only via manifest.json / journal entries",
            }
            _hash_file(self.root / "zarr.json", fsync=True)
            fsync_dir(self.root)
            fsync_dir(self.root.parent)
        return group

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
            group = self._open_group()
            cfg = dict(group.attrs[GROUP_ATTR])
            block = int(cfg["block_records"])
            tchunk, tblock = int(cfg["token_chunk"]), int(cfg["token_block"])
            dense: dict[str, Any] = {}
            for name, rows in self._dense.items():
                item = tuple(rows[0].shape)
                chunks, shards = self._dense_layout(name, item, block)
                dense[name] = self._require(
                    group, name, item, self._dtypes[name], chunks, shards, 0
                )
            ragged: dict[str, tuple[Any, Any]] = {}
            for name, vals in self._ragged.items():
                width = next(v for v in vals if v is not None).shape[1]
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
                total = sum(int(v.shape[0]) for v in self._ragged[name] if v is not None)
                t0 = _ceil_to(int(values.shape[0]), tblock)
                token_rows[name] = [t0, t0 + total]
                if total:
                    self._grow(values, t0 + _ceil_to(total, tblock))
            for arr in to_grow:
                self._grow(arr, reserved)
            fsync_dir(self.root)

        # Outside the lock: these zarr shards belong to this writer alone. One write per array.
        written: list[tuple[Any, str, int, int]] = []  # (array, path, first, stop) on axis 0
        try:
            for name, arr in dense.items():
                data = np.stack(self._dense[name])
                self._dense[name] = []
                arr[start : start + n] = data
                del data
                written.append((arr, name, start, start + n))
            for name, (values, offsets) in ragged.items():
                t0, t1 = token_rows[name]
                offs = np.full((n, 2), -1, dtype=np.int64)
                pos = t0
                for i, v in enumerate(self._ragged[name]):
                    if v is not None:
                        offs[i] = (pos, v.shape[0])
                        pos += v.shape[0]
                offsets[start : start + n] = offs
                written.append((offsets, f"{name}/offsets", start, start + n))
                if t1 > t0:
                    values[t0:t1] = np.concatenate([v for v in self._ragged[name] if v is not None])
                    written.append((values, f"{name}/values", t0, t1))
            sha: dict[str, str] = {}
            total_bytes = 0
            dirs: set[Path] = set()
            for arr, path, a, b in written:
                for key in _shard_keys(arr, a, b):
                    rel = f"{path}/{key}"
                    size, sha[rel] = _hash_file(self.root / rel, fsync=True)
                    total_bytes += size
                    dirs.update(_parents_below(self.root / rel, self.root))
            for d in sorted(dirs, key=lambda p: -len(p.parts)):
                fsync_dir(d)
            fields = sorted([*self._dense, *self._ragged])
            meta = self._meta
        finally:
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

    def _grow(self, arr: Any, rows: int) -> None:
        """Grow axis 0 to `rows` (never shrink) and make the new metadata durable."""
        if int(arr.shape[0]) >= rows:
            return
        arr.resize((rows, *arr.shape[1:]))
        meta = self.root / arr.path / "zarr.json"
        _hash_file(meta, fsync=True)
        for d in _parents_below(meta, self.root):
            fsync_dir(d)


class ZarrSource:
    """Reads committed rows. Arrays are opened once (and re-opened only when a writer has grown
    one past what this reader saw); zarr array reads are safe from many threads."""

    def __init__(self, cache: str | Path) -> None:
        self.cache = Path(cache)
        self.root = self.cache / DATA_NAME
        self._lock = threading.Lock()
        self._group: Any = None
        self._arrays: dict[str, tuple[Any, str]] = {}
        self._offsets: dict[tuple[str, int, str], np.ndarray] = {}

    def _open_group(self) -> Any:
        if self._group is None:
            if not (self.root / "zarr.json").is_file():
                raise CacheError(f"cache {str(self.cache)!r} has no {DATA_NAME} group")
            self._group = zarr.open_group(str(self.root), mode="r", zarr_format=3)
        return self._group

    def _array(self, path: str, rows: int) -> tuple[Any, str]:
        """Array `path` with at least `rows` rows, and its stored dtype name."""
        got = self._arrays.get(path)
        if got is None or got[0].shape[0] < rows:
            with self._lock:
                got = self._arrays.get(path)
                if got is None or got[0].shape[0] < rows:
                    group = self._open_group()
                    if path not in group:
                        raise KeyError(f"{DATA_NAME} has no array {path!r}")
                    arr = group[path]
                    got = (arr, _array_dtype(arr))
                    self._arrays[path] = got
            if got[0].shape[0] < rows:
                raise CacheError(
                    f"{DATA_NAME}/{path} has {got[0].shape[0]} rows, the manifest needs {rows}"
                )
        return got

    def offsets(self, entry: dict[str, Any], name: str) -> np.ndarray:
        """(records, 2) [start, length] of ragged field `name` for one shard entry."""
        start, stop = entry["rows"]
        key = (entry["name"], int(start), name)
        got = self._offsets.get(key)
        if got is None:
            arr, _ = self._array(f"{name}/offsets", stop)
            got = np.asarray(arr[start:stop], dtype=np.int64)
            self._offsets[key] = got
        return got

    def _read(
        self, entry: dict[str, Any], i: int, wanted: dict[str, int | None], *, missing_ok: bool
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
            if name in RAGGED:
                s, length = (int(x) for x in self.offsets(entry, name)[i])
                if length < 0:
                    if missing_ok:
                        continue
                    raise KeyError(
                        f"shard {entry['name']} record {entry['keys'][i]} has no {name!r}"
                    )
                arr, dtype = self._array(f"{name}/values", s + length)
                out[name] = to_torch(arr[s : s + length], dtype)
            else:
                arr, dtype = self._array(name, row + 1)
                out[name] = to_torch(arr[row] if step is None else arr[row, step], dtype)
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
            arr, _ = self._array(path, 0)
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
            path = self.root / rel
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
                problems.append(f"shard {name} record {key}: {type(e).__name__}: {e}")
        return problems

    def close(self) -> None:
        with self._lock:
            self._arrays.clear()
            self._offsets.clear()
            self._group = None
