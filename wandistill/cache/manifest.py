"""The manifest is the commit record of a cache: what it lists exists and is complete.

A cache directory holds `manifest.json` (header: format, teacher fingerprint, sampler settings,
field specs; the merged shard list; the `complete` flag) and, while writers are running, one
journal per writer rank under `journal/`. A writer publishes a shard by renaming it into place and
then atomically rewriting its own journal, so concurrent ranks never contend for one file. The
committed shards are the manifest's list plus every journal's; `finalize` folds the journals into
the manifest. Nothing ever trusts a directory listing or an array shape.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wandistill import __version__
from wandistill.cache.schema import FORMAT_NAME, MANIFEST_NAME, SCHEMA_VERSION, canonical_json
from wandistill.errors import CacheError, CacheMismatchError, UsageError
from wandistill.fsutil import atomic_open, atomic_write_json, fsync_dir, temp_name

JOURNAL_DIR = "journal"


@dataclass(slots=True)
class Manifest:
    backend: str
    teacher: dict[str, Any]
    """{"fingerprint": sha256 hex, "components": {...}, "path": str} (path is informational)."""
    settings: dict[str, Any]
    """Sampler settings: everything that changes the teacher's output for a given prompt+seed."""
    fields: list[dict[str, str]]
    dims: dict[str, Any] = field(default_factory=dict)
    """Sizes a student must match: text_dim, latent_channels, latent_shape, num_recorded_steps."""
    shards: list[dict[str, Any]] = field(default_factory=list)
    complete: bool = False
    shared: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    wandistill_version: str = __version__
    created: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "schema_version": self.schema_version,
            "wandistill_version": self.wandistill_version,
            "backend": self.backend,
            "created": self.created,
            "complete": self.complete,
            "teacher": self.teacher,
            "settings": self.settings,
            "fields": self.fields,
            "dims": self.dims,
            "shared": self.shared,
            "shards": self.shards,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str) -> Manifest:
        if data.get("format") != FORMAT_NAME:
            raise CacheError(f"{where} is not a wandistill cache manifest (no format field)")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise CacheError(
                f"{where} has schema version {data.get('schema_version')}, this wandistill "
                f"reads version {SCHEMA_VERSION}",
                fix="re-run `wandistill precompute` into a new cache, or use a matching wandistill",
            )
        for name, kind in (
            ("teacher", dict),
            ("settings", dict),
            ("fields", list),
            ("dims", dict),
            ("shared", dict),
            ("shards", list),
        ):
            if name in data and not isinstance(data[name], kind):
                raise CacheError(
                    f"{where} is corrupt: {name!r} must be a JSON "
                    f"{'object' if kind is dict else 'list'}, not {type(data[name]).__name__}",
                    fix="restore it, or re-run `wandistill precompute` into a fresh directory",
                )
        try:
            return cls(
                backend=data["backend"],
                teacher=data["teacher"],
                settings=data["settings"],
                fields=data["fields"],
                dims=dict(data.get("dims", {})),
                shards=list(data.get("shards", [])),
                complete=bool(data.get("complete", False)),
                shared=dict(data.get("shared", {})),
                schema_version=data["schema_version"],
                wandistill_version=data.get("wandistill_version", "?"),
                created=data.get("created", ""),
            )
        except KeyError as e:
            raise CacheError(f"{where} is corrupt: missing {e.args[0]!r}") from None

    @property
    def num_records(self) -> int:
        return sum(int(s["records"]) for s in self.shards)

    @property
    def num_bytes(self) -> int:
        return sum(int(s["bytes"]) for s in self.shards)


def manifest_path(cache: str | Path) -> Path:
    return Path(cache) / MANIFEST_NAME


def read_manifest(cache: str | Path) -> Manifest:
    """Load a cache's manifest; every way it can be wrong is one clear CacheError."""
    cache = Path(cache)
    if not cache.exists():
        raise UsageError(
            f"cache path {str(cache)!r} does not exist",
            fix="pass the --out directory of a `wandistill precompute` run",
        )
    mpath = manifest_path(cache)
    if not mpath.is_file():
        raise UsageError(
            f"{str(cache)!r} is not a wandistill cache (no {MANIFEST_NAME})",
            fix="pass the --out directory of a `wandistill precompute` run",
        )
    try:
        data = json.loads(mpath.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CacheError(
            f"{str(mpath)!r} is corrupt ({e})",
            fix="restore it, or re-run `wandistill precompute` into a fresh directory",
        ) from None
    if not isinstance(data, dict):
        raise CacheError(f"{str(mpath)!r} is corrupt (not a JSON object)")
    return Manifest.from_json(data, repr(str(mpath)))


def write_manifest(cache: str | Path, manifest: Manifest) -> None:
    atomic_write_json(manifest_path(cache), manifest.to_json())


def create_manifest_exclusive(cache: Path, manifest: Manifest) -> bool:
    """Create manifest.json only if absent (several ranks may race); True if this call won."""
    manifest.created = manifest.created or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    final = manifest_path(cache)
    tmp = temp_name(final)
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest.to_json(), f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, final)  # atomic create-if-absent, unlike rename
        won = True
    except FileExistsError:
        won = False
    finally:
        os.unlink(tmp)
    fsync_dir(cache)
    return won


