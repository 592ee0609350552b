"""The manifest is the commit record of a cache: what it lists exists and is complete.

A cache directory holds `manifest.json` (header: format, teacher fingerprint, sampler settings,
field specs; the merged shard list; the `complete` flag) and, while writers are running, one
journal per writer rank under `journal/` (`cache/journal.py`). The committed shards are the
manifest's list plus every journal's; `finalize` folds the journals into the manifest. Nothing
ever trusts a directory listing or an array shape.

Every manifest and journal is checked against its schema (`wandistill/cache/files.py`) when
read (shard entries when first used: `entries.Entries`), and is sealed (`cache/seal.py`). The
parsed `files.Manifest` is what every reader uses.

The reads a caller starts from a location (`has_manifest`, `read_manifest`, `load_committed`)
take a path, a URL or an opened `Storage` and open a location once (`storage.storage_at`);
everything else here, and in journal.py, takes the cache's `Storage`.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from wandistill.cache.contract import FORMAT_NAME, MANIFEST_NAME, SCHEMA_VERSION
from wandistill.cache.encoding import stored_as
from wandistill.cache.entries import Entries
from wandistill.cache.files import BLOCKS, MANIFESTS, FieldSpec, Manifest
from wandistill.cache.journal import (
    MAX_MANIFEST_BYTES,
    CommitMemo,
    clear_journals,
    dump_json,
    journal_segments,
)
from wandistill.cache.seal import ENTRY_DIGEST, HEADER_DIGEST, check_seal, header_digests
from wandistill.checks.validate import check, parse_json
from wandistill.errors import CacheError, CacheMismatchError, UsageError
from wandistill.io.storage import Storage, storage_at

FIX_REBUILD = "rebuild the cache: re-run `wandistill precompute` into a new --out directory"
"""A cache of another schema (pre-release wandistill wrote 1 and 2) is rebuilt, not migrated."""
FIX_RESTORE = "restore manifest.json, or re-run `wandistill precompute` into a fresh directory"


def new_manifest(
    *,
    backend: str,
    teacher: dict[str, Any],
    settings: dict[str, Any],
    fields: list[dict[str, Any]],
    dims: dict[str, Any] | None = None,
    shared: dict[str, Any] | None = None,
    numerics: dict[str, Any] | None = None,
) -> Manifest:
    """A new cache's manifest (no shards yet), from the JSON blocks a run computed, checked
    against the manifest schema as a read would check it."""
    data = {
        "backend": backend,
        "teacher": teacher,
        "settings": settings,
        "fields": fields,
        "dims": dims or {},
        "shared": shared or {},
        "numerics": numerics or {},
    }
    model = MANIFESTS.get(backend)
    if model is None:
        raise UsageError(f"unknown cache backend {backend!r}", fix="use webdataset or zarr")
    data = json.loads(json.dumps(data))  # as it will be written (tuples become lists)
    return check(model, data, "the cache header of this run", fix=FIX_REBUILD, error=CacheError)


def manifest_json(manifest: Manifest) -> dict[str, Any]:
    """The manifest as written: the header blocks as read (or built), the seal recomputed over
    them, then the shard entries as read; key order as every wandistill wrote it."""
    data: dict[str, Any] = {
        "format": FORMAT_NAME,
        "schema_version": manifest.schema_version,
        "wandistill_version": manifest.wandistill_version,
        "backend": manifest.backend,
        "created": manifest.created,
        "complete": manifest.complete,
    }
    for name in BLOCKS:
        data[name] = manifest.block_json(name)
    data[HEADER_DIGEST] = header_digests(data)
    data["shards"] = manifest.shards.json_list()
    return data


def parse_manifest(data: Any, where: str) -> Manifest:
    """Check parsed manifest JSON against its schema and seal; one CacheError if anything is
    wrong (naming the field). Shard entries are checked when first used (`entries.Entries`)."""
    if not isinstance(data, dict):
        raise CacheError(
            f"{where} is corrupt: the top level is a JSON {type(data).__name__}, not an object",
            fix=FIX_RESTORE,
        )
    if data.get("format") != FORMAT_NAME:
        raise CacheError(
            f"{where} is not a wandistill cache manifest (no format field)", fix=FIX_RESTORE
        )
    version = data.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise CacheError(
            f"{where} has cache schema {_shown(version)}, this wandistill reads schema "
            f"{SCHEMA_VERSION} only",
            fix=FIX_REBUILD,
        )
    model = MANIFESTS.get(data.get("backend"))  # type: ignore[arg-type]
    if model is None:
        raise CacheError(
            f"{where}: backend = {_shown(data.get('backend'))}: must be webdataset or zarr",
            fix=FIX_RESTORE,
        )
    manifest = check(model, data, f"{where} is corrupt", fix=FIX_RESTORE, error=CacheError)
    manifest.shards.where = where
    check_seal(data, where)
    return manifest


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def manifest_path(cache: str | Path) -> Path:
    """The manifest of a local cache (a cache at a URL: `has_manifest`, `manifest_name`)."""
    return Path(cache) / MANIFEST_NAME


def manifest_name(st: Storage) -> str:
    """The manifest's path or URL, for messages."""
    return st.name(MANIFEST_NAME)


