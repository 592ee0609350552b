"""`wandistill cache merge A B ... --out M`: one cache from several of the same teacher/settings.

What M holds. One manifest listing every record of the inputs once, in input order (a key held
by several inputs is kept from the first input that holds it, argument order), with the inputs'
header (teacher, settings, numerics, fields, dims, shared tensors) unchanged. Keys, and so the
held-out split (a function of the key and `settings.holdout_fraction`), are those of the inputs.

No copy where the disk allows. A shard whose records are all kept is hard-linked into M: a
webdataset tar into `M/shards/` under a new name (`r00000-<seq>`), a zarr entry's zarr shard
files into M's `data.zarr` at shifted whole-shard coordinates (`zarr_merge.py`). Same inodes, no
bytes copied, and M stays a self-contained folder that stock webdataset/zarr, `cache verify` and
`train` read like any other (a relative path out of M would break those, and a symlink would
follow its target's fate). Across filesystems, where a hard link cannot be made, files are
copied. A shard that holds a key an earlier input already brought, and a zarr entry whose layout
differs from M's, are re-written record by record through the backend's own writer, bytes as
stored (no decode, no re-encode).

Safety. Every input is checked before anything is written: each must be a complete cache
(`complete` in its manifest, no journal left), and all must agree on every sealed block but
`created`/`wandistill_version`; a difference names the key and both caches. M is claimed like
any output (`wandistill.io.outputs.claim`): never a folder wandistill did not write, never inside
an input. M's manifest is written last, so an interrupted merge leaves no cache, and re-running
it redoes the same plan to the same bytes. An M that already is a cache is refused unless it is
exactly this merge's result (then nothing is done).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wandistill.cache import manifest as mf
from wandistill.cache.contract import SHARED_NAME, ZARR_DATA_NAME
from wandistill.cache.encoding import compression_of
from wandistill.cache.files import SEALED
from wandistill.cache.reader import CacheReader
from wandistill.cache.writer import SHARD_DIR, shard_name
from wandistill.errors import CacheError, CacheMismatchError, UsageError
from wandistill.io.fsutil import fsync_dir, temp_name, writing

ZARR_LOCK = "data.zarr.lock"
"""zarr_backend.LOCK_NAME (not imported: merging webdataset caches needs no zarr)."""
MERGE_RANK = 0
"""M's shards are named as rank 0's (`r00000-<seq>`): a later precompute into M resumes after
them like after its own."""
_INFORMATIONAL = ("created", "wandistill_version")
"""Sealed blocks allowed to differ between inputs (M takes the first input's)."""


@dataclass(frozen=True, slots=True)
class MergeConfig:
    inputs: tuple[Path, ...]
    out: Path
    skip_corrupt: bool = False
    """Drop (and count) an input shard that fails verification instead of refusing the merge."""


@dataclass(slots=True)
class MergeSummary:
    out: Path
    records: int = 0
    shards: int = 0
    linked: int = 0
    copied: int = 0
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
    entry: dict[str, Any]
    rows: tuple[int, ...] | None


def _open_input(path: Path) -> CacheReader:
    manifest = mf.read_manifest(path)  # not a cache / corrupt: one clear error
    pending = mf.read_journals(path, manifest.backend)
    if not manifest.complete or pending:
        why = f"{len(pending)} shard(s) still in its journal" if pending else "not complete"
        raise CacheError(
            f"cache {str(path)!r} is incomplete ({why}); merge takes finished caches only",
            fix="re-run its `wandistill precompute` to the end (it resumes), then merge",
        )
    return CacheReader(path)


def _differences(a: mf.Manifest, b: mf.Manifest) -> list[str]:
    """Dotted keys of every sealed block in which two manifests differ."""
    ja, jb = a.to_json(), b.to_json()
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


def corrupt_shards(stores: list[CacheReader]) -> dict[tuple[int, str], str]:
    """(input index, shard name) -> the first problem, for every input shard that fails its
    checks (`cache verify`'s: the entry's seal, the shard's checksums, every record's crc32c).
    Merge runs it before it links or copies anything: a hard link would pass a flipped byte
    into M with a fresh seal, and only a later verify of M would find it."""
    bad: dict[tuple[int, str], str] = {}
    for n, store in enumerate(stores):
        for entry in store.entries:
            problems = [p for p in (mf.digest_problem(entry),) if p]
            problems += problems or store.source.verify(entry)
            if problems:
                bad[(n, entry["name"])] = problems[0]
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
        for entry in store.entries:
            if (n, entry["name"]) in skip:
                continue
            keep = []
            for i, key in enumerate(entry["keys"]):
                if key in seen:
                    dropped += 1
                else:
                    seen.add(key)
                    keep.append(i)
            if not keep:
                continue
            whole = len(keep) == int(entry["records"])
            steps.append(_Step(n, entry, None if whole else tuple(keep)))
    return steps, dropped


def _link_or_copy(src: Path, dst: Path) -> bool:
    """Hard-link `src` to `dst` atomically (via a temp name); copy across filesystems. True if
    linked."""
    tmp = temp_name(dst)
    try:
        os.link(src, tmp)
        linked = True
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        with writing(dst, partial=tmp):  # a full disk names M's file, not the input shard
            shutil.copyfile(src, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        linked = False
    os.replace(tmp, dst)
    return linked


class _Merger:
    def __init__(self, stores: list[CacheReader], out: Path) -> None:
        self.stores = stores
        self.out = out
        self.backend = stores[0].manifest.backend
        self.summary = MergeSummary(out=out, per_input=[0] * len(stores))
        self._linker: Any = None

    def _sink(self) -> Any:
        if self.backend == "webdataset":
            from wandistill.cache.wds_backend import WebDatasetSink
            from wandistill.io.storage import open_storage

            return WebDatasetSink(open_storage(self.out))
        from wandistill.cache.zarr_backend import BLOCK_RECORDS, ZarrSink

        first = self.stores[0]
        meta = Path(first.path) / ZARR_DATA_NAME / "zarr.json"
        attrs = json.loads(meta.read_text())["attributes"]
        block = int(attrs.get("wandistill", {}).get("block_records", BLOCK_RECORDS))
        fields = first.manifest.fields
        return ZarrSink(self.out, block_records=block, compression=compression_of(fields))

    def _link_zarr(self, store: CacheReader, src: dict[str, Any]) -> Any:
        """(M's entry, hard-linked) for a whole zarr entry linked into M; None to re-write."""
        if self.backend != "zarr":
            return None
        if self._linker is None:
            from wandistill.cache.zarr_merge import ZarrLinker

            self._linker = ZarrLinker(self.out, _link_or_copy)
        return self._linker.add(Path(store.path), src)

    def shard(self, seq: int, step: _Step) -> dict[str, Any]:
        """Write M's shard `seq` from `step`; its committed (sealed) entry."""
        name = shard_name(MERGE_RANK, seq)
        store = self.stores[step.source]
        src = step.entry
        linked_entry = self._link_zarr(store, src) if step.rows is None else None
        if linked_entry is not None:
            entry, linked = linked_entry
            self.summary.linked += linked
            self.summary.copied += not linked
            keys = list(src["keys"])
            entry.update(name=name, rank=MERGE_RANK, records=len(keys), keys=keys)
        elif step.rows is None and self.backend == "webdataset":
            dst = self.out / SHARD_DIR / f"{name}.tar"
            linked = _link_or_copy(Path(store.source.path(src)), dst)
            self.summary.linked += linked
            self.summary.copied += not linked
            entry = {k: v for k, v in src.items() if k != mf.ENTRY_DIGEST}
            entry.update(name=name, rank=MERGE_RANK, file=f"{SHARD_DIR}/{dst.name}")
            keys = list(src["keys"])
        else:
            rows = step.rows if step.rows is not None else range(int(src["records"]))
            sink = self._sink()
            sink.begin(name)
            try:
                for i in rows:
                    sink.add(store.source.read_record(src, i))  # as stored
                entry = sink.end()
            except BaseException:
                sink.abort()
                raise
            keys = [src["keys"][i] for i in rows]
            entry.update(name=name, rank=MERGE_RANK, records=len(keys), keys=keys)
            self.summary.rewritten += 1
        self.summary.per_input[step.source] += len(keys)
        return mf.seal_entry(entry)

    def header(self) -> mf.Manifest:
        first = self.stores[0].manifest
        return mf.Manifest(
            backend=first.backend,
            teacher=first.teacher,
            settings=first.settings,
            fields=first.fields,
            dims=first.dims,
            shared=first.shared,
            numerics=first.numerics,
            schema_version=first.schema_version,
            created=first.created,
            complete=True,
        )


def _existing(out: Path, header: mf.Manifest, steps: list[_Step]) -> bool:
    """True if M already is this merge's result; refuse any other cache at M."""
    if not mf.manifest_path(out).is_file():
        return False
    have = mf.read_manifest(out)
    if [e["keys"] for e in have.shards] == [_keys(s) for s in steps] and not _differences(
        have, header
    ):
        return True
    raise UsageError(
        f"--out {str(out)!r} already is a cache ({have.num_records} records) that is not this "
        "merge's result; merge never adds to or replaces a cache",
        fix="choose a new --out directory",
    )


def merge(cfg: MergeConfig) -> MergeSummary:
    """Check every input, claim M, then link or rewrite each shard and write M's manifest."""
    from wandistill.io import outputs

    if len(cfg.inputs) < 2:
        raise UsageError("cache merge needs at least two input caches", fix="pass A B ... --out M")
    from wandistill.io.storage import is_url

    remote = [str(p) for p in (*cfg.inputs, cfg.out) if is_url(p)]
    if remote:
        raise UsageError(
            f"cache merge links shard files on one filesystem; {remote[0]!r} is an object store",
            fix="merge local (or network-mounted) caches; on S3 merge a local copy and upload M",
        )
    cfg = dataclasses.replace(cfg, inputs=tuple(Path(p) for p in cfg.inputs), out=Path(cfg.out))
    named = {str(p.resolve()): p for p in cfg.inputs}
    if len(named) != len(cfg.inputs):
        raise UsageError("an input cache is given twice", fix="pass each cache once")
    stores: list[CacheReader] = []
    try:
        for path in cfg.inputs:
            stores.append(_open_input(path))
        _check_same(stores)
        bad = corrupt_shards(stores)
        if bad and not cfg.skip_corrupt:
            (n, name), problem = next(iter(bad.items()))
            more = f" (and {len(bad) - 1} more corrupt shard(s))" if len(bad) > 1 else ""
            raise CacheError(
                f"input cache {str(cfg.inputs[n])!r}: shard {name} fails verification, "
                f"nothing merged: {problem}{more}",
                fix="repair that input (re-run its precompute after `cache verify` names the "
                "damage), or pass --skip-corrupt to merge without the corrupt shard(s)",
            )
        steps, dropped = plan(stores, frozenset(bad))
        inputs = {f"input cache {i + 1}": p for i, p in enumerate(cfg.inputs)}
        with outputs.claim(cfg.out, "cache", inputs=inputs) as folder:
            merger = _Merger(stores, folder.path)
            header = merger.header()
            merger.summary.duplicates = dropped
            merger.summary.corrupt = [
                f"input cache {str(cfg.inputs[n])!r} shard {name}: {problem}"
                for (n, name), problem in bad.items()
            ]
            merger.summary.corrupt_records = sum(
                int(e["records"])
                for n, store in enumerate(stores)
                for e in store.entries
                if (n, e["name"]) in bad
            )
            if _existing(folder.path, header, steps):
                merger.summary.unchanged = True
                merger.summary.records = sum(len(_keys(s)) for s in steps)
                merger.summary.shards = len(steps)
                return merger.summary
            _clear_unfinished(folder.path)
            (folder.path / SHARD_DIR).mkdir()
            if stores[0].manifest.shared:
                _link_or_copy(Path(stores[0].path) / SHARED_NAME, folder.path / SHARED_NAME)
            header.shards = [merger.shard(seq, step) for seq, step in enumerate(steps)]
            fsync_dir(folder.path / SHARD_DIR)
            mf.write_manifest(folder.path, header)
            merger.summary.records = header.num_records
            merger.summary.shards = len(header.shards)
            return merger.summary
    finally:
        for store in stores:
            store.close()


def _keys(step: _Step) -> list[str]:
    keys = step.entry["keys"]
    return list(keys) if step.rows is None else [keys[i] for i in step.rows]


def _clear_unfinished(out: Path) -> None:
    """Drop what an interrupted merge left in M (no manifest: nothing in it is committed), so a
    re-run writes the same bytes as an uninterrupted one. M is claimed: only we wrote there."""
    for name in (SHARD_DIR, ZARR_DATA_NAME):
        if (out / name).is_dir():
            shutil.rmtree(out / name)
    for name in (SHARED_NAME, ZARR_LOCK):
        (out / name).unlink(missing_ok=True)