def journal_path(cache: Path, rank: int) -> Path:
    return cache / JOURNAL_DIR / f"rank-{rank:05d}.json"


def read_journals(cache: Path) -> list[dict[str, Any]]:
    """Shard entries committed by writers since the last finalize, ordered by rank and sequence."""
    jdir = cache / JOURNAL_DIR
    if not jdir.is_dir():
        return []
    entries: list[dict[str, Any]] = []
    for p in sorted(jdir.glob("rank-*.json")):
        try:
            entries.extend(json.loads(p.read_text(encoding="utf-8"))["shards"])
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
            raise CacheError(f"journal {str(p)!r} is corrupt ({e})") from None
    return entries


def entry_json(entry: dict[str, Any]) -> bytes:
    """One shard entry as compact JSON (a writer keeps its journal entries in this form)."""
    return json.dumps(entry, separators=(",", ":"), ensure_ascii=False).encode()


def write_journal_chunks(cache: Path, rank: int, entries: list[bytes]) -> None:
    """`write_journal` for entries already serialized by `entry_json`: the same JSON document,
    streamed, so a writer never re-serializes (or holds as objects) every entry it committed."""
    path = journal_path(cache, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "wb") as f:
        f.write(b'{"rank": %d, "shards": [\n' % rank)
        for i, chunk in enumerate(entries):
            if i:
                f.write(b",\n")
            f.write(chunk)
        f.write(b"\n]}\n")


def write_journal(cache: Path, rank: int, shards: list[dict[str, Any]]) -> None:
    path = journal_path(cache, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"rank": rank, "shards": shards})


def committed_shards(cache: Path, manifest: Manifest) -> list[dict[str, Any]]:
    """Every committed shard: the manifest's list, then journal entries not yet folded in."""
    seen = {s["name"] for s in manifest.shards}
    extra = [s for s in read_journals(cache) if s["name"] not in seen]
    return [*manifest.shards, *extra]


def load_committed(cache: str | Path) -> Manifest:
    """The manifest with journal entries folded in (what a reader may use right now).

    Structurally impossible shard entries (a hand edit: record count != keys, a wrong type, a
    file outside the cache, a shard listed twice) are refused here, naming shard and field.
    """
    cache = Path(cache)
    manifest = read_manifest(cache)
    manifest.shards = committed_shards(cache, manifest)
    problems = [p for e in manifest.shards for p in entry_problems(e)]
    names = [e["name"] for e in manifest.shards]
    problems += [
        f"shard {n} is listed twice" for n in sorted({n for n in names if names.count(n) > 1})
    ]
    if problems:
        shown = "; ".join(problems[:3]) + (
            f"; ... ({len(problems)} in all)" if len(problems) > 3 else ""
        )
        raise CacheError(
            f"{str(manifest_path(cache))!r} is corrupt: {shown}",
            fix="restore manifest.json (or the journal), or re-run `wandistill precompute` into "
            "a fresh directory",
        )
    return manifest


# ------------------------------------------------------------------------- entry integrity

ENTRY_DIGEST = "entry_sha256"
"""Shard-entry field: sha256 of the entry's own canonical JSON (this field left out), set when
the shard is committed; `cache verify` reports an entry edited after that."""


