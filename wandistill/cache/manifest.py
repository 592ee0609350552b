"""The manifest is the commit record of a cache: what it lists exists and is complete.

A cache directory holds `manifest.json` (header: format, teacher fingerprint, sampler settings,
field specs; the merged shard list; the `complete` flag) and, while writers are running, one
journal per writer rank under `journal/`. A writer publishes a shard by renaming it into place and
then atomically rewriting its own journal, so concurrent ranks never contend for one file. A
rank's journal is a run of segments (`rank-<r>.json`, then `rank-<r>-<s>.json`): a commit
rewrites only the last one, so what a commit writes stays bounded however long the run. The
committed shards are the manifest's list plus every journal's; `finalize` folds the journals into
the manifest. Nothing ever trusts a directory listing or an array shape.

Every manifest and journal is checked against its schema (`wandistill/cache/files.py`) when
read, and is sealed: `header_sha256` holds a sha256 per block that defines what the records mean
(teacher, settings, numerics, fields, dims, shared, ...), checked on every open, and each shard
entry carries its own `entry_sha256`. A hand edit is one clear error, never records read under
a meaning they were not written with.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from wandistill import __version__
from wandistill.cache.contract import FORMAT_NAME, MANIFEST_NAME, SCHEMA_VERSION
from wandistill.cache.files import JOURNALS, MANIFESTS, SEALED
from wandistill.checks.validate import GiB, check, parse_json, seal
from wandistill.errors import CacheError, CacheMismatchError, UsageError
from wandistill.io.storage import Storage, join, open_storage

JOURNAL_DIR = "journal"
_JOURNAL_NAME = re.compile(r"rank-(\d{5,7})(?:-(\d{6}))?\.json")
JOURNAL_SEGMENT_BYTES = 256 << 10
"""A commit rewrites its rank's last journal segment whole (one atomic put: object stores cannot
append); once that segment holds this many bytes of entries, the next commit starts a new one.
One file per rank made a run of n shards write O(n^2) journal bytes (4,000 one-record shards:
2.75 GB, each commit slower than the last); segments keep it O(n)."""
FIX_REBUILD = "rebuild the cache: re-run `wandistill precompute` into a new --out directory"
"""A cache of another schema (pre-release wandistill wrote 1 and 2) is rebuilt, not migrated."""
HEADER_DIGEST = "header_sha256"
MAX_MANIFEST_BYTES = GiB
"""Cap on manifest.json and each journal (~150 bytes per record: far beyond any real cache)."""
FIX_RESTORE = "restore manifest.json, or re-run `wandistill precompute` into a fresh directory"


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
    numerics: dict[str, Any] = field(default_factory=dict)
    """How the records' bits were computed beyond the settings (batch size, threads, library
    versions, device, math flags; docs/cache-format.md)."""
    schema_version: int = SCHEMA_VERSION
    wandistill_version: str = __version__
    created: str = ""

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
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
        }
        data["numerics"] = self.numerics
        data[HEADER_DIGEST] = header_digests(data)
        data["shards"] = self.shards
        return data

    @classmethod
    def from_json(cls, data: Any, where: str) -> Manifest:
        """Check parsed manifest JSON against its schema and seal; one CacheError if anything
        is wrong (naming the field), else the manifest with its blocks as read."""
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
        check(model, data, f"{where} is corrupt", fix=FIX_RESTORE, error=CacheError)
        check_seal(data, where)
        return cls(
            backend=data["backend"],
            teacher=data["teacher"],
            settings=data["settings"],
            fields=data["fields"],
            dims=data["dims"],
            shards=list(data["shards"]),
            complete=data["complete"],
            shared=data["shared"],
            numerics=data["numerics"],
            schema_version=version,
            wandistill_version=data["wandistill_version"],
            created=data["created"],
        )

    @property
    def num_records(self) -> int:
        return sum(int(s["records"]) for s in self.shards)

    @property
    def num_bytes(self) -> int:
        return sum(int(s["bytes"]) for s in self.shards)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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


def manifest_path(cache: str | Path) -> Path:
    """The manifest of a local cache (a cache at a URL: `has_manifest`, `manifest_name`)."""
    return Path(cache) / MANIFEST_NAME


def manifest_name(cache: str | Path) -> str:
    """The manifest's path or URL, for messages."""
    return join(cache, MANIFEST_NAME)


