"""One reader interface for both backends: a cache's committed records, by index.

`CacheStore` resolves the manifest (plus journals of a cache still being written), gives every
committed record a stable place `(shard entry, row)`, and reads either a whole `Record` or just
the tensors a training sample needs, with a single recorded step sliced out of the step axis.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load as st_load

from wandistill.cache import manifest as mf
from wandistill.cache.schema import SHARED_NAME, Record, pad_embeds
from wandistill.errors import CacheError, UsageError


class RecordSource(Protocol):
    """What a backend provides for reading: positioned, thread-safe, partial reads."""

    def read_tensors(
        self, entry: dict[str, Any], i: int, wanted: dict[str, int | None]
    ) -> dict[str, torch.Tensor]:
        """Named tensors of record i of a shard; a name mapped to an int reads that step only."""
        ...

    def read_record(self, entry: dict[str, Any], i: int) -> Record: ...

    def verify(self, entry: dict[str, Any]) -> list[str]: ...

    def close(self) -> None: ...


def _make_source(backend: str, cache: Path) -> RecordSource:
    if backend == "webdataset":
        from wandistill.cache.wds import WebDatasetSource

        return WebDatasetSource(cache)
    if backend == "zarr":
        from wandistill.cache.zarr_backend import ZarrSource

        return ZarrSource(cache)
    raise UsageError(f"unknown cache backend {backend!r}", fix="use webdataset or zarr")


class CacheStore:
    """Read side of a cache. `refresh()` picks up shards committed since it was opened."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.manifest = mf.load_committed(self.path)
        self.source = _make_source(self.manifest.backend, self.path)

    # --------------------------------------------------------------- layout

    @property
    def entries(self) -> list[dict[str, Any]]:
        return self.manifest.shards

    @property
    def complete(self) -> bool:
        return self.manifest.complete

    @property
    def max_sequence_length(self) -> int:
        return int(self.manifest.settings.get("max_sequence_length", 512))

    def refresh(self) -> list[dict[str, Any]]:
        """Re-read the commit record; return the shard entries that are new since last time."""
        known = {e["name"] for e in self.manifest.shards}
        self.manifest = mf.load_committed(self.path)
        return [e for e in self.manifest.shards if e["name"] not in known]

    def locate(self) -> dict[str, tuple[dict[str, Any], int]]:
        """key -> (shard entry, row) for every committed record."""
        return {k: (e, i) for e in self.entries for i, k in enumerate(e["keys"])}

    def __len__(self) -> int:
        return self.manifest.num_records

    # --------------------------------------------------------------- reads

    def read_record(self, entry: dict[str, Any], i: int) -> Record:
        return self.source.read_record(entry, i)

    def read_key(self, key: str) -> Record:
        where = self.locate().get(key)
        if where is None:
            raise CacheError(f"cache {str(self.path)!r} has no record {key!r}")
        return self.read_record(*where)

    def records(self) -> Any:
        """Every committed record, shard by shard (for eval, verify and tests)."""
        for entry in self.entries:
            for i in range(int(entry["records"])):
                yield self.read_record(entry, i)

    def read_sample(
        self, entry: dict[str, Any], i: int, step: int | None, names: list[str], *, pad: bool = True
    ) -> dict[str, torch.Tensor]:
        """The named fields of one (record, step) sample; step fields sliced to that step.

        With `pad`, `prompt_embeds` comes back re-padded to max_sequence_length (bit-exact with
        what the pipeline fed the teacher) plus `prompt_len`.
        """
        from wandistill.cache.schema import is_step_field

        wanted = {n: (step if is_step_field(n) else None) for n in names}
        out = self.source.read_tensors(entry, i, wanted)
        if pad and "prompt_embeds" in out:
            out["prompt_len"] = torch.tensor(out["prompt_embeds"].shape[0])
            out["prompt_embeds"] = pad_embeds(out["prompt_embeds"], self.max_sequence_length)
        return out

    def read_shared(self) -> dict[str, torch.Tensor]:
        """Cache-level tensors: negative-prompt embedding, the sigma/timestep schedule."""
        path = self.path / SHARED_NAME
        if not path.is_file():
            return {}
        return st_load(path.read_bytes())

    def verify(self) -> list[str]:
        problems: list[str] = []
        for entry in self.entries:
            problems.extend(self.source.verify(entry))
        seen: dict[str, str] = {}
        for entry in self.entries:
            for key in entry["keys"]:
                if key in seen:
                    problems.append(
                        f"record {key} appears in shards {seen[key]} and {entry['name']}"
                    )
                seen[key] = entry["name"]
        if self.manifest.shared:
            import hashlib

            path = self.path / SHARED_NAME
            if not path.is_file():
                problems.append(f"{SHARED_NAME} is missing")
            elif hashlib.sha256(path.read_bytes()).hexdigest() != self.manifest.shared["sha256"]:
                problems.append(f"{SHARED_NAME}: sha256 mismatch")
        return problems

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> CacheStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_cache(path: str | Path) -> CacheStore:
    return CacheStore(path)
