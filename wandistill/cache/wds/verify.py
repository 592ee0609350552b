"""`cache verify` for webdataset shards: the tar's members walked without
extracting, the frame digest, then every record read and checked (`ShardChecks`, a part of
`WebDatasetSource`)."""

from __future__ import annotations

import hashlib
import tarfile
from typing import TYPE_CHECKING

from wandistill.cache.files import WdsEntry
from wandistill.cache.wds.format import MEMBER_EXTS, UNSAFE_EXTS, _describe, member_name_problem
from wandistill.errors import CacheError

if TYPE_CHECKING:
    from collections.abc import Callable

    from wandistill.cache.contract import Record
    from wandistill.io.storage import Storage


class ShardChecks:
    """The verify half of `WebDatasetSource` (which supplies `store`, `rel` and
    `_checked_record`)."""

    store: Storage
    rel: Callable[[WdsEntry], str]
    _checked_record: Callable[[WdsEntry, int], Record]

    def member_problems(self, entry: WdsEntry) -> tuple[list[str], dict[str, str]]:
        """Walk the tar headers (never extracting): (shard-level problems, key -> problem).

        Every member must be `<listed key>.json` or `<listed key>.safetensors`, a regular file,
        at the offsets the manifest lists. Unsafe names (absolute, `..`) and anything else
        (a `.pth`, a link, a stray file) are reported; nothing is decoded.
        """
        name = entry.name
        index = {k: i for i, k in enumerate(entry.keys)}
        shard: list[str] = []
        per_key: dict[str, str] = {}
        seen: dict[str, tuple[int, int]] = {}
        complete = True
        try:
            with (
                self.store.open_read(self.rel(entry)) as f,
                tarfile.open(fileobj=f, mode="r:") as tar,
            ):
                for m in tar:
                    problem = member_name_problem(m.name)
                    if problem:
                        shard.append(f"shard {name}: member {m.name!r} {problem}; refused")
                        continue
                    if not m.isreg():
                        shard.append(
                            f"shard {name}: member {m.name!r} is not a regular file "
                            "(link or device); refused"
                        )
                        continue
                    key, _, ext = m.name.partition(".")
                    if "/" in m.name or key not in index or ext not in MEMBER_EXTS:
                        last = m.name.rsplit(".", 1)[-1].lower()
                        why = (
                            "pickle-backed: never decode it"
                            if last in UNSAFE_EXTS
                            else "not a record listed in the manifest"
                            if ext in MEMBER_EXTS
                            else "a wandistill shard holds only <key>.json and <key>.safetensors"
                        )
                        shard.append(f"shard {name}: unexpected member {m.name!r} ({why})")
                        continue
                    if m.name in seen:
                        shard.append(f"shard {name}: member {m.name!r} appears twice")
                        continue
                    seen[m.name] = (m.offset_data, m.size)
        except (tarfile.TarError, OSError, EOFError) as e:
            complete = False
            shard.append(f"shard {name}: tar headers unreadable after {len(seen)} members ({e})")
        for key, i in index.items():
            o = entry.offsets[i]
            for ext, want in (("safetensors", (o[0], o[1])), ("json", (o[2], o[3]))):
                got = seen.get(f"{key}.{ext}")
                if got is None:
                    if complete:
                        per_key.setdefault(key, f"member {key}.{ext} is missing from the tar")
                elif got != want:
                    per_key.setdefault(
                        key,
                        f"manifest offsets put {ext} at {want[0]} ({want[1]} bytes), the tar "
                        f"has it at {got[0]} ({got[1]} bytes) (manifest edited?)",
                    )
        return shard, per_key

    def frame_digest(self, entry: WdsEntry, rel: str) -> str:
        """sha256 of the shard's bytes outside its records' tensor data (schema 3's
        `frame_sha256`): each record's data starts after its safetensors header, whose length is
        read from the file (a changed length moves the frame, so the digest fails). The file
        must have the entry's size (the schema keeps every offset inside it)."""
        skips, size = [], entry.bytes
        for st_off, length, _, _ in entry.offsets:
            prefix = self.store.read_range(rel, st_off, min(8, length))
            head = 8 + int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
            skips.append((st_off + min(head, length), st_off + length))
        sha, pos = hashlib.sha256(), 0
        with self.store.open_read(rel) as f:
            for skip_from, skip_to in [*sorted(skips), (size, size)]:
                f.seek(pos)
                while pos < skip_from and (chunk := f.read(min(1 << 22, skip_from - pos))):
                    sha.update(chunk)
                    pos += len(chunk)
                pos = max(pos, skip_to)
        return sha.hexdigest()

    def verify(self, entry: WdsEntry) -> list[str]:
        """Checksum the shard, walk its members, then read and check every record.

        Shard-level problems first, then at most one line per record, naming shard and key.
        """
        name = entry.name
        problems: list[str] = []  # the entry's rows fit its keys: its schema (files.py) says so
        try:
            rel = self.rel(entry)
        except CacheError as e:
            return [e.message]
        size = self.store.size(rel)
        if size is None:
            return [f"shard {name}: file {entry.file} is missing"]
        if size != entry.bytes:
            problems.append(f"shard {name}: {size} bytes on disk, manifest says {entry.bytes}")
        # the records' tensor data is crc32c-checked below; the frame covers every other byte
        if size == entry.bytes and self.frame_digest(entry, rel) != entry.frame_sha256:
            problems.append(
                f"shard {name}: sha256 mismatch in its frame (tar headers or padding, "
                ".json members or safetensors headers changed after it was written, or the "
                "manifest's frame_sha256 was edited)"
            )
        shard_level, per_key = self.member_problems(entry)
        problems.extend(shard_level)
        for i, key in enumerate(entry.keys):
            detail = per_key.get(key)
            if detail is None:
                try:
                    rec = self._checked_record(entry, i)
                    for tname, t in rec.tensors().items():
                        if t.is_floating_point() and not bool(t.float().isfinite().all()):
                            raise ValueError(f"{tname!r} holds non-finite values")
                except Exception as e:  # every decode failure is reported, none is fatal here
                    detail = _describe(e)
            if detail is not None:
                problems.append(f"shard {name} record {key}: {detail}")
        return problems