def has_manifest(cache: str | Path) -> bool:
    """True once a cache's manifest exists (a file, or an object at a URL)."""
    st = open_storage(cache)
    return st.exists(MANIFEST_NAME) and not st.isdir(MANIFEST_NAME)


def _dump(obj: Any) -> bytes:
    """The bytes of a manifest or journal (the same as `fsutil.atomic_write_json` writes)."""
    return (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode()


def read_manifest(cache: str | Path | Storage) -> Manifest:
    """Load a cache's manifest; every way it can be wrong is one clear CacheError."""
    st = cache if isinstance(cache, Storage) else open_storage(cache)
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
    return Manifest.from_json(obj, where)


def write_manifest(cache: str | Path, manifest: Manifest) -> None:
    open_storage(cache).put(MANIFEST_NAME, _dump(manifest.to_json()))


def create_manifest_exclusive(cache: str | Path, manifest: Manifest) -> bool:
    """Create manifest.json only if absent (several ranks may race); True if this call won."""
    manifest.created = manifest.created or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return open_storage(cache).create(MANIFEST_NAME, _dump(manifest.to_json()))


def journal_path(cache: str | Path, rank: int, segment: int = 0) -> str:
    return join(cache, _journal_rel(rank, segment))


def _journal_rel(rank: int, segment: int = 0) -> str:
    """Segment 0 keeps the name of a one-file journal, so short runs look as they always did."""
    tail = f"-{segment:06d}" if segment else ""
    return f"{JOURNAL_DIR}/rank-{rank:05d}{tail}.json"


@dataclass(frozen=True, slots=True)
class JournalSegment:
    """One journal file: whose it is, its place in that rank's run, and its shard entries."""

    rank: int
    segment: int
    rel: str
    """Its path in the cache (`journal/rank-...json`)."""
    name: str
    """Its path or URL, for messages."""
    shards: list[dict[str, Any]]


def journal_segments(
    cache: str | Path, backend: str, memo: CommitMemo | None = None
) -> list[JournalSegment]:
    """Every journal segment, checked against the journal schema, by rank then segment. With a
    `memo`, a segment unchanged since the memo last read it is not read again."""
    st = open_storage(cache)
    listed = (
        [(n, None) for n in st.list(JOURNAL_DIR)] if memo is None else st.list_stamped(JOURNAL_DIR)
    )
    listed = [(n, s) for n, s in listed if n.startswith("rank-") and n.endswith(".json")]
    if memo is None:
        out = [_read_segment(st, name, backend) for name, _ in listed]
    else:
        memo.keep({f"{JOURNAL_DIR}/{n}" for n, _ in listed} | {MANIFEST_NAME})
        out = [
            memo.load(f"{JOURNAL_DIR}/{n}", stamp, lambda n=n: _read_segment(st, n, backend)).value
            for n, stamp in listed
        ]
    return sorted(out, key=lambda j: (j.rank, j.segment))


def _read_segment(st: Storage, name: str, backend: str) -> JournalSegment:
    rel = f"{JOURNAL_DIR}/{name}"
    where = f"journal {st.name(rel)!r}"
    fix = "restore the journal, or re-run `wandistill precompute` into a fresh directory"
    m = _JOURNAL_NAME.fullmatch(name)
    if m is None:
        raise CacheError(
            f"{where}: not a journal name (rank-<5 digits>[-<6 digits>].json)", fix=fix
        )
    data = st.read(rel, max_bytes=MAX_MANIFEST_BYTES, what="journal", fix=fix, error=CacheError)
    obj = parse_json(data, f"{where} is corrupt", fix=fix, error=CacheError)
    journal = check(JOURNALS[backend], obj, f"{where} is corrupt", fix=fix, error=CacheError)
    ranks = {int(m.group(1)), journal.rank, *(e.rank for e in journal.shards)}
    if len(ranks) != 1:
        raise CacheError(
            f"{where} is corrupt: its name, its rank and its entries' ranks disagree "
            f"({sorted(ranks)})",
            fix=fix,
        )
    segment = int(m.group(2) or 0)
    return JournalSegment(journal.rank, segment, rel, st.name(rel), obj["shards"])


def read_journals(cache: str | Path, backend: str) -> list[dict[str, Any]]:
    """Shard entries committed by writers since the last finalize, ordered by rank and sequence."""
    return [e for j in journal_segments(cache, backend) for e in j.shards]


def entry_json(entry: dict[str, Any]) -> bytes:
    """One shard entry as compact JSON (a writer keeps its journal entries in this form)."""
    return json.dumps(entry, separators=(",", ":"), ensure_ascii=False).encode()


def write_journal_chunks(
    cache: str | Path, rank: int, entries: list[bytes], *, segment: int = 0
) -> None:
    """`write_journal` for entries already serialized by `entry_json`: the same JSON document,
    streamed, so a writer never re-serializes (or holds as objects) every entry it committed.
    The journal segment is the commit: it appears whole (rename, or one completed upload)."""
    st = open_storage(cache)
    st.makedirs(JOURNAL_DIR)
    with st.upload(_journal_rel(rank, segment)) as f:
        f.write(b'{"rank": %d, "shards": [\n' % rank)
        for i, chunk in enumerate(entries):
            if i:
                f.write(b",\n")
            f.write(chunk)
        f.write(b"\n]}\n")


def write_journal(cache: str | Path, rank: int, shards: list[dict[str, Any]]) -> None:
    st = open_storage(cache)
    st.makedirs(JOURNAL_DIR)
    st.put(_journal_rel(rank), _dump({"rank": rank, "shards": shards}))


def committed_shards(
    cache: str | Path, manifest: Manifest, memo: CommitMemo | None = None
) -> list[dict[str, Any]]:
    """Every committed shard: the manifest's list, then journal entries not yet folded in."""
    return _committed(cache, manifest, memo)[0]


def _committed(
    cache: str | Path, manifest: Manifest, memo: CommitMemo | None = None
) -> tuple[list[dict[str, Any]], list[tuple[str, str, int, dict[str, Any]]]]:
    """(committed entries, [(the file that lists it, its path in the cache, the entry's index
    there, entry)]) with journal entries folded in."""
    seen = {s["name"] for s in manifest.shards}
    mpath = manifest_name(cache)
    sources = [(mpath, MANIFEST_NAME, i, s) for i, s in enumerate(manifest.shards)]
    for j in journal_segments(cache, manifest.backend, memo):
        sources += [(j.name, j.rel, i, s) for i, s in enumerate(j.shards) if s["name"] not in seen]
    return [s[3] for s in sources], sources


class CommitMemo:
    """The manifest and journal segments `load_committed` already read and checked, each with
    the version it read (`Storage.stamp`). A reader polling a growing cache (follow mode) then
    re-reads only what changed, each rank's last journal segment, instead of parsing and
    digest-checking every entry at every poll (O(n^2) over a run: 20x the time for 4x the
    shards). Versions come from one listing of `journal/` (object stores: the ETags it returns)
    and one stamp of the manifest; a file without one is read every time."""

    @dataclass(slots=True)
    class Loaded:
        value: Any
        verdicts: dict[int, str | None] = field(default_factory=dict)
        """entry index -> its digest problem (None: intact), checked once per version."""

    def __init__(self) -> None:
        self._files: dict[str, tuple[Any, CommitMemo.Loaded]] = {}

    def load(self, rel: str, stamp: Any, read: Any) -> CommitMemo.Loaded:
        """The file's content as `read()` gives it, reused while `stamp` (taken before the read:
        a change during it shows at the next load) is what it was."""
        hit = self._files.get(rel)
        if stamp is not None and hit is not None and hit[0] == stamp:
            return hit[1]
        loaded = CommitMemo.Loaded(read())
        if stamp is None:
            self._files.pop(rel, None)
        else:
            self._files[rel] = (stamp, loaded)
        return loaded

    def keep(self, rels: set[str]) -> None:
        """Forget files no longer there (journals folded into the manifest)."""
        for rel in [r for r in self._files if r not in rels]:
            del self._files[rel]

    def verdict(self, rel: str, index: int, entry: dict[str, Any]) -> str | None:
        """`digest_problem(entry)`, entry `index` of the file at `rel` as last loaded."""
        hit = self._files.get(rel)
        if hit is None:
            return digest_problem(entry)
        verdicts = hit[1].verdicts
        if index not in verdicts:
            verdicts[index] = digest_problem(entry)
        return verdicts[index]


def load_committed(
    cache: str | Path, *, check_entries: bool = True, memo: CommitMemo | None = None
) -> Manifest:
    """The manifest with journal entries folded in (what a reader may use right now).

    Every file was checked against its schema on the way in; here a shard listed twice, and
    (`check_entries`) an entry edited after it was committed, are refused, naming the file and
    the shard. `cache verify` passes check_entries=False and reports those edits itself, with
    their consequences. A `memo` kept across calls skips files unchanged since its last call.
    """
    memo = memo or CommitMemo()
    st = open_storage(cache)
    stamp = st.stamp(MANIFEST_NAME)
    read = memo.load(MANIFEST_NAME, stamp, lambda: read_manifest(cache)).value
    manifest = replace(read, shards=list(read.shards))  # the memo's copy stays as read
    manifest.shards, sources = _committed(cache, manifest, memo)
    problems: list[tuple[str, str]] = []
    listed = Counter(e["name"] for e in manifest.shards)  # not list.count: O(n^2) in shards
    problems += [
        (manifest_name(cache), f"shard {n} is listed twice")
        for n in sorted(n for n, times in listed.items() if times > 1)
    ]
    for where, rel, i, entry in sources:
        if ENTRY_DIGEST not in entry:
            problems.append((where, f"shard {entry['name']}: entry has no {ENTRY_DIGEST}"))
        elif check_entries and (edited := memo.verdict(rel, i, entry)):
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


# ------------------------------------------------------------------------- entry integrity

ENTRY_DIGEST = "entry_sha256"
"""Shard-entry field: sha256 of the entry's own canonical JSON (this field left out), set when
the shard is committed; `cache verify` reports an entry edited after that."""


def entry_digest(entry: dict[str, Any]) -> str:
    """sha256 of a shard entry's canonical JSON without its own digest field."""
    return seal({k: v for k, v in entry.items() if k != ENTRY_DIGEST})


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
    manifest = load_committed(cache)
    manifest.complete = complete
    write_manifest(cache, manifest)
    st = open_storage(cache)
    for name in st.list(JOURNAL_DIR):
        if name.startswith("rank-") and name.endswith(".json"):
            st.rm(f"{JOURNAL_DIR}/{name}")
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


def _stored(spec: dict[str, Any]) -> str:
    """How a field is stored, in one word: name:dtype, plus its storage options (encoding.py)."""
    text = f"{spec['name']}:{spec['dtype']}"
    if spec.get("decoded"):
        text += f" (of {spec['decoded']}{', scaled' if spec.get('scaled') else ''})"
    if spec.get("compression"):
        text += f" {spec['compression']}-{spec.get('compression_level')}"
    return text


def check_compatible(cache: str | Path, existing: Manifest, new: Manifest) -> None:
    """Refuse to mix records from another teacher, sampler settings, numerics or backend.

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
    for block, old, now in (
        ("settings", existing.settings, new.settings),
        ("numerics", existing.numerics or {}, new.numerics or {}),
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
            f"cache {str(cache)!r} was written with a different {head}:\n  {shown}",
            fix="write to a new --out directory, or run with the cache's settings"
            + (
                " (numerics: same sampler.batch_size, OMP_NUM_THREADS/torch threads, device, "
                "library versions and math flags; see docs/cache-format.md)"
                if numerics
                else ""
            ),
        )
