"""Writer journals: how a shard is committed while writers are running.

While writers run, each rank keeps a journal under `journal/`. A writer publishes a shard by
renaming it into place and then atomically rewriting its own journal, so concurrent ranks never
contend for one file. A rank's journal is a run of segments (`rank-<r>.json`, then
`rank-<r>-<s>.json`): a commit rewrites only the last one, so what a commit writes stays bounded
however long the run. `manifest.load_committed` reads the manifest's list plus every journal's;
`manifest.finalize` folds the journals into the manifest.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from wandistill.cache.contract import MANIFEST_NAME
from wandistill.cache.entries import Entries
from wandistill.cache.files import JOURNALS, Entry
from wandistill.cache.seal import digest_problem
from wandistill.checks.validate import GiB, check, parse_json
from wandistill.errors import CacheError
from wandistill.io.storage import Storage

JOURNAL_DIR = "journal"
_JOURNAL_NAME = re.compile(r"rank-(\d{5,7})(?:-(\d{6}))?\.json")
JOURNAL_SEGMENT_BYTES = 256 << 10
"""A commit rewrites its rank's last journal segment whole (one atomic put: object stores cannot
append); once that segment holds this many bytes of entries, the next commit starts a new one.
One file per rank made a run of n shards write O(n^2) journal bytes (4,000 one-record shards:
2.75 GB, each commit slower than the last); segments keep it O(n)."""
MAX_MANIFEST_BYTES = GiB
"""Cap on manifest.json and each journal (~150 bytes per record: far beyond any real cache)."""
FIX_JOURNAL = "restore the journal, or re-run `wandistill precompute` into a fresh directory"


def dump_json(obj: Any) -> bytes:
    """The bytes of a manifest or journal (the same as `fsutil.atomic_write_json` writes)."""
    return (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode()


@dataclass(frozen=True, slots=True)
class JournalSegment:
    """One journal file: whose it is, its place in that rank's run, and its shard entries."""

    rank: int
    segment: int
    rel: str
    """Its path in the cache (`journal/rank-...json`)."""
    name: str
    """Its path or URL, for messages."""
    shards: Entries[Entry]
    """Every entry already validated (a journal is bounded: `JOURNAL_SEGMENT_BYTES`)."""


def journal_segments(
    st: Storage, backend: str, memo: CommitMemo | None = None
) -> list[JournalSegment]:
    """Every journal segment, checked against the journal schema, by rank then segment. With a
    `memo`, a segment unchanged since the memo last read it is not read again."""
    memo = memo or CommitMemo()
    listed = st.list_stamped(JOURNAL_DIR)
    listed = [(n, s) for n, s in listed if n.startswith("rank-") and n.endswith(".json")]
    memo.keep({f"{JOURNAL_DIR}/{n}" for n, _ in listed} | {MANIFEST_NAME})
    out = [
        memo.load(f"{JOURNAL_DIR}/{n}", stamp, lambda n=n: _read_segment(st, n, backend)).value
        for n, stamp in listed
    ]
    return sorted(out, key=lambda j: (j.rank, j.segment))


def _read_segment(st: Storage, name: str, backend: str) -> JournalSegment:
    rel = f"{JOURNAL_DIR}/{name}"
    where = f"journal {st.name(rel)!r}"
    m = _JOURNAL_NAME.fullmatch(name)
    if m is None:
        raise CacheError(
            f"{where}: not a journal name (rank-<5 digits>[-<6 digits>].json)", fix=FIX_JOURNAL
        )
    cap = MAX_MANIFEST_BYTES
    data = st.read(rel, max_bytes=cap, what="journal", fix=FIX_JOURNAL, error=CacheError)
    bad = f"{where} is corrupt"
    obj = parse_json(data, bad, fix=FIX_JOURNAL, error=CacheError)
    journal = check(JOURNALS[backend], obj, bad, fix=FIX_JOURNAL, error=CacheError)
    journal.shards.where, journal.shards.fix = where, FIX_JOURNAL
    ranks = {int(m.group(1)), journal.rank, *(e.rank for e in journal.shards)}
    if len(ranks) != 1:
        raise CacheError(
            f"{where} is corrupt: its name, its rank and its entries' ranks disagree "
            f"({sorted(ranks)})",
            fix=FIX_JOURNAL,
        )
    segment = int(m.group(2) or 0)
    return JournalSegment(journal.rank, segment, rel, st.name(rel), journal.shards)


def entry_json(entry: dict[str, Any]) -> bytes:
    """One shard entry as compact JSON (a writer keeps its journal entries in this form)."""
    return json.dumps(entry, separators=(",", ":"), ensure_ascii=False).encode()


def write_journal_chunks(st: Storage, rank: int, entries: list[bytes], *, segment: int = 0) -> None:
    """Rank `rank`'s journal segment `segment` (`{"rank": r, "shards": [...]}`) from entries
    already serialized by `entry_json`, streamed, so a writer never re-serializes (or holds as
    objects) every entry it committed. The journal segment is the commit: it appears whole
    (rename, or one completed upload)."""
    st.makedirs(JOURNAL_DIR)
    tail = f"-{segment:06d}" if segment else ""  # segment 0: the name a one-file journal had
    with st.upload(f"{JOURNAL_DIR}/rank-{rank:05d}{tail}.json") as f:
        f.write(b'{"rank": %d, "shards": [\n' % rank)
        for i, chunk in enumerate(entries):
            if i:
                f.write(b",\n")
            f.write(chunk)
        f.write(b"\n]}\n")


def clear_journals(st: Storage) -> None:
    """Remove every journal segment (after `finalize` folded them into the manifest)."""
    for name in st.list(JOURNAL_DIR):
        if name.startswith("rank-") and name.endswith(".json"):
            st.rm(f"{JOURNAL_DIR}/{name}")


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
