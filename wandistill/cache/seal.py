"""The seals of a cache's manifest: one digest per header block, one per shard entry.

`header_sha256` holds a sha256 of each block that defines what the records mean (teacher,
settings, numerics, fields, dims, shared, ...), checked on every open; each shard entry carries
its own `entry_sha256`, set when the shard is committed. Both are taken over the JSON as written
(canonical form), so a hand edit is one clear error, never records read under a meaning they were
not written with.
"""

from __future__ import annotations

from typing import Any

from wandistill.cache.files import SEALED
from wandistill.checks.validate import seal
from wandistill.errors import CacheError

HEADER_DIGEST = "header_sha256"
ENTRY_DIGEST = "entry_sha256"
"""Shard-entry field: sha256 of the entry's own canonical JSON (this field left out), set when
the shard is committed; `cache verify` reports an entry edited after that."""


def header_digests(data: dict[str, Any]) -> dict[str, str]:
    """The manifest seal: sha256 of each block that defines what the records mean."""
    return {name: seal(data.get(name)) for name in SEALED}


def check_seal(data: dict[str, Any], where: str) -> None:
    """Refuse a manifest whose sealed blocks changed since the cache was created."""
    want = data.get(HEADER_DIGEST) or {}
    got = header_digests(data)
    changed = [name for name in SEALED if want.get(name) != got[name]]
    if changed:
        raise CacheError(
            f"{where}: {', '.join(changed)} changed after the cache was written "
            f"({HEADER_DIGEST} does not match; a hand edit would change what the records mean)",
            fix="restore manifest.json; to use other settings, precompute into a new --out",
        )


def entry_digest(entry: dict[str, Any]) -> str:
    """sha256 of a shard entry's canonical JSON without its own digest field."""
    return seal({k: v for k, v in entry.items() if k != ENTRY_DIGEST})


def seal_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """Add the entry digest (the writer calls this when it commits a shard)."""
    entry[ENTRY_DIGEST] = entry_digest(entry)
    return entry


def digest_problem(entry: dict[str, Any]) -> str | None:
    """A precise line if a sealed entry (its JSON as read) changed since it was committed
    (unsealed: None)."""
    want = entry.get(ENTRY_DIGEST)
    if want is None or entry_digest(entry) == want:
        return None
    return (
        f"shard {entry['name']}: manifest entry was edited after the shard was committed "
        f"({ENTRY_DIGEST} does not match its records/keys/offsets/sha256/bytes)"
    )
