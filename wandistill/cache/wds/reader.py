"""Read webdataset shards: positioned reads at manifest offsets, every read checked against the
record's checksums; `verify` walks each shard (`WebDatasetSource`)."""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load

from wandistill.cache.batch import BatchBuffers, empty
from wandistill.cache.contract import (
    DTYPE_BY_SAFETENSORS,
    Record,
    tensor_bytes,
)
from wandistill.cache.files import OwnMeta, RecordMeta, WdsEntry
from wandistill.cache.wds.format import (
    _META,
    HEAD_READ,
    HEADER_CACHE,
    MAX_HEADER_BYTES,
    META_KEY,
    _checked_json,
    _describe,
    _Metadata,
    _Table,
    crc32c,
    tensor_checksums,
)
from wandistill.cache.wds.verify import ShardChecks
from wandistill.checks.validate import inside, rel_path_problem
from wandistill.errors import CacheError, CorruptRecordError
from wandistill.io.storage import LocalStorage, Storage, is_transient, storage_at

_Read = tuple[str, int, Any, int | None]
"""One tensor read: (name, offset in the shard, destination buffer, expected crc32c)."""
_RECORD_ERRORS = (OSError, EOFError, ValueError, KeyError, IndexError, TypeError, CacheError)
"""What a damaged record or shard raises while it is read (a CorruptRecordError)."""


def _step_text(step: int | None) -> str:
    return "" if step is None else f" step {step}"


