"""One reader interface for both backends: a cache's committed records, by index.

`CacheReader` resolves the manifest (plus journals of a cache still being written), gives every
committed record a stable place `(shard entry, row)`, and reads either a whole `Record` or just
the tensors a training sample needs, with a single recorded step sliced out of the step axis.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load as st_load

from wandistill.cache import manifest as mf
from wandistill.cache.batch import BatchBuffers
from wandistill.cache.contract import SHARED_NAME, Record, dtype_name, is_step_field, pad_embeds
from wandistill.cache.encoding import RecordCodec
from wandistill.cache.entries import Entries
from wandistill.cache.files import Entry, SharedBlock
from wandistill.cache.journal import CommitMemo
from wandistill.cache.seal import digest_problem
from wandistill.checks.validate import MiB
from wandistill.errors import CacheError
from wandistill.io.storage import Storage, storage_at

MAX_SHARED_BYTES = 256 * MiB
"""Cap on shared.safetensors (a negative-prompt embedding and a schedule: ~2 MB for Wan)."""


class RecordSource(Protocol):
    """What a backend provides for reading: positioned, thread-safe, partial reads.

    A backend may also offer `read_batch(samples, out: BatchBuffers)`, reading many samples
    straight into the rows of one batch (both backends do; `CacheReader.read_batch`)."""

    def read_tensors(
        self, entry: Entry, i: int, wanted: dict[str, int | None]
    ) -> dict[str, torch.Tensor]:
        """Named tensors of record i of a shard; a name mapped to an int reads that step only."""
        ...

    def read_record(self, entry: Entry, i: int) -> Record: ...

    def verify(self, entry: Entry) -> list[str]: ...

    def check_file(self, entry: Entry) -> str | None:
        """Why this shard cannot be read at all (a file missing, truncated, outside the
        cache), or None: a cheap check (a stat, or one listing), not a read."""
        ...

    def close(self) -> None: ...


def _make_source(backend: str, store: Storage) -> RecordSource:
    """The backend's reader (`backend` is one the manifest schema admits)."""
    if backend == "webdataset":
        from wandistill.cache.wds.reader import WebDatasetSource

        return WebDatasetSource(store)
    from wandistill.cache.zarr.reader import ZarrSource

    return ZarrSource(store)


