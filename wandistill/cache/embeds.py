"""The encode phase's commit: text embeddings go to disk as they are made, and come back per batch.

Precompute's memory must not grow with the prompt file, and a kill during the encode phase must
keep what was encoded. So each rank writes its embeddings into small safetensors shards under the
cache, each committed on its own, and the denoise phase reads back just the batch it works on:

    embeds/r<rank>-<seq>.safetensors   tensors named by what they embed: "<record key>" (the
                                       prompt), "<record key>.negative" (a prompt's own negative
                                       prompt), "negative.<sha256 of the text>" (the recipe's);
                                       header metadata "wandistill": {"crc32c": {name: crc}}
    embeds/r<rank>-<seq>.json          the shard's commit record: file, bytes, sha256, names,
                                       truncated (record keys cut at max_sequence_length)

A shard is written under a temp name, fsynced and renamed; its `.json` is written atomically
after that and is what commits it (a shard without one, left by a kill, is ignored and
overwritten). Every rank reads every rank's committed shards, so a resume with another world size
re-encodes nothing. Each tensor is checked against its crc32c when read back. Once the cache is
complete every record holds its own (trimmed) embeddings, and precompute removes `embeds/`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import google_crc32c
import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from wandistill.cache.contract import tensor_bytes
from wandistill.cache.keyindex import NameIndex
from wandistill.errors import CacheError
from wandistill.io.fsutil import atomic_write_bytes, atomic_write_json

EMBED_DIR = "embeds"
META_KEY = "wandistill"
_SHARD_RE = re.compile(r"r(\d{5})-(\d{6})")
FLUSH_BYTES = 64 << 20
"""Also flush once this many bytes of embeddings are buffered (long prompts, wide encoders)."""


def negative_name(text: str) -> str:
    """Tensor name of the recipe's negative prompt (one per distinct text)."""
    return "negative." + hashlib.sha256(text.encode()).hexdigest()[:32]


def own_negative_name(key: str) -> str:
    """Tensor name of a prompt's own negative prompt (encoded with its batch)."""
    return f"{key}.negative"


def _crc(t: torch.Tensor) -> int:
    return int(google_crc32c.value(tensor_bytes(t)))


@dataclass(slots=True)
class EmbedShard:
    """One committed embedding shard (its `.json`)."""

    name: str
    bytes: int
    sha256: str
    names: list[str]
    """Tensor names (emptied once indexed by `EmbedStore.index`)."""
    truncated: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "file": f"{EMBED_DIR}/{self.name}.safetensors"}


