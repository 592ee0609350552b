"""`wandistill cache merge A B ... --out M`: one cache from several of the same teacher/settings.

What M holds. One manifest listing every record of the inputs once, in input order (a key held
by several inputs is kept from the first input that holds it, argument order), with the inputs'
header (teacher, settings, numerics, fields, dims, shared tensors) unchanged. Keys, and so the
held-out split (a function of the key and `settings.holdout_fraction`), are those of the inputs.

No copy where the store allows. A shard whose records are all kept is put into M whole: a
webdataset tar into `M/shards/` under a new name (`r00000-<seq>`), a zarr entry's zarr shard
files into M's `data.zarr` at shifted whole-shard coordinates (`zarr/merge.py`). On one local
filesystem that is a hard link (same inode, no byte copied); on one object store a copy the
store makes itself (S3 CopyObject: no byte through this machine); otherwise (across
filesystems or stores: local -> S3, S3 -> local) a copy streamed through this process
(`transfer.py`). M stays a self-contained folder or prefix that stock webdataset/zarr,
`cache verify` and `train` read like any other (a relative path or a URL out of M would break
those, and would break when an input is deleted). A shard that holds a key an earlier input
already brought, and a zarr entry whose layout differs from M's, are re-written record by record
through the backend's own writer, bytes as stored (no decode, no re-encode).

Safety. Every input is checked before anything is written: each must be a complete cache
(`complete` in its manifest, no journal left), and all must agree on every sealed block but
`created`/`wandistill_version`; a difference names the key and both caches. M is claimed like
any output (`wandistill.io.outputs.claim`): never a folder wandistill did not write, never inside
an input; on an object store one writer through the lease lock object precompute uses. Every
input shard is verified (`cache verify`'s checks, read through this process: an object store
gives no sha256 of an object to compare) before anything is linked or copied, and a file changed
between its check and its copy is refused. M's manifest is written last (one whole-object PUT on
an object store: the commit point), so an interrupted merge leaves no cache, and re-running it
redoes the same plan to the same bytes. An M that already is a cache is refused unless it is
exactly this merge's result (then nothing is done).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wandistill.cache import manifest as mf
from wandistill.cache.contract import SHARED_NAME, ZARR_DATA_NAME, ZARR_LOCK_NAME
from wandistill.cache.encoding import compression_of
from wandistill.cache.entries import Entries
from wandistill.cache.files import SEALED, Entry, Manifest
from wandistill.cache.journal import journal_segments
from wandistill.cache.reader import CacheReader
from wandistill.cache.seal import ENTRY_DIGEST, digest_problem, seal_entry
from wandistill.cache.transfer import COPIED, LINKED, SERVER, Transfer
from wandistill.cache.writer import SHARD_DIR, shard_name
from wandistill.errors import CacheError, CacheMismatchError, UsageError
from wandistill.io.fsutil import fsync_dir
from wandistill.io.storage import LocalStorage, Storage, is_url, open_storage

MERGE_RANK = 0
"""M's shards are named as rank 0's (`r00000-<seq>`): a later precompute into M resumes after
them like after its own."""
_INFORMATIONAL = ("created", "wandistill_version")
"""Sealed blocks allowed to differ between inputs (M takes the first input's)."""


@dataclass(frozen=True, slots=True)
class MergeConfig:
    inputs: tuple[str | Path, ...]
    """Local folders or object-store URLs (`s3://bucket/prefix`)."""
    out: str | Path
    skip_corrupt: bool = False
    """Drop (and count) an input shard that fails verification instead of refusing the merge."""


@dataclass(slots=True)
class MergeSummary:
    out: str | Path
    records: int = 0
    shards: int = 0
    linked: int = 0
    server_copied: int = 0
    """Shards the object store copied itself (no byte through this process)."""
    copied: int = 0
    """Shards copied through this process (across filesystems or stores)."""
    client_bytes: int = 0
    """Bytes of whole shards copied through this process (verification reads not counted)."""
    rewritten: int = 0
    duplicates: int = 0
    """Records dropped because an earlier input holds their key."""
    unchanged: bool = False
    """M already was this merge's result."""
    per_input: list[int] = field(default_factory=list)
    """Records kept from each input."""
    corrupt: list[str] = field(default_factory=list)
    """--skip-corrupt: one line per input shard dropped because it failed verification."""
    corrupt_records: int = 0


@dataclass(frozen=True, slots=True)
class _Step:
    """One shard of M: from input `source`, entry `entry`, rows `rows` of it (None: all)."""

    source: int
    entry: Entry
    rows: tuple[int, ...] | None
    raw: dict[str, Any]
    """The entry's JSON as read (a shard copied whole keeps it, under its new name)."""


def _open_input(path: str | Path) -> CacheReader:
    """The input cache at `path`, opened once: its checks and its reader share the storage."""
    st = open_storage(path)
    manifest = mf.read_manifest(st)  # not a cache / corrupt: one clear error
    pending = sum(len(j.shards) for j in journal_segments(st, manifest.backend))
    if not manifest.complete or pending:
        st.close()
        why = f"{pending} shard(s) still in its journal" if pending else "not complete"
        raise CacheError(
            f"cache {st.url!r} is incomplete ({why}); merge takes finished caches only",
            fix="re-run its `wandistill precompute` to the end (it resumes), then merge",
        )
    return CacheReader(st)


def _differences(a: Manifest, b: Manifest) -> list[str]:
    """Dotted keys of every sealed block in which two manifests differ."""
    ja, jb = mf.manifest_json(a), mf.manifest_json(b)
    out: list[str] = []
    for block in SEALED:
        if block in _INFORMATIONAL or ja.get(block) == jb.get(block):
            continue
        x, y = ja.get(block), jb.get(block)
        if isinstance(x, dict) and isinstance(y, dict):
            out += [f"{block}.{d.split(':', 1)[0]}" for d in mf.mismatches(x, y)]
        else:
            out.append(block)
    return out


def _check_same(stores: list[CacheReader]) -> None:
    first = stores[0]
    for other in stores[1:]:
        diffs = _differences(first.manifest, other.manifest)
        if diffs:
            head = ", ".join(diffs[:4]) + (f" and {len(diffs) - 4} more" if len(diffs) > 4 else "")
            raise CacheMismatchError(
                f"caches {str(first.path)!r} and {str(other.path)!r} differ in {head}; only "
                "caches of the same teacher, settings, numerics and storage merge",
                fix="merge caches precomputed with the same recipe and teacher "
                "(`wandistill cache info --json` shows each header)",
            )


def _files(store: CacheReader, entry: Entry) -> list[str]:
    """The files of a shard entry that merge may link or copy, relative to the cache."""
    if store.manifest.backend == "webdataset":
        try:
            return [store.source.rel(entry)]  # type: ignore[attr-defined]
        except CacheError:
            return []  # verify names it
    return [f"{ZARR_DATA_NAME}/{rel}" for rel in getattr(entry, "sha256", {})]


def _verify(store: CacheReader, entry: dict[str, Any]) -> list[str]:
    """`cache verify`'s checks of one shard. A webdataset shard on an object store is first
    streamed once into a local temp file (TMPDIR) and checked there: checked in place, its
    frame digest, member walk and per-record reads would fetch every byte about three times
    (docs/benchmarks.md, "cache merge on S3")."""
    if not store.storage.remote or store.manifest.backend != "webdataset":
        return store.source.verify(entry)
    from wandistill.cache.wds.reader import WebDatasetSource

    try:
        rel = store.source.rel(entry)  # type: ignore[attr-defined]
    except CacheError as e:
        return [e.message]
    if store.storage.size(rel) is None:
        return store.source.verify(entry)  # names the missing file
    with tempfile.TemporaryDirectory(prefix="wandistill-merge-") as tmp:
        local = LocalStorage(Path(tmp))
        Transfer(local).put(store.storage, rel, rel)
        source = WebDatasetSource(local)
        try:
            return source.verify(entry)
        finally:
            source.close()
            local.close()


Stamps = dict[tuple[int, str], Any]
"""(input index, file) -> its `Storage.stamp` when it was verified."""


def corrupt_shards(
    stores: list[CacheReader], stamps: Stamps | None = None
) -> dict[tuple[int, str], str]:
    """(input index, shard name) -> the first problem, for every input shard that fails its
    checks (`cache verify`'s: the entry's seal, the shard's checksums, every record's crc32c).
    Merge runs it before it links or copies anything: a hard link or a server-side copy would
    pass a flipped byte into M with a fresh seal, and only a later verify of M would find it.
    On an object store the checks read every byte through this process (no store gives the
    sha256 of an object). `stamps` gets each file's stamp, taken before its check."""
    bad: dict[tuple[int, str], str] = {}
    for n, store in enumerate(stores):
        for i, entry in enumerate(store.entries):
            if stamps is not None:
                for rel in _files(store, entry):
                    stamps[(n, rel)] = store.storage.stamp(rel)
            problems = [p for p in (digest_problem(store.entries.json(i)),) if p]
            problems += problems or _verify(store, entry)
            if problems:
                bad[(n, entry.name)] = problems[0]
    return bad


def plan(
    stores: list[CacheReader], skip: frozenset[tuple[int, str]] = frozenset()
) -> tuple[list[_Step], int]:
    """M's shards in order, and how many duplicate records were dropped (`skip`: input shards
    left out whole)."""
    seen: set[str] = set()
    steps: list[_Step] = []
    dropped = 0
    for n, store in enumerate(stores):
        for j, entry in enumerate(store.entries):
            if (n, entry.name) in skip:
                continue
            keep = []
            for i, key in enumerate(entry.keys):
                if key in seen:
                    dropped += 1
                else:
                    seen.add(key)
                    keep.append(i)
            if not keep:
                continue
            whole = len(keep) == entry.records
            steps.append(_Step(n, entry, None if whole else tuple(keep), store.entries.json(j)))
    return steps, dropped


class _Merger:
    def __init__(self, stores: list[CacheReader], out: Storage, stamps: Stamps) -> None:
        self.stores = stores
        self.out = out
        self.stamps = stamps
        self.transfer = Transfer(out)
        self.backend = stores[0].manifest.backend
        self.summary = MergeSummary(out=out.url, per_input=[0] * len(stores))
        self._linker: Any = None

    def put(self, storage: Storage, rel: str, dst: str) -> tuple[str, int]:
        """An input's file `rel` as M's `dst` (transfer.py), refused if changed since its
        check."""
        source = next(n for n, s in enumerate(self.stores) if s.storage is storage)
        return self.transfer.put(storage, rel, dst, stamp=self.stamps.get((source, rel)))

    def _count(self, ways: set[str]) -> None:
        """One shard put whole into M, counted by the slowest way one of its files took."""
        self.summary.copied += COPIED in ways
        self.summary.server_copied += SERVER in ways and COPIED not in ways
        self.summary.linked += ways == {LINKED}

    def _sink(self) -> Any:
        if self.backend == "webdataset":
            from wandistill.cache.wds.writer import WebDatasetSink

            return WebDatasetSink(self.out)
        from wandistill.cache.zarr.layout import BLOCK_RECORDS, GROUP_ATTR
        from wandistill.cache.zarr.writer import ZarrSink

        first = self.stores[0]
        layout = first.source.open_group().attrs.get(GROUP_ATTR, {})  # type: ignore[attr-defined]
        block = int(layout.get("block_records", BLOCK_RECORDS))
        fields = first.manifest.fields
        return ZarrSink(self.out, block_records=block, compression=compression_of(fields))

    def _link_zarr(self, store: CacheReader, src: Entry) -> Any:
        """(M's entry, how its files got there) for a whole zarr entry put into M; None to
        re-write."""
        if self.backend != "zarr":
            return None
        if self._linker is None:
            from wandistill.cache.zarr.merge import ZarrLinker

            self._linker = ZarrLinker(self.out, self.put)
        return self._linker.add(store.source, src)  # type: ignore[arg-type]  # zarr: a ZarrSource

    def shard(self, seq: int, step: _Step) -> dict[str, Any]:
        """Write M's shard `seq` from `step`; its committed (sealed) entry."""
        name = shard_name(MERGE_RANK, seq)
        store = self.stores[step.source]
        src, keys = step.entry, _keys(step)
        linked_entry = self._link_zarr(store, src) if step.rows is None else None
        if linked_entry is not None:
            entry, ways = linked_entry
            self._count(ways)
        elif step.rows is None and self.backend == "webdataset":
            dst = f"{SHARD_DIR}/{name}.tar"
            how, _ = self.put(store.storage, store.source.rel(src), dst)  # type: ignore[attr-defined]
            self._count({how})
            entry = {k: v for k, v in step.raw.items() if k != ENTRY_DIGEST}
            entry.update(file=dst)
        else:
            rows = step.rows if step.rows is not None else range(src.records)
            sink = self._sink()
            sink.begin(name)
            try:
                for i in rows:
                    sink.add(store.source.read_record(src, i))  # as stored
                entry = sink.end()
            except BaseException:
                sink.abort()
                raise
            self.summary.rewritten += 1
        entry.update(name=name, rank=MERGE_RANK, records=len(keys), keys=keys)
        self.summary.per_input[step.source] += len(keys)
        return seal_entry(entry)


def _existing(out: Storage, header: Manifest, steps: list[_Step]) -> bool:
    """True if M already is this merge's result; refuse any other cache at M."""
    if not mf.has_manifest(out):
        return False
    have = mf.read_manifest(out)
    if [e.keys for e in have.shards] == [_keys(s) for s in steps] and not _differences(
        have, header
    ):
        return True
    raise UsageError(
        f"--out {out.url!r} already is a cache ({have.num_records} records) that is not this "
        "merge's result; merge never adds to or replaces a cache",
        fix="choose a new --out " + ("prefix" if out.remote else "directory"),
    )


def _location(path: str | Path) -> str | Path:
    """A URL stays text (a Path would fold its `//`); anything else is a local Path."""
    return str(path).rstrip("/") if is_url(path) else Path(path)


def _identity(path: str | Path) -> str:
    return str(path) if is_url(path) else str(Path(path).resolve())


def _refuse_corrupt(cfg: MergeConfig, bad: dict[tuple[int, str], str]) -> None:
    if not bad or cfg.skip_corrupt:
        return
    (n, name), problem = next(iter(bad.items()))
    more = f" (and {len(bad) - 1} more corrupt shard(s))" if len(bad) > 1 else ""
    raise CacheError(
        f"input cache {str(cfg.inputs[n])!r}: shard {name} fails verification, "
        f"nothing merged: {problem}{more}",
        fix="repair that input (re-run its precompute after `cache verify` names the "
        "damage), or pass --skip-corrupt to merge without the corrupt shard(s)",
    )


def merge(cfg: MergeConfig) -> MergeSummary:
    """Check every input, claim M, then link or copy or rewrite each shard and write M's
    manifest."""
    from wandistill.io import outputs

    if len(cfg.inputs) < 2:
        raise UsageError("cache merge needs at least two input caches", fix="pass A B ... --out M")
    cfg = MergeConfig(
        inputs=tuple(_location(p) for p in cfg.inputs),
        out=_location(cfg.out),
        skip_corrupt=cfg.skip_corrupt,
    )
    if len({_identity(p) for p in cfg.inputs}) != len(cfg.inputs):
        raise UsageError("an input cache is given twice", fix="pass each cache once")
    stores: list[CacheReader] = []
    try:
        for path in cfg.inputs:
            stores.append(_open_input(path))
        _check_same(stores)
        stamps: Stamps = {}
        bad = corrupt_shards(stores, stamps)
        _refuse_corrupt(cfg, bad)
        steps, dropped = plan(stores, frozenset(bad))
        inputs = {f"input cache {i + 1}": p for i, p in enumerate(cfg.inputs)}
        with outputs.claim(cfg.out, "cache", inputs=inputs) as folder:
            out = open_storage(folder.path)
            merger = _Merger(stores, out, stamps)
            first = stores[0].manifest  # M's header: the first input's, complete, no shards yet
            header = first.model_copy(
                update={"complete": True, "shards": Entries(first.shards.model, [])}
            )
            merger.summary.duplicates = dropped
            merger.summary.corrupt = [
                f"input cache {str(cfg.inputs[n])!r} shard {name}: {problem}"
                for (n, name), problem in bad.items()
            ]
            merger.summary.corrupt_records = sum(
                e.records
                for n, store in enumerate(stores)
                for e in store.entries
                if (n, e.name) in bad
            )
            merger.summary.records = sum(len(_keys(s)) for s in steps)
            merger.summary.shards = len(steps)
            merger.summary.unchanged = _existing(out, header, steps)
            if not merger.summary.unchanged:
                _clear_unfinished(out)
                out.makedirs(SHARD_DIR)
                if stores[0].manifest.shared:
                    merger.put(stores[0].storage, SHARED_NAME, SHARED_NAME)
                made = [merger.shard(seq, step) for seq, step in enumerate(steps)]
                header.shards = Entries(header.shards.model, made)
                if isinstance(out, LocalStorage):
                    fsync_dir(out.path(SHARD_DIR))
                mf.write_manifest(out, header)
            merger.summary.client_bytes = merger.transfer.client_bytes
            return merger.summary
    finally:
        for store in stores:
            store.close()


def _keys(step: _Step) -> list[str]:
    keys = step.entry.keys
    return list(keys) if step.rows is None else [keys[i] for i in step.rows]


def _clear_unfinished(out: Storage) -> None:
    """Drop what an interrupted merge left in M (no manifest: nothing in it is committed), so a
    re-run writes the same bytes as an uninterrupted one. M is claimed: only we wrote there."""
    if isinstance(out, LocalStorage):
        for name in (SHARD_DIR, ZARR_DATA_NAME):
            if out.path(name).is_dir():
                shutil.rmtree(out.path(name))
    else:
        for name in (SHARD_DIR, ZARR_DATA_NAME):
            for rel in out.find(name):  # type: ignore[attr-defined]
                out.rm(rel)
    for name in (SHARED_NAME, ZARR_LOCK_NAME):
        out.rm(name)