def _nonneg_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def entry_problems(entry: Any) -> list[str]:
    """What makes a shard entry unusable as a commit record (types, counts, paths)."""
    if not isinstance(entry, dict):
        return [f"a shard entry is a {type(entry).__name__}, not an object"]
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        return [f"a shard entry has no name ({str(entry)[:80]})"]
    out: list[str] = []
    for key in ("records", "keys", "file", "bytes", "sha256"):
        if key not in entry:
            out.append(f"shard {name}: entry has no {key!r}")
    if out:
        return out
    keys, records = entry["keys"], entry["records"]
    if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
        out.append(f"shard {name}: 'keys' must be a list of record keys")
    elif not _nonneg_int(records):
        out.append(f"shard {name}: 'records' = {records!r} is not a non-negative integer")
    elif records != len(keys):
        out.append(
            f"shard {name}: manifest says {records} records but lists {len(keys)} keys "
            "(manifest edited?)"
        )
    if not _nonneg_int(entry["bytes"]):
        out.append(f"shard {name}: 'bytes' = {entry['bytes']!r} is not a non-negative integer")
    if not isinstance(entry["sha256"], str | dict):
        out.append(f"shard {name}: 'sha256' must be a hex string or an object")
    rel = entry["file"]
    if not isinstance(rel, str) or not rel:
        out.append(f"shard {name}: 'file' must be a relative path")
    elif rel.startswith(("/", "\\")) or ".." in Path(rel).parts or (len(rel) > 1 and rel[1] == ":"):
        out.append(f"shard {name}: file {rel!r} is outside the cache directory (manifest edited?)")
    return out


def entry_digest(entry: dict[str, Any]) -> str:
    """sha256 of a shard entry's canonical JSON without its own digest field."""
    body = {k: v for k, v in entry.items() if k != ENTRY_DIGEST}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


def seal_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """Add the entry digest (the writer calls this when it commits a shard)."""
    entry[ENTRY_DIGEST] = entry_digest(entry)
    return entry


def digest_problem(entry: dict[str, Any]) -> str | None:
    """A precise line if a sealed entry changed since it was committed (unsealed: None)."""
    want = entry.get(ENTRY_DIGEST)
    if want is None or entry_digest(entry) == want:
        return None
    return (
        f"shard {entry['name']}: manifest entry was edited after the shard was committed "
        f"({ENTRY_DIGEST} does not match its records/keys/offsets/sha256/bytes)"
    )


def finalize(cache: str | Path, *, complete: bool) -> Manifest:
    """Fold journals into manifest.json (one process, after every writer has closed)."""
    cache = Path(cache)
    manifest = load_committed(cache)
    manifest.complete = complete
    write_manifest(cache, manifest)
    jdir = cache / JOURNAL_DIR
    if jdir.is_dir():
        for p in jdir.glob("rank-*.json"):
            p.unlink()
    return manifest


def mismatches(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of every leaf that differs between two nested dicts."""
    out: list[str] = []
    for key in sorted(set(old) | set(new)):
        name = f"{prefix}{key}"
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(mismatches(a, b, name + "."))
        elif a != b:
            out.append(f"{name}: cache has {a!r}, this run has {b!r}")
    return out


def check_compatible(cache: Path, existing: Manifest, new: Manifest) -> None:
    """Refuse to mix records from another teacher, sampler settings or backend into a cache.

    The first line of the error names what differs; one line per difference follows.
    """
    diffs: list[str] = []
    names: list[str] = []
    if existing.backend != new.backend:
        names.append("backend")
        diffs.append(f"backend: cache has {existing.backend!r}, this run has {new.backend!r}")
    old_fp = existing.teacher.get("fingerprint")
    new_fp = new.teacher.get("fingerprint")
    if old_fp != new_fp:
        names.append("teacher")
        diffs.append(
            f"teacher.fingerprint: cache has {str(old_fp)[:16]}..., this run has "
            f"{str(new_fp)[:16]}... (another teacher, or changed weights)"
        )
        parts = mismatches(
            existing.teacher.get("components", {}), new.teacher.get("components", {})
        )
        changed = sorted({d.split(".", 1)[0].split(":", 1)[0] for d in parts})
        if changed:
            diffs.append(f"teacher components that differ: {', '.join(changed)}")
    setting_diffs = mismatches(existing.settings, new.settings)
    names.extend("settings." + d.split(":", 1)[0] for d in setting_diffs)
    diffs.extend("settings." + d for d in setting_diffs)
    if [(f["name"], f["dtype"]) for f in existing.fields] != [
        (f["name"], f["dtype"]) for f in new.fields
    ]:
        names.append("fields")
        diffs.append(
            "fields: cache has "
            + ", ".join(f"{f['name']}:{f['dtype']}" for f in existing.fields)
            + "; this run has "
            + ", ".join(f"{f['name']}:{f['dtype']}" for f in new.fields)
        )
    if diffs:
        shown = "\n  ".join(diffs[:12]) + ("\n  ..." if len(diffs) > 12 else "")
        head = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise CacheMismatchError(
            f"cache {str(cache)!r} was written with a different {head}:\n  {shown}",
            fix="write to a new --out directory, or run with the cache's settings",
        )