class EmbedStore:
    """This rank's embedding writer, over every rank's committed embedding shards."""

    def __init__(self, cache: str | Path, *, rank: int = 0, flush_records: int = 64) -> None:
        self.dir = Path(cache) / EMBED_DIR
        self.rank = rank
        self.flush_records = max(1, flush_records)
        self.shards: list[EmbedShard] = []
        self.index = NameIndex()
        """Tensor name -> position in `shards`, for every committed name."""
        self._seq = 0
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_truncated: list[str] = []
        self._buffer_bytes = 0
        self._open: tuple[int, Any] | None = None
        self.encoded = 0
        """Prompts this process added (its own work, for the summary and the tests)."""
        self.reload()

    # ------------------------------------------------------------------ commit records

    def reload(self) -> None:
        """Re-read every rank's commit records (rank 0 does this at the end for the report)."""
        self.shards, self.index = [], NameIndex()
        if not self.dir.is_dir():
            return
        for side in sorted(self.dir.glob("r*.json")):
            shard = self._committed(side)
            if shard is None:
                continue
            self._add(shard)
            m = _SHARD_RE.fullmatch(shard.name)
            if m and int(m.group(1)) == self.rank:
                self._seq = max(self._seq, int(m.group(2)) + 1)

    def _committed(self, side: Path) -> EmbedShard | None:
        """A commit record whose shard is there with its recorded size; else None (the prompts
        it lists are simply encoded again: this is the encode phase's own scratch)."""
        try:
            data = json.loads(side.read_text(encoding="utf-8"))
            shard = EmbedShard(
                name=str(data["name"]),
                bytes=int(data["bytes"]),
                sha256=str(data["sha256"]),
                names=[str(n) for n in data["names"]],
                truncated=[str(k) for k in data.get("truncated", [])],
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None
        path = self.dir / f"{shard.name}.safetensors"
        if shard.name != side.stem or not path.is_file() or path.stat().st_size != shard.bytes:
            return None
        return shard

    def _add(self, shard: EmbedShard) -> None:
        """Index a committed shard's names, then drop its lists: memory must not grow with
        prompts."""
        pos = len(self.shards)
        self.shards.append(shard)
        for name in shard.names:
            self.index.add(name, pos)
        shard.names, shard.truncated = [], []

    def truncated_keys(self) -> NameIndex:
        """Every rank's truncated record keys (rank 0 reads them at the end, for the report),
        from the commit records, as a compact set (`key in store.truncated_keys()`)."""
        out = NameIndex()
        for side in sorted(self.dir.glob("r*.json")) if self.dir.is_dir() else ():
            shard = self._committed(side)
            for key in shard.truncated if shard is not None else ():
                out.add(key, 0)
        return out

    # ------------------------------------------------------------------ writing

    def has(self, name: str) -> bool:
        return name in self.index or name in self._buffer

    def add(self, name: str, embeds_LD: torch.Tensor, *, truncated: bool = False) -> None:
        """Buffer one embedding; the shard is flushed (committed) when it is full."""
        t = embeds_LD.detach().to("cpu").contiguous()
        self._buffer[name] = t
        self._buffer_bytes += t.numel() * t.element_size()
        if truncated:
            self._buffer_truncated.append(name)

    def full(self) -> bool:
        return len(self._buffer) >= self.flush_records or self._buffer_bytes >= FLUSH_BYTES

    def flush(self) -> None:
        """Publish the buffered embeddings as one shard, then commit it with its `.json`."""
        if not self._buffer:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"r{self.rank:05d}-{self._seq:06d}"
        crcs = {n: _crc(t) for n, t in self._buffer.items()}
        blob = st_save(self._buffer, metadata={META_KEY: json.dumps({"crc32c": crcs})})
        atomic_write_bytes(self.dir / f"{name}.safetensors", blob)
        shard = EmbedShard(
            name=name,
            bytes=len(blob),
            sha256=hashlib.sha256(blob).hexdigest(),
            names=list(self._buffer),
            truncated=list(self._buffer_truncated),
        )
        atomic_write_json(self.dir / f"{name}.json", shard.to_json())  # the commit
        self._add(shard)
        self._seq += 1
        self._buffer, self._buffer_truncated, self._buffer_bytes = {}, [], 0

    # ------------------------------------------------------------------ reading

    def get(self, name: str) -> torch.Tensor:
        """One embedding, from the buffer or its committed shard, checked against its crc32c."""
        if name in self._buffer:
            return self._buffer[name]
        pos = self.index.get(name)
        if pos is None:
            raise CacheError(f"no text embedding {name!r} in {str(self.dir)!r}")
        f = self._file(pos)
        path = self.dir / f"{self.shards[pos].name}.safetensors"
        try:
            t = f.get_tensor(name)
            want = json.loads((f.metadata() or {})[META_KEY])["crc32c"][name]
        except Exception as e:  # safetensors raises its own types on damaged files
            raise self._damaged(path, f"{type(e).__name__}: {e}") from None
        if _crc(t) != want:
            raise self._damaged(path, f"embedding {name!r} fails its crc32c check")
        return t

    def _file(self, pos: int) -> Any:
        """The open shard (one at a time: the denoise phase reads batches in shard order)."""
        if self._open is not None and self._open[0] == pos:
            return self._open[1]
        self.close_reader()
        path = self.dir / f"{self.shards[pos].name}.safetensors"
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as e:
            raise self._damaged(path, f"{type(e).__name__}: {e}") from None
        self._open = (pos, handle)
        return handle

    def _damaged(self, path: Path, detail: str) -> CacheError:
        return CacheError(
            f"embedding shard {str(path)!r} is damaged ({detail})",
            fix=f"delete {path.name} and {path.with_suffix('.json').name} from "
            f"{str(self.dir)!r}; the next run encodes those prompts again",
        )

    def close_reader(self) -> None:
        self._open = None  # safe_open handles close when dropped

    def remove(self) -> None:
        """Drop the whole store: the cache is complete and every record holds its embeddings."""
        self.close_reader()
        shutil.rmtree(self.dir, ignore_errors=True)