def has_manifest(cache: str | Path | Storage) -> bool:
    """True once a cache's manifest exists (a file, or an object at a URL)."""
    st = storage_at(cache)
    return st.exists(MANIFEST_NAME) and not st.isdir(MANIFEST_NAME)


def read_manifest(cache: str | Path | Storage) -> Manifest:
    """Load a cache's manifest; every way it can be wrong is one clear CacheError."""
    st = storage_at(cache)
    if not st.exists(""):
        raise UsageError(
            f"cache path {st.url!r} does not exist",
            fix="pass the --out directory of a `wandistill precompute` run",
        )
    if not st.exists(MANIFEST_NAME) or st.isdir(MANIFEST_NAME):
        raise UsageError(
            f"{st.url!r} is not a wandistill cache (no {MANIFEST_NAME})",
            fix="pass the --out directory of a `wandistill precompute` run",
        )
    where = repr(st.name(MANIFEST_NAME))
    cap = MAX_MANIFEST_BYTES
    data = st.read(MANIFEST_NAME, max_bytes=cap, what="manifest", fix=FIX_RESTORE, error=CacheError)
    obj = parse_json(data, f"{where} is corrupt", fix=FIX_RESTORE, error=CacheError)
    return parse_manifest(obj, where)


def write_manifest(st: Storage, manifest: Manifest) -> None:
    st.put(MANIFEST_NAME, dump_json(manifest_json(manifest)))


def create_manifest_exclusive(st: Storage, manifest: Manifest) -> bool:
    """Create manifest.json only if absent (several ranks may race); True if this call won."""
    manifest.created = manifest.created or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return st.create(MANIFEST_NAME, dump_json(manifest_json(manifest)))


def committed_shards(
    st: Storage, manifest: Manifest, memo: CommitMemo | None = None
) -> Entries[Any]:
    """Every committed shard: the manifest's list, then journal entries not yet folded in."""
    sources = _committed(st, manifest, memo)
    return Entries.join(manifest.shards.model, [(e, i) for _, _, e, i in sources])


Source = tuple[str, str, Entries[Any], int]
"""(the file that lists an entry, its path in the cache, that file's entries, the index)."""


def _committed(st: Storage, manifest: Manifest, memo: CommitMemo | None) -> list[Source]:
    """Where each committed entry is: the manifest's, then journal entries not folded in."""
    seen = set(manifest.shards.names())
    mpath = manifest_name(st)
    sources = [(mpath, MANIFEST_NAME, manifest.shards, i) for i in range(len(manifest.shards))]
    for j in journal_segments(st, manifest.backend, memo):
        new = [i for i in range(len(j.shards)) if j.shards.name(i) not in seen]
        sources += [(j.name, j.rel, j.shards, i) for i in new]
    return sources