class WebDatasetSource(ShardChecks):
    """Random access into published tar shards: positioned reads at manifest offsets
    (`os.pread` locally, ranged GETs on an object store; `wandistill.io.storage`).

    Thread-safe: `pread` has no shared file position, and releases the GIL while it waits on the
    disk, so a thread pool reads at close to the device's speed. Every read is checked against
    the record's checksums (see the module docstring) and fails with `CorruptRecordError`.
    """

    def __init__(self, cache: str | Path | Storage) -> None:
        self.store = storage_at(cache)
        self.cache = self.store.url
        self._headers: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._headers_lock = threading.Lock()
        self._rels: dict[tuple[str, str], str] = {}

    # ------------------------------------------------------------------ files

    def rel(self, entry: WdsEntry) -> str:
        """The shard's name in the cache; a manifest `file` outside the cache is refused.

        Checked once per (shard, file) and kept: the check resolves symlinks (a `realpath`,
        ~30 us), which the training reader would otherwise pay on every sample."""
        key = (entry.name, entry.file)
        rel = self._rels.get(key)
        if rel is None:
            rel = self._rels[key] = self._checked_rel(entry)
        return rel

    def _checked_rel(self, entry: WdsEntry) -> str:
        rel = entry.file
        what = f"shard {entry.name}: manifest file"
        if isinstance(self.store, LocalStorage):
            inside(self.store.root, rel, what, CacheError)
        elif problem := rel_path_problem(rel):  # an object store has no links to follow
            raise CacheError(f"{what} {rel!r} {problem}; refused", fix="restore the manifest")
        return rel

    def check_file(self, entry: WdsEntry) -> str | None:
        """Why this shard cannot be read at all (missing, wrong size, bad path), or None."""
        try:
            rel = self.rel(entry)
        except CacheError as e:
            return e.message
        size = self.store.size(rel)
        if size is None:
            return f"shard {entry.name}: file {entry.file} is missing"
        if size != entry.bytes:
            return (
                f"shard {entry.name}: file {entry.file} has {size} bytes, the manifest "
                f"says {entry.bytes} (truncated or replaced)"
            )
        return None

    def _pread(self, rel: str, offset: int, size: int, what: str) -> bytes:
        data = self.store.read_range(rel, offset, size)
        if len(data) != size:
            raise EOFError(
                f"short read of {what} ({len(data)} of {size} bytes at offset {offset}): "
                "the shard is truncated"
            )
        return data

    # ------------------------------------------------------------------ headers

    def _parse_header(
        self, entry: WdsEntry, i: int, head: bytes, *, typed: bool = False
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Check a record's header bytes (length prefix + JSON) and split off its metadata.

        A header whose crc32c matches the (schema-checked, sealed) manifest entry is the one the
        writer produced from typed tensors: on the training hot path it is only parsed (strict
        JSON, ~7 us), and `_span` checks each tensor it uses. Any other header (a cache without
        checksums), and every header `verify` reads (`typed`), is also checked against the
        schema (~17 us more; docs/reliability.md)."""
        crcs = entry.crc32c
        if crcs is not None and crc32c(head) != crcs[i][0]:
            raise ValueError(
                "safetensors header fails its crc32c check (the header bytes changed, or the "
                "manifest's offsets were edited)"
            )
        typed = typed or crcs is None
        table = _checked_json(head[8:], "safetensors header", dict[str, Any])
        meta = table.pop(_META, None) or {}
        if typed:
            _checked_json(None, "safetensors __metadata__", _Metadata, meta)
            _checked_json(None, "safetensors header", _Table, table)  # typed; used as read
        if META_KEY not in meta:
            return table, None  # written before checksums existed
        own = _checked_json(meta[META_KEY], "safetensors metadata", OwnMeta if typed else Any)
        key, sums = (own.key, own.crc32c) if typed else (own["key"], own["crc32c"])
        if key != entry.keys[i]:
            raise ValueError(f"the data belongs to record {key} (manifest keys edited?)")
        return table, sums

    def _header_len(self, entry: WdsEntry, i: int, prefix: bytes) -> int:
        length = entry.offsets[i][1]
        hlen = int.from_bytes(prefix[:8], "little")
        if len(prefix) < 8 or hlen <= 0 or 8 + hlen > length or hlen > MAX_HEADER_BYTES:
            raise ValueError(
                f"bad safetensors header length {hlen} (record is {length} bytes): the record "
                "bytes changed, or the manifest's offsets were edited"
            )
        return hlen

    def header(self, entry: WdsEntry, i: int) -> tuple[int, dict[str, Any], dict[str, Any] | None]:
        """Record i's safetensors header: (absolute data start, tensor table, checksums).

        Kept for the last HEADER_CACHE records read: a committed shard never changes, and a
        training epoch reads each record once per recorded step, so this saves a read (a GET
        round trip on an object store) and a parse per sample. The key holds what the manifest
        says about the record, so an edited entry is read afresh."""
        crcs = entry.crc32c
        key = (entry.name, i, *entry.offsets[i][:2], crcs[i][0] if crcs else None)
        with self._headers_lock:
            found = self._headers.get(key)
            if found is not None:
                self._headers.move_to_end(key)
                return found
        found = self._read_header(entry, i)
        with self._headers_lock:
            self._headers[key] = found
            while len(self._headers) > HEADER_CACHE:
                self._headers.popitem(last=False)
        return found

    def _read_header(
        self, entry: WdsEntry, i: int
    ) -> tuple[int, dict[str, Any], dict[str, Any] | None]:
        off, length = entry.offsets[i][:2]
        rel = self.rel(entry)
        want = min(length, HEAD_READ)
        head = self.store.read_range(rel, off, want)  # one read covers the header almost always
        if len(head) < min(want, 8):
            raise EOFError(f"short read of the safetensors header at offset {off}: truncated")
        hlen = self._header_len(entry, i, head)
        if 8 + hlen > len(head):
            if len(head) < want:
                raise EOFError(f"short read of the safetensors header at offset {off}: truncated")
            head += self._pread(rel, off + len(head), 8 + hlen - len(head), "the header")
        table, sums = self._parse_header(entry, i, head[: 8 + hlen])
        return off + 8 + hlen, table, sums

    def _span(
        self,
        entry: WdsEntry,
        i: int,
        base: int,
        table: dict[str, Any],
        sums: dict[str, Any] | None,
        name: str,
        step: int | None,
    ) -> tuple[int, int, torch.dtype, list[int], int | None]:
        """(absolute offset, bytes, dtype, shape, expected crc32c) of a tensor or one step row."""
        info = table.get(name)
        if info is None:
            raise KeyError(f"no tensor {name!r} in the record")
        dtype = DTYPE_BY_SAFETENSORS[info["dtype"]].torch
        a, b = info["data_offsets"]
        shape = list(info["shape"])
        nbytes = dtype.itemsize
        for n in shape:
            nbytes *= n
        if b - a != nbytes or a < 0 or base + b > entry.offsets[i][0] + entry.offsets[i][1]:
            raise ValueError(f"{name!r}: header offsets {a}..{b} do not fit shape {shape}")
        want = sums.get(name) if sums is not None else None
        if step is not None:
            if not shape or not 0 <= step < shape[0]:
                raise IndexError(
                    f"{name!r} holds {shape[0] if shape else 0} recorded steps, step {step} was "
                    "asked (manifest settings.record_steps edited?)"
                )
            row = nbytes // shape[0]
            a, nbytes, shape = a + step * row, row, shape[1:]
            if sums is not None:
                want = want[step] if isinstance(want, list) and step < len(want) else None
        return base + a, nbytes, dtype, shape, want

    # ------------------------------------------------------------------ reads

    def read_blob(self, entry: WdsEntry, i: int) -> bytes:
        off, length = entry.offsets[i][:2]
        return self._pread(self.rel(entry), off, length, "the safetensors member")

    def read_meta(self, entry: WdsEntry, i: int) -> RecordMeta:
        _, _, joff, jlen = entry.offsets[i]
        data = self._pread(self.rel(entry), joff, jlen, "the json member")
        crcs = entry.crc32c
        if crcs is not None and crc32c(data) != crcs[i][1]:
            raise ValueError("json member fails its crc32c check")
        meta = _checked_json(data, "json member", dict[str, Any])
        typed: RecordMeta = _checked_json(None, "json member", RecordMeta, meta)
        if typed.key != entry.keys[i]:
            raise ValueError(f"json member names key {typed.key!r} (manifest keys edited?)")
        return typed

    def read_tensors(
        self, entry: WdsEntry, i: int, wanted: dict[str, int | None]
    ) -> dict[str, torch.Tensor]:
        """Named tensors (one step of a step field) read straight into fresh tensors.

        One positioned read per tensor lands the bytes in the tensor's own memory (`preadv`
        locally; on an object store the ranged GETs of a sample go out together). Each tensor
        or row is checked against its crc32c before it is returned.
        """
        try:
            rel, spans = self._spans(entry, i, wanted)
            out = {name: empty(tuple(s[3]), s[2]) for name, s in spans.items()}
            reads = self._reads(spans, {n: tensor_bytes(t) for n, t in out.items()})
            self._check(wanted, reads, self._read_into(rel, reads))
            return out
        except Exception as e:
            raise self._corrupt(entry, i, e) from None

    def read_batch(
        self, samples: list[tuple[WdsEntry, int, dict[str, int | None]]], out: BatchBuffers
    ) -> list[BaseException | None]:
        """Read each (entry, record, wanted) sample straight into its row of `out` (the
        training reader's hot path): headers first (kept, see `header`), then one positioned
        read per tensor or step row into the batch tensor, each checked against its crc32c.
        Returns each sample's error (a `CorruptRecordError`), or None."""
        plans: list[tuple[str, dict[str, Any]] | None] = []
        errors: list[BaseException | None] = []
        for entry, i, wanted in samples:
            try:
                plans.append(self._spans(entry, i, wanted))
                errors.append(None)
            except Exception as e:
                plans.append(None)
                errors.append(self._corrupt(entry, i, e))
        shapes = [
            None if p is None else {n: (tuple(s[3]), s[2]) for n, s in p[1].items()} for p in plans
        ]
        problems = out.allocate(shapes)
        # One read_into per shard file for the whole batch: on an object store its ranges go
        # out as one concurrent `cat_ranges`.
        groups: dict[str, list[tuple[int, list[_Read]]]] = {}
        for b, plan in enumerate(plans):
            if plan is None:
                continue
            if problems[b] is not None:
                errors[b] = self._corrupt(*samples[b][:2], ValueError(problems[b]))
                continue
            reads = self._reads(plan[1], {n: out.raw_row(b, n) for n in plan[1]})
            groups.setdefault(plan[0], []).append((b, reads))
        for rel, group in groups.items():
            with contextlib.suppress(OSError):  # only a hint; the read reports errors
                self.store.will_need(rel, [(r[1], r[2].nbytes) for _, rs in group for r in rs])
        for rel, group in groups.items():
            try:
                got: list[int] | None = self._read_into(rel, [r for _, rs in group for r in rs])
            except Exception:  # the file as a whole: read each sample alone to say which
                got = None
            k = 0
            for b, reads in group:
                entry, i, wanted = samples[b]
                try:
                    mine = self._read_into(rel, reads) if got is None else got[k : k + len(reads)]
                    self._check(wanted, reads, mine)
                except Exception as e:
                    errors[b] = self._corrupt(entry, i, e)
                k += len(reads)
        return errors

    def _spans(
        self, entry: WdsEntry, i: int, wanted: dict[str, int | None]
    ) -> tuple[str, dict[str, tuple[int, int, torch.dtype, list[int], int | None]]]:
        """(shard name, name -> `_span`) of the named tensors of record i."""
        base, table, sums = self.header(entry, i)
        spans = {n: self._span(entry, i, base, table, sums, n, s) for n, s in wanted.items()}
        if sums is not None:  # a tensor the checksums do not list fails its check
            spans = {n: (*s[:4], -1 if s[4] is None else s[4]) for n, s in spans.items()}
        return self.rel(entry), spans

    def _read_into(self, rel: str, reads: list[_Read]) -> list[int]:
        """One positioned read per `_reads` item into its destination: the bytes each got."""
        return self.store.read_into(rel, [(r[1], r[2]) for r in reads])

    @staticmethod
    def _reads(
        spans: dict[str, tuple[int, int, torch.dtype, list[int], int | None]],
        dest: dict[str, Any],
    ) -> list[_Read]:
        """(name, offset, destination, expected crc32c) of each non-empty span; a destination
        is a writable uint8 numpy view of the span's size."""
        return [(n, spans[n][0], raw, spans[n][4]) for n, raw in dest.items() if spans[n][1]]

    @staticmethod
    def _check(wanted: dict[str, int | None], reads: list[_Read], got: list[int]) -> None:
        """Each read complete and matching its crc32c."""
        for (name, _, raw, want), n in zip(reads, got, strict=True):
            if n != raw.nbytes:
                raise EOFError(
                    f"short read of {name!r} ({n} of {raw.nbytes} bytes): the shard is truncated"
                )
            if want is not None and crc32c(raw) != want:
                raise ValueError(
                    f"{name!r}{_step_text(wanted[name])} fails its crc32c check (its bytes "
                    "changed after they were written)"
                )

    @staticmethod
    def _corrupt(
        entry: WdsEntry, i: int, e: BaseException, kinds: Any = _RECORD_ERRORS
    ) -> BaseException:
        """A read failure of one of these `kinds` as the CorruptRecordError naming shard and
        record (a failure that is not about the data, e.g. a bug or EMFILE, as it is)."""
        if isinstance(e, CorruptRecordError) or not isinstance(e, kinds) or is_transient(e):
            return e
        return CorruptRecordError(entry.name, entry.keys[i], _describe(e))

    def _checked_record(self, entry: WdsEntry, i: int) -> Record:
        """Read and check a whole record: header, every tensor and row, the json member."""
        blob = self.read_blob(entry, i)
        hlen = self._header_len(entry, i, blob)
        _, sums = self._parse_header(entry, i, blob[: 8 + hlen], typed=True)
        tensors = st_load(blob)
        if sums is not None:
            if set(sums) != set(tensors):
                raise ValueError(f"checksums list {sorted(sums)}, the record has {sorted(tensors)}")
            got = tensor_checksums(tensors)
            for name, want in sums.items():
                if got[name] == want:
                    continue
                if isinstance(want, list) and isinstance(got[name], list):
                    pairs = zip(got[name], want, strict=False)
                    bad = [s for s, (x, y) in enumerate(pairs) if x != y]
                    where = f" step {bad[0]}" if bad else " (row count)"
                else:
                    where = ""
                raise ValueError(f"{name!r}{where} fails its crc32c check")
        return Record.from_parts(self.read_meta(entry, i), tensors)

    def read_record(self, entry: WdsEntry, i: int) -> Record:
        try:
            return self._checked_record(entry, i)
        except Exception as e:  # safetensors raises its own error types on a bad blob
            raise self._corrupt(entry, i, e, Exception) from None

    def close(self) -> None:
        self.store.close()
