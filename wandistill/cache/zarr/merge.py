"""Link (or copy) committed zarr shard entries of other caches into a merged cache's `data.zarr`.

Why this works. Every writer shard of the zarr backend owns whole zarr shard files: its rows
[start, start + reserved) are whole zarr shards of `block_records` rows, its embedding tokens
whole zarr shards of `token_block` tokens, and a zarr shard file is self-contained (its index
locates its inner chunks within the file, not within the array). So the files of an entry can
join another group of the same layout at other whole-shard coordinates: the file for record
block k becomes block k + (new start - old start) / block_records, and the same for token
blocks. Only the ragged `<field>/offsets` rows change content (they hold absolute token starts):
those are written anew through zarr. Array metadata is created through zarr from the input's
(same dtype, chunks, shards, codecs, fill value, attributes), and must then be equal to it but
for the shape; an input whose layout differs (another `cache.shard_records`) is not linked, and
the caller re-writes its records instead.

How a file gets there (hard link, a copy by the object store, a copy through this process) is
`transfer.Transfer.put`'s choice. The merged entry lists every file it uses with its sha256: a
linked or copied file keeps its input's digest (same bytes), a new offsets file gets its own
(hashed as zarr writes it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import zarr

from wandistill.cache.files import ZarrEntry
from wandistill.cache.zarr.layout import (
    _WRITE_CONFIG,
    DATA_NAME,
    GROUP_ATTR,
    RAGGED,
    _ceil_to,
    group_arrays,
    zarr_store,
)
from wandistill.cache.zarr.reader import ZarrSource
from wandistill.cache.zarr.store import _SealingStore
from wandistill.cache.zarr.writer import entry_json
from wandistill.io.storage import Storage

LAYOUT = ("block_records", "token_chunk", "token_block")


def _shape_free(arr: Any) -> dict[str, Any]:
    meta = arr.metadata.to_dict()
    meta.pop("shape", None)
    return meta


class ZarrLinker:
    """Adds whole zarr shard entries of input caches to the merged cache at `out`."""

    def __init__(self, out: Storage, put: Callable[[Storage, str, str], tuple[str, int]]) -> None:
        self.put = put
        """put(input store, its file, M's file) -> (how it got there, its size): a hard link,
        a copy by the object store or through this process (`transfer.Transfer.put`)."""
        self.store = _SealingStore(zarr_store(out))
        self._group: Any = None
        self._arrays: dict[str, Any] = {}
        """M's arrays by path, read once per entry (`_open_arrays`): within an entry this
        linker is M's only writer and `resize` updates an array's shape in place."""

    def _target(self, layout: dict[str, Any]) -> Any:
        """M's group, created with `layout` when new; None if its layout differs."""
        if self._group is None:
            group = zarr.open_group(store=self.store, mode="a", zarr_format=3)
            if GROUP_ATTR not in group.attrs:
                group.attrs[GROUP_ATTR] = layout
            self._group = group
        mine = self._group.attrs[GROUP_ATTR]
        return self._group if all(mine.get(k) == layout.get(k) for k in LAYOUT) else None

    def _open_arrays(self, group: Any) -> None:
        """Read M's arrays once per entry: the merge's re-writer (a `ZarrSink` of its own) may
        have grown them since the last entry."""
        arrays = group_arrays(group)
        self._arrays = {p: a.with_config(_WRITE_CONFIG) for p, a in arrays.items()}

    def _record_arrays(self) -> list[Any]:
        """M's record-indexed arrays (`group_arrays`: all but the ragged values)."""
        return [arr for path, arr in self._arrays.items() if not path.endswith("/values")]

    def _like(self, group: Any, path: str, src: Any) -> Any:
        """M's array `path` (created like `src`, zero rows, when new), or None if it differs."""
        if path not in self._arrays:
            group.create_array(
                path,
                shape=(0, *src.shape[1:]),
                dtype=src.dtype,
                chunks=src.chunks,
                shards=src.shards,
                filters=src.filters,
                compressors=src.compressors,
                serializer=src.serializer,
                fill_value=src.fill_value,
                attributes=dict(src.attrs),
                config=_WRITE_CONFIG,
            )
            self._arrays[path] = group[path].with_config(_WRITE_CONFIG)
        arr = self._arrays[path]
        return arr if _shape_free(arr) == _shape_free(src) else None

    def add(self, source: ZarrSource, e: ZarrEntry) -> tuple[dict[str, Any], set[str]] | None:
        """Link (or copy) entry `e` of the input read by `source` into M: (M's entry without
        name/keys, how its files got there), or None when the layouts differ (nothing was
        linked). The input's group, arrays and offsets come through `source`, which opened
        and verified them (re-reading each zarr.json was most of a merge's requests on S3)."""
        layout = dict(source.open_group().attrs[GROUP_ATTR])
        group = self._target(layout)
        if group is None:
            return None
        self._open_arrays(group)
        ragged = [f for f in e.fields if f in RAGGED]
        paths = [f for f in e.fields if f not in RAGGED]
        paths += [f"{r}/{part}" for r in ragged for part in ("values", "offsets")]
        arrays = {p: self._like(group, p, source.array(p)) for p in paths}
        if any(a is None for a in arrays.values()):
            return None
        block, tblock = int(layout["block_records"]), int(layout["token_block"])
        start = _ceil_to(max((a.shape[0] for a in self._record_arrays()), default=0), block)
        shift = {p: (start - e.rows[0]) // block for p in paths}
        token_rows: dict[str, tuple[int, int]] = {}
        for r in ragged:
            t0, t1 = e.token_rows[r]
            new0 = _ceil_to(int(arrays[f"{r}/values"].shape[0]), tblock)
            token_rows[r] = (new0, new0 + t1 - t0)
            shift[f"{r}/values"] = (new0 - t0) // tblock
        stop = start + e.reserved[1] - e.reserved[0]
        for arr in self._record_arrays():
            if arr.shape[0] < stop:
                arr.resize((stop, *arr.shape[1:]))
        for r in ragged:
            values, (t0, t1) = arrays[f"{r}/values"], token_rows[r]
            if t1 > t0 and values.shape[0] < t0 + _ceil_to(t1 - t0, tblock):
                values.resize((t0 + _ceil_to(t1 - t0, tblock), *values.shape[1:]))
        sha: dict[str, str] = {}
        nbytes, ways = 0, set()
        for rel, digest in e.sha256.items():
            path, _, coords = rel.partition("/c/")
            if path.endswith("/offsets"):
                continue  # absolute token starts: written anew below
            first, _, rest = coords.partition("/")
            new = f"{path}/c/{int(first) + shift[path]}" + (f"/{rest}" if rest else "")
            how, size = self.put(source.storage, f"{DATA_NAME}/{rel}", f"{DATA_NAME}/{new}")
            ways.add(how)
            sha[new] = digest
            nbytes += size
        self.store.sealed.clear()  # from here on: this entry's offsets files only
        n = e.records
        for r in ragged:
            offs = source.offsets(e, r)
            moved = offs[:, 0] - e.token_rows[r][0] + token_rows[r][0]
            offs = np.where(offs[:, 1:] >= 0, np.stack([moved, offs[:, 1]], axis=1), -1)
            arrays[f"{r}/offsets"][start : start + n] = offs.astype(np.int64)
        self.store.make_durable(sha)
        for key, (size, digest) in self.store.sealed.items():
            sha[key] = digest
            nbytes += size
        entry = entry_json(
            rows=(start, start + n),
            reserved=(start, stop),
            token_rows=token_rows,
            fields=e.fields,
            meta=[m.model_dump(mode="json", exclude_unset=True) for m in e.meta],
            sha256=dict(sorted(sha.items())),
            nbytes=nbytes,
        )
        return entry, ways
