"""Write zarr shards: `ZarrSink` buffers one writer shard, claims rows under the lock and writes
whole zarr shards; `entry_json` is the shard entry it commits."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec
from zarr.core.sync import sync

from wandistill.cache.contract import (
    DTYPE_BY_NAME,
    FORMAT_NAME,
    ZARR_DTYPE_ATTR,
    DType,
    Record,
    is_step_field,
)
from wandistill.cache.zarr.layout import (
    _WRITE_CONFIG,
    _WRITE_CONFIG_LOCK,
    BLOCK_RECORDS,
    DATA_NAME,
    GROUP_ATTR,
    RAGGED,
    TOKEN_BLOCK,
    TOKEN_CHUNK,
    WRITE_BATCH_CHUNKS,
    WRITE_GATHER_BYTES,
    _array_dtype,
    _by_bytes,
    _ceil_to,
    _dtype_of,
    _gather,
    _numpy_view,
    _zarr_call,
    check_metadata,
    group_arrays,
    zarr_store,
)
from wandistill.cache.zarr.store import _SealingStore, claim_lock
from wandistill.errors import CacheError
from wandistill.io.fsutil import fsync_dir
from wandistill.io.storage import LocalStorage, Storage

# -------------------------------------------------------------------------------------- sink


class ZarrSink:
    """Buffers one writer shard; `end()` claims rows under a file lock and writes whole shards."""

    def __init__(
        self,
        storage: Storage,
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
        self.storage = storage
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
            if not name or "/" in name or name.startswith("__") or name in (".", ".."):
                raise CacheError(f"tensor name {name!r} cannot be a zarr array name")
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

    def _claim(self, store: _SealingStore, n: int) -> tuple[dict[str, Any], int, int, dict]:
        """Under the lock: create arrays, claim rows and tokens, grow every array to cover them.
        Returns (arrays by path, first row, reserved stop, token range per ragged field)."""
        group, cfg = self._open_group(store)
        block, tblock = int(cfg["block_records"]), int(cfg["token_block"])
        arrays = self._arrays(group, cfg)
        record_arrays = [a for p, a in group_arrays(group).items() if not p.endswith("/values")]
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