def load_committed(
    cache: str | Path | Storage, *, check_entries: bool = True, memo: CommitMemo | None = None
) -> Manifest:
    """The manifest with journal entries folded in (what a reader may use right now).

    A shard listed twice, an entry without its digest and (`check_entries`) an entry edited
    after it was committed are refused here, naming the file and the shard; these checks read
    the entries' JSON, and each entry is checked against its schema when first used
    (`entries.Entries`), so a load costs about a `json.loads` plus one digest per new entry.
    `cache verify` passes check_entries=False and reports those edits itself, with their
    consequences. A `memo` kept across calls skips files unchanged since its last call.
    """
    memo = memo or CommitMemo()
    st = storage_at(cache)
    stamp = st.stamp(MANIFEST_NAME)
    read = memo.load(MANIFEST_NAME, stamp, lambda: read_manifest(st)).value
    sources = _committed(st, read, memo)
    shards = Entries.join(read.shards.model, [(e, i) for _, _, e, i in sources])
    manifest = read.model_copy(update={"shards": shards})  # the memo's copy stays as read
    problems: list[tuple[str, str]] = []
    listed = Counter(shards.names())  # not list.count: O(n^2) in shards
    problems += [
        (manifest_name(st), f"shard {n} is listed twice")
        for n in sorted(n for n, times in listed.items() if times > 1)
    ]
    for where, rel, entries, i in sources:
        entry = entries.json(i)
        if entry.get(ENTRY_DIGEST) is None:
            entries[i]  # an edit that breaks the schema is reported as that
            problems.append((where, f"shard {entries.name(i)}: entry has no {ENTRY_DIGEST}"))
        elif check_entries and (edited := memo.verdict(rel, i, entry)):
            entries[i]
            problems.append((where, edited))
    if problems:
        where = problems[0][0]
        shown = "; ".join(p for _, p in problems[:3]) + (
            f"; ... ({len(problems)} in all)" if len(problems) > 3 else ""
        )
        raise CacheError(
            f"{where!r} is corrupt: {shown}",
            fix="restore manifest.json (or the journal), or re-run `wandistill precompute` into "
            "a fresh directory",
        )
    return manifest


def finalize(st: Storage, *, complete: bool) -> Manifest:
    """Fold journals into manifest.json (one process, after every writer has closed)."""
    manifest = load_committed(st)
    manifest.complete = complete
    write_manifest(st, manifest)
    clear_journals(st)
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


def _stored(spec: FieldSpec) -> str:
    return f"{spec.name}:{stored_as(spec, sep=' ')}"


def check_compatible(st: Storage, existing: Manifest, new: Manifest) -> None:
    """Refuse to mix records from another teacher, sampler settings, numerics or backend.

    The first line of the error names what differs; one line per difference follows.
    """
    diffs: list[str] = []
    names: list[str] = []
    if existing.backend != new.backend:
        names.append("backend")
        diffs.append(f"backend: cache has {existing.backend!r}, this run has {new.backend!r}")
    old_fp = existing.teacher.fingerprint
    new_fp = new.teacher.fingerprint
    if old_fp != new_fp:
        names.append("teacher")
        diffs.append(
            f"teacher.fingerprint: cache has {str(old_fp)[:16]}..., this run has "
            f"{str(new_fp)[:16]}... (another teacher, or changed weights)"
        )
        parts = mismatches(existing.teacher.components, new.teacher.components)
        changed = sorted({d.split(".", 1)[0].split(":", 1)[0] for d in parts})
        if changed:
            diffs.append(f"teacher components that differ: {', '.join(changed)}")
    for block, old, now in (
        ("settings", existing.block_json("settings"), new.block_json("settings")),
        ("numerics", existing.numerics, new.numerics),
    ):
        block_diffs = mismatches(old, now)
        names.extend(f"{block}." + d.split(":", 1)[0] for d in block_diffs)
        diffs.extend(f"{block}." + d for d in block_diffs)
    if [_stored(f) for f in existing.fields] != [_stored(f) for f in new.fields]:
        names.append("fields")
        diffs.append(
            "fields: cache has "
            + ", ".join(map(_stored, existing.fields))
            + "; this run has "
            + ", ".join(map(_stored, new.fields))
        )
    if diffs:
        shown = "\n  ".join(diffs[:12]) + ("\n  ..." if len(diffs) > 12 else "")
        head = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        numerics = any(n.startswith("numerics.") for n in names)
        raise CacheMismatchError(
            f"cache {st.url!r} was written with a different {head}:\n  {shown}",
            fix="write to a new --out directory, or run with the cache's settings"
            + (
                " (numerics: same sampler.batch_size, OMP_NUM_THREADS/torch threads, device, "
                "library versions and math flags; see docs/cache-format.md)"
                if numerics
                else ""
            ),
        )
