"""Read zarr caches: `ZarrSource` reads committed rows through zarr-python (thread-safe) and
verifies each shard's files against its entry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from wandistill.cache.batch import BatchBuffers, Shape
from wandistill.cache.contract import (
    DType,
    Record,
)
from wandistill.cache.files import (
    ZarrEntry,
)
from wandistill.cache.zarr.layout import (
    DATA_NAME,
    INDEX_CACHE_BYTES,
    RAGGED,
    SMALL_ROW_BYTES,
    ZarrChunkError,
    _array_dtype,
    _as_chunk_error,
    _gather,
    _numpy_view,
    _shard_files,
    _zarr_call,
    check_metadata,
    to_torch,
    zarr_store,
)
from wandistill.cache.zarr.store import _ReadStore
from wandistill.checks.validate import inside
from wandistill.errors import CacheError
from wandistill.io.storage import FsspecStorage, LocalStorage, Storage, storage_at

# ------------------------------------------------------------------------------------ source


class ZarrSource:
    """Reads committed rows through zarr-python, thread-safe.

    Arrays are opened once (and again only when a writer has grown one past what this reader
    saw); shard indexes are cached by zarr's CacheStore (`index_cache_bytes`)."""

    def __init__(
        self, cache: str | Path | Storage, *, index_cache_bytes: int = INDEX_CACHE_BYTES
    ) -> None:
        self.storage = storage_at(cache)
        self.store = _ReadStore(zarr_store(self.storage, read_only=True), index_cache_bytes)
        self._listing: frozenset[str] | None = None
        self._group: Any = None
        self._arrays: dict[str, tuple[Any, DType]] = {}
        self._small: dict[tuple[str, int, str], np.ndarray] = {}
        if self._has_group():  # bad metadata: one error at open, not one per record read
            check_metadata(self.storage)

    def _has_group(self) -> bool:
        return self.storage.exists(f"{DATA_NAME}/zarr.json")

    def open_group(self) -> Any:
        if self._group is None:
            if not self._has_group():
                raise CacheError(f"cache {self.storage.url!r} has no {DATA_NAME} group")
            check_metadata(self.storage)
            self._group = _zarr_call(
                f"{DATA_NAME} in {self.storage.url!r}",
                lambda: zarr.open_group(store=self.store, mode="r", zarr_format=3),
            )
        return self._group

    def array(self, path: str) -> Any:
        """The zarr array `path` of this cache, opened once (merge links its shard files)."""
        return self._array(path, 0)[0]

    def _array(self, path: str, rows: int) -> tuple[Any, DType]:
        """Array `path` with at least `rows` rows, and its stored dtype."""
        got = self._arrays.get(path)
        if got is None or got[0].shape[0] < rows:
            group = self.open_group()
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

    def _plans(
        self, e: ZarrEntry, i: int, wanted: dict[str, int | None], *, missing_ok: bool = False
    ) -> tuple[str, dict[str, Any]]:
        """(where, name -> its `_plan`) for the wanted fields of record i; a field the record
        lacks is a KeyError, or with `missing_ok` (a ragged field it has no row of) left out."""
        if not 0 <= i < e.records:
            raise IndexError(f"shard {e.name} has {e.records} records, no record {i}")
        where = f"shard {e.name} record {e.keys[i]}"
        plans: dict[str, Any] = {}
        for name, step in wanted.items():
            if name not in e.fields:
                raise KeyError(f"{where} has no {name!r}")
            try:
                plan = self._plan(e, i, name, step)
            except ZarrChunkError as err:
                raise ZarrChunkError(f"{where}: {name}: {err.message}") from None
            if plan is not None:
                plans[name] = plan
            elif not missing_ok:
                raise KeyError(f"{where} has no {name!r}")
        return where, plans

    def _failed(self, where: str, name: str, err: BaseException, plan: Any) -> BaseException:
        """zarr's error reading field `name` (`plan`) as the ZarrChunkError naming record, field
        and files; an error that says nothing about the data as it is."""
        path, _, a, b = plan
        err = _as_chunk_error(err, _shard_files(self._array(path, b)[0], a, b))
        if isinstance(err, ZarrChunkError):
            return ZarrChunkError(f"{where}: {name}: {err.message}")
        return err

    def _read(
        self, e: ZarrEntry, i: int, wanted: dict[str, int | None], *, missing_ok: bool
    ) -> dict[str, torch.Tensor]:
        where, plans = self._plans(e, i, wanted, missing_ok=missing_ok)
        out = {n: p for n, p in plans.items() if isinstance(p, torch.Tensor)}
        reads = [(n, p) for n, p in plans.items() if not isinstance(p, torch.Tensor)]
        arrays = [self._array(p[0], p[3]) for _, p in reads]
        coros = [a.async_array.getitem(p[1]) for (a, _), (_, p) in zip(arrays, reads, strict=True)]
        got = sync(_gather(coros))
        for (name, plan), (_, dtype), value in zip(reads, arrays, got, strict=True):
            if isinstance(value, BaseException):
                raise self._failed(where, name, value, plan) from None
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
        plans: list[tuple[str, dict[str, Any]] | None] = []
        errors: list[BaseException | None] = []
        for entry, i, wanted in samples:
            try:
                plans.append(self._plans(entry, i, wanted))
                errors.append(None)
            except Exception as err:
                plans.append(None)
                errors.append(err)
        problems = out.allocate(
            [None if p is None else {n: self._shape(x) for n, x in p[1].items()} for p in plans]
        )
        reads: list[tuple[int, str, tuple[str, Any, int, int]]] = []
        coros = []
        proto = default_buffer_prototype()
        for b, plan in enumerate(plans):
            if plan is None or problems[b] is not None:
                errors[b] = errors[b] or (ValueError(problems[b]) if problems[b] else None)
                continue
            for name, x in plan[1].items():
                row = out.row(b, name)
                if isinstance(x, torch.Tensor):
                    row.copy_(x)
                elif row.numel():
                    arr, dtype = self._array(x[0], x[3])
                    dest = proto.nd_buffer.from_numpy_array(_numpy_view(row, dtype))
                    coros.append(arr.async_array.get_orthogonal_selection(x[1], out=dest))
                    reads.append((b, name, x))
        for (b, name, plan), value in zip(reads, sync(_gather(coros)), strict=True):
            if isinstance(value, BaseException) and errors[b] is None:
                errors[b] = self._failed(plans[b][0], name, value, plan)  # type: ignore[index]
        return errors

    def read_record(self, entry: ZarrEntry, i: int) -> Record:
        tensors = self._read(entry, i, dict.fromkeys(entry.fields), missing_ok=True)
        return Record.from_parts(entry.meta[i], tensors)

    def offsets(self, entry: ZarrEntry, name: str) -> np.ndarray:
        """(records, 2) [start, length] of ragged field `name` for one shard entry."""
        got = self._small_rows(entry, f"{name}/offsets")
        if got is None:
            got = np.stack([self._row(f"{name}/offsets", r) for r in range(*entry.rows)])
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