class CacheReader:
    """Read side of a cache. `refresh()` picks up shards committed since it was opened."""

    def __init__(self, path: str | Path | Storage, *, check_entries: bool = True) -> None:
        self.storage = storage_at(path)
        """Opened once here; the reader closes it (a `Storage` passed in is handed over)."""
        self.path = self.storage.url
        """The cache's path or URL (text: a URL is not a Path)."""
        self.check_entries = check_entries
        """False for `verify`: report edited shard entries (and what they break) as problems."""
        self._memo = CommitMemo()
        """Files already read: `refresh()` re-reads only what changed (manifest.py)."""
        self.manifest = mf.load_committed(
            self.storage, check_entries=check_entries, memo=self._memo
        )
        self.source = _make_source(self.manifest.backend, self.storage)
        self.codec = RecordCodec(self.manifest.fields)
        """Decodes stored dtypes (fp8 + scale, bf16, ...) back to the record's (encoding.py)."""

    # --------------------------------------------------------------- layout

    @property
    def entries(self) -> Entries[Any]:
        return self.manifest.shards

    @property
    def complete(self) -> bool:
        return self.manifest.complete

    @property
    def max_sequence_length(self) -> int:
        return self.manifest.settings.max_sequence_length or 512

    def refresh(self) -> list[Entry]:
        """Re-read the commit record; return the shard entries that are new since last time."""
        known = set(self.manifest.shards.names())
        for attempt in range(3):
            # A writer finishing the cache folds the journals into the manifest and removes
            # them: a poll that read the old manifest can then miss a journal it listed. Read
            # again (the new manifest holds those entries); a lasting problem still raises.
            try:
                self.manifest = mf.load_committed(
                    self.storage, check_entries=self.check_entries, memo=self._memo
                )
                break
            except CacheError:
                if attempt == 2:
                    raise
                time.sleep(0.05)
        return [e for e in self.manifest.shards if e.name not in known]

    def locate(self) -> dict[str, tuple[Entry, int]]:
        """key -> (shard entry, row) for every committed record."""
        return {k: (e, i) for e in self.entries for i, k in enumerate(e.keys)}

    def __len__(self) -> int:
        return self.manifest.num_records

    # --------------------------------------------------------------- reads

    def read_record(self, entry: Entry, i: int) -> Record:
        """Record i of a shard, decoded (the dtypes it had before the cache stored it)."""
        return self.codec.decode_record(self.source.read_record(entry, i))

    def read_key(self, key: str) -> Record:
        where = self.locate().get(key)
        if where is None:
            raise CacheError(f"cache {str(self.path)!r} has no record {key!r}")
        return self.read_record(*where)

    def records(self) -> Any:
        """Every committed record, shard by shard (for eval, verify and tests)."""
        for entry in self.entries:
            for i in range(entry.records):
                yield self.read_record(entry, i)

    def read_sample(
        self, entry: Entry, i: int, step: int | None, names: list[str], *, pad: bool = True
    ) -> dict[str, torch.Tensor]:
        """The named fields of one (record, step) sample; step fields sliced to that step.

        With `pad`, `prompt_embeds` comes back re-padded to max_sequence_length (bit-exact with
        what the pipeline fed the teacher) plus `prompt_len`.
        """
        wanted = {n: (step if is_step_field(n) else None) for n in self.codec.wanted(names)}
        out = self.codec.decode(self.source.read_tensors(entry, i, wanted))
        if pad and "prompt_embeds" in out:
            out["prompt_len"] = torch.tensor(out["prompt_embeds"].shape[0])
            out["prompt_embeds"] = pad_embeds(out["prompt_embeds"], self.max_sequence_length)
        return out

    def read_batch(
        self, samples: list[tuple[Entry, int, int]], names: list[str], out: BatchBuffers
    ) -> list[BaseException | None] | None:
        """Read (entry, record, step) samples straight into the rows of `out`; each sample's
        error (None when read). None when this cache cannot be read in place (a backend without
        batch reads, or fields stored in another dtype: those go through `read_sample`)."""
        read = getattr(self.source, "read_batch", None)
        if read is None or not self.codec.identity:
            return None
        return read(
            [(e, i, {n: (s if is_step_field(n) else None) for n in names}) for e, i, s in samples],
            out,
        )

    def read_shared(self) -> dict[str, torch.Tensor]:
        """Cache-level tensors: negative-prompt embedding, the sigma/timestep schedule."""
        if not self.storage.exists(SHARED_NAME):
            return {}
        path = self.storage.name(SHARED_NAME)
        fix = "restore it, or re-run `wandistill precompute` into a fresh directory"
        data = self.storage.read(
            SHARED_NAME, max_bytes=MAX_SHARED_BYTES, what="cache file", fix=fix, error=CacheError
        )
        shared = self.manifest.shared
        want = shared.sha256 if isinstance(shared, SharedBlock) else None
        if want is not None and hashlib.sha256(data).hexdigest() != want:
            raise CacheError(f"{path!r} fails its sha256 check (changed or corrupt)", fix=fix)
        try:
            return st_load(data)
        except Exception as e:  # safetensors raises its own error types on a bad header
            raise CacheError(
                f"{path!r} is not a readable safetensors file ({e})", fix=fix
            ) from None

    def unusable(self, entries: Sequence[Entry] | None = None) -> dict[str, str]:
        """Shards that cannot be read at all (file missing, truncated, outside the cache), by
        name, with the reason: a cheap stat per shard, for train to refuse or skip up front."""
        check = self.source.check_file
        return {e.name: why for e in (entries or self.entries) if (why := check(e))}

    def verify(self) -> list[str]:
        """Every problem of the cache, one line each, naming shard and record where it can."""
        problems: list[str] = []
        for i, entry in enumerate(self.entries):
            edited = digest_problem(self.entries.json(i))
            if edited:
                problems.append(edited)
            problems.extend(self.source.verify(entry))
        seen: dict[str, str] = {}
        for entry in self.entries:
            for key in entry.keys:
                if key in seen:
                    problems.append(f"record {key} appears in shards {seen[key]} and {entry.name}")
                seen[key] = entry.name
        if self.manifest.shared:
            if not self.storage.exists(SHARED_NAME):
                problems.append(f"{SHARED_NAME} is missing")
            else:
                try:
                    self.read_shared()
                except CacheError as e:
                    problems.append(e.message)
        problems.extend(self._header_problems())
        return problems

    def _header_problems(self) -> list[str]:
        """The manifest header (fields, dims, record_steps) against each shard's first record."""
        m = self.manifest
        dtypes = {f.name: f.dtype for f in m.fields}
        steps = m.settings.record_steps
        want_steps = len(steps) if steps is not None else m.dims.num_recorded_steps
        problems: list[str] = []
        for entry in self.entries:
            if not entry.keys:
                continue
            try:
                tensors = self.source.read_record(entry, 0).tensors()  # as stored
            except Exception:  # already reported by the backend's verify
                continue
            where = f"shard {entry.name} record {entry.keys[0]}"
            for name, dtype in dtypes.items():
                t = tensors.get(name)
                if t is None:
                    problems.append(f"{where}: has no {name!r}, the manifest's fields list it")
                elif dtype is not None and dtype_name(t.dtype) != dtype:
                    problems.append(
                        f"{where}: {name!r} is {dtype_name(t.dtype)}, the manifest's fields say "
                        f"{dtype} (manifest edited?)"
                    )
            checks = [
                ("xt", 0, want_steps, "recorded steps", "settings.record_steps"),
                ("prompt_embeds", 1, m.dims.text_dim, "text width", "dims.text_dim"),
            ]
            for name, axis, want, what, source in checks:
                t = tensors.get(name)
                if t is not None and want is not None and t.dim() > axis and t.shape[axis] != want:
                    problems.append(
                        f"{where}: {name!r} has {t.shape[axis]} {what}, the manifest's {source} "
                        f"says {want} (manifest edited?)"
                    )
            shape = m.dims.latent_shape
            noise = tensors.get("noise")
            if noise is not None and shape is not None and list(noise.shape) != list(shape):
                problems.append(
                    f"{where}: latent shape {list(noise.shape)}, the manifest's dims.latent_shape "
                    f"says {shape} (manifest edited?)"
                )
        return problems

    def close(self) -> None:
        self.source.close()
        self.storage.close()

    def __enter__(self) -> CacheReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_cache(path: str | Path, *, check_entries: bool = True) -> CacheReader:
    return CacheReader(path, check_entries=check_entries)
