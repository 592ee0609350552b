"""One writer interface for both backends: records in, atomically published shards out.

`CacheWriter` owns what both backends share: manifest creation or the compatibility check,
resume (records whose key is already committed are skipped), shard naming by rank and sequence,
and the per-rank journal that commits each published shard. A backend only knows how to turn a
run of records into one complete shard (`ShardSink`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save as st_save

from wandistill.cache import journal as jn
from wandistill.cache import manifest as mf
from wandistill.cache.choices import ZARR_ONLY
from wandistill.cache.contract import SHARED_NAME, STEP_FIELDS, Record, dtype_name, plain
from wandistill.cache.encoding import RecordCodec, compression_of
from wandistill.cache.files import FieldSpec, Manifest
from wandistill.cache.keyindex import NameIndex
from wandistill.cache.seal import seal_entry
from wandistill.checks.finite import refuse_nonfinite_record
from wandistill.errors import CacheError, UsageError
from wandistill.io.storage import Storage, storage_at

SHARD_DIR = "shards"
_SHARD_RE = re.compile(r"r(\d{5})-(\d{6})")


class ShardSink(Protocol):
    """Writes one shard: `begin`, `add` per record, then `end` (publish) or `abort`."""

    def begin(self, name: str) -> None: ...

    def add(self, record: Record) -> None: ...

    def end(self) -> dict[str, Any]:
        """Make the shard durable and visible; return its entry (bytes, sha256, locations)."""
        ...

    def abort(self) -> None: ...


def shard_name(rank: int, seq: int) -> str:
    return f"r{rank:05d}-{seq:06d}"


def _naming(e: OSError, where: str) -> OSError:
    """The same error, naming the cache (`where`: its path or URL) when the OS did not name a
    file (ENOSPC on write)."""
    if e.filename is not None:
        return e
    return OSError(e.errno, e.strerror or str(e), where)


def _make_sink(
    backend: str, store: Storage, shard_records: int, fields: Sequence[FieldSpec]
) -> ShardSink:
    compression = compression_of(fields)
    if backend == "webdataset":
        from wandistill.cache.wds.writer import WebDatasetSink

        if compression is not None:
            raise UsageError(
                f"cache.compression={compression[0]!r} {ZARR_ONLY}",
                fix="set cache.backend = 'zarr', or cache.compression = 'none'",
            )
        return WebDatasetSink(store)
    from wandistill.cache.zarr.writer import ZarrSink  # `new_manifest` checked the backend

    return ZarrSink(store, block_records=shard_records, compression=compression)


def shared_blob(tensors: dict[str, torch.Tensor]) -> tuple[bytes, dict[str, Any]]:
    """Serialise cache-level tensors (negative embedding, schedule) and describe them."""
    clean = {k: plain(v) for k, v in tensors.items()}
    blob = st_save(clean)
    desc = {
        "file": SHARED_NAME,
        "sha256": hashlib.sha256(blob).hexdigest(),
        "tensors": {
            k: {"dtype": dtype_name(v.dtype), "shape": list(v.shape)} for k, v in clean.items()
        },
    }
    return blob, desc


class CacheWriter:
    """Append records to a cache as rank `rank` of `world_size` concurrent writers.

    Open it with the full header of the run (teacher fingerprint, sampler settings, field specs).
    A new directory becomes a cache; an existing cache must agree on the header, and then every
    key it already holds is skipped, which is how an interrupted precompute resumes.
    """

    def __init__(
        self,
        path: str | Path | Storage,
        *,
        backend: str,
        teacher: dict[str, Any],
        settings: dict[str, Any],
        fields: list[dict[str, str]],
        dims: dict[str, Any] | None = None,
        shared: dict[str, torch.Tensor] | None = None,
        numerics: dict[str, Any] | None = None,
        rank: int = 0,
        shard_records: int = 64,
    ) -> None:
        if shard_records <= 0:
            raise UsageError(f"shard_records={shard_records} must be positive")
        self.store = storage_at(path)
        """Opened once here; every manifest and journal call below takes it."""
        self.path = self.store.url
        self.rank = rank
        self.shard_records = shard_records
        blob, shared_desc = shared_blob(shared) if shared else (b"", {})
        header = mf.new_manifest(
            backend=backend,
            teacher=teacher,
            settings=settings,
            fields=fields,
            dims=dims or {},
            shared=shared_desc,
            numerics=numerics or {},
        )
        self.sink = _make_sink(backend, self.store, shard_records, header.fields)
        journals = jn.CommitMemo()  # each journal is read once for the three uses below
        self._open_cache(header, blob, journals)
        self.codec = RecordCodec(self.manifest.fields)
        """Converts each record to the stored dtypes the fields declare (encoding.py)."""
        committed = mf.committed_shards(self.store, self.manifest, journals)
        self._keys = NameIndex()  # compact: memory must not grow with the prompt file
        for s in committed:
            for k in s.keys:
                self._keys.add(k, 0)
        mine = [j for j in jn.journal_segments(self.store, backend, journals) if j.rank == rank]
        self._segment = mine[-1].segment if mine else 0
        """This rank's last journal segment: each commit rewrites it (manifest.py)."""
        self._mine = [jn.entry_json(s) for s in mine[-1].shards.json_list()] if mine else []
        """Its entries, serialized once (not held as Python objects)."""
        self._mine_bytes = sum(map(len, self._mine))
        seqs = [
            int(m.group(2))
            for s in committed
            if (m := _SHARD_RE.fullmatch(s.name)) and int(m.group(1)) == rank
        ]
        self._seq = max(seqs, default=-1) + 1
        self._open: dict[str, None] = {}
        """Keys of the open shard, in order (a dict: membership is checked for every record)."""
        self._begun = False
        """A shard is begun in the sink (its temp file exists), even if no record made it in."""
        self.records_written = 0
        self.records_skipped = 0
        self.bytes_written = 0

    def _open_cache(self, new: Manifest, blob: bytes, journals: jn.CommitMemo) -> None:
        """Create the cache (or join it: the header must match); `blob`: shared.safetensors;
        `journals`: the memo the writer reads the journals through afterwards."""
        try:
            self.store.makedirs(SHARD_DIR)
        except OSError as e:
            raise UsageError(
                f"cannot create cache directory {str(self.path)!r}: {e.strerror}",
                fix="choose a writable --out directory",
            ) from None
        fresh = True
        if mf.has_manifest(self.store) or not mf.create_manifest_exclusive(self.store, new):
            existing = mf.read_manifest(self.store)
            if mf.committed_shards(self.store, existing, journals):  # records bind the header
                mf.check_compatible(self.store, existing, new)
                self.manifest, fresh = existing, False
            else:  # a run that failed before its first record: this run's header replaces it
                new.created = existing.created
                mf.write_manifest(self.store, new)
                self.manifest = new
        else:
            self.manifest = new
        if blob and (fresh or not self.store.exists(SHARED_NAME)):
            self.store.put(SHARED_NAME, blob)

    # ------------------------------------------------------------------ writing

    def write(self, record: Record) -> bool:
        """Add one record; returns False when it was already in the cache."""
        if record.key in self._keys or record.key in self._open:
            self.records_skipped += 1
            return False
        refuse_nonfinite_record(record.key, record.tensors(), STEP_FIELDS)  # never committed
        record = self.codec.encode(record)
        try:
            if not self._begun:
                self.sink.begin(shard_name(self.rank, self._seq))
                self._begun = True
            self.sink.add(record)
        except OSError as e:
            raise _naming(e, self.path) from e
        self._open[record.key] = None
        if len(self._open) >= self.shard_records:
            self.flush()
        return True

    def flush(self) -> None:
        """Publish the open shard now (a partial one is fine); then commit it in the journal."""
        if not self._open:
            self.abort()  # drops a begun shard that no record made it into
            return
        try:
            entry = self.sink.end()
        except OSError as e:
            raise _naming(e, self.path) from e
        entry.update(
            name=shard_name(self.rank, self._seq),
            rank=self.rank,
            records=len(self._open),
            keys=list(self._open),
        )
        seal_entry(entry)  # lets `cache verify` spot a hand-edited entry
        chunk = jn.entry_json(entry)
        if self._mine and self._mine_bytes + len(chunk) > jn.JOURNAL_SEGMENT_BYTES:
            self._segment, self._mine, self._mine_bytes = self._segment + 1, [], 0
        try:
            jn.write_journal_chunks(
                self.store, self.rank, [*self._mine, chunk], segment=self._segment
            )
        except OSError as e:  # the shard file is published but not committed: redone on resume
            raise _naming(e, self.path) from e
        self._mine.append(chunk)
        self._mine_bytes += len(chunk)
        for k in self._open:
            self._keys.add(k, 0)
        self.records_written += len(self._open)
        self.bytes_written += int(entry["bytes"])
        self._open = {}
        self._begun = False
        self._seq += 1

    def abort(self) -> None:
        """Drop the open shard: its records were never committed and will be redone on resume."""
        if self._begun:  # also a shard whose first record failed to go in (disk full)
            self.sink.abort()
        self._open = {}
        self._begun = False

    def close(self, *, finalize: bool = False, complete: bool = False) -> None:
        """Publish what is open. `finalize` folds journals into the manifest: call it from one
        process only, after every rank has closed (precompute does this after a barrier)."""
        self.flush()
        if finalize:
            self.manifest = mf.finalize(self.store, complete=complete)

    def __enter__(self) -> CacheWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def open_writer(path: str | Path, **kwargs: Any) -> CacheWriter:
    try:
        return CacheWriter(path, **kwargs)
    except OSError as e:
        raise CacheError(f"cannot write cache {str(path)!r}: {e}") from None
