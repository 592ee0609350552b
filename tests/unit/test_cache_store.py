"""Cache contract through the webdataset backend (the zarr backend has its own module too)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from wandistill.cache import CacheWriter, open_cache
from wandistill.cache import journal as jn
from wandistill.cache import manifest as mf
from wandistill.cache.contract import field_specs
from wandistill.cache.manifest import read_manifest
from wandistill.cache.seal import seal_entry
from wandistill.errors import CacheError, CacheMismatchError, UsageError
from wandistill.io import fsutil
from wandistill.io.storage import open_storage

from cachefixtures import SETTINGS, make_record, write_cache

BACKENDS = ["webdataset", "zarr"]


def _assert_same(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    assert a.dtype == b.dtype, name
    assert a.shape == b.shape, name
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.numel() else True, name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("latent_dtype", "embed_dtype"),
    [
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32),
    ],
)
def test_every_field_round_trips_bit_exact(
    tmp_path: Path, backend: str, latent_dtype: torch.dtype, embed_dtype: torch.dtype
) -> None:
    kw = dict(
        latent_dtype=latent_dtype, embed_dtype=embed_dtype, features=("blocks.1",), negative=True
    )
    write_cache(tmp_path, range(7), backend=backend, shard_records=3, **kw)
    with open_cache(tmp_path) as store:
        assert len(store) == 7
        got = {r.key: r for r in store.records()}
        for i in range(7):
            want = make_record(i, **kw)
            rec = got[want.key]
            assert (rec.prompt, rec.seed) == (want.prompt, want.seed)
            for name, t in want.tensors().items():
                _assert_same(rec.tensors()[name], t, name)
        # A training sample reads one step only, bit-exact too.
        entry = store.entries[1]
        want = make_record(4, **kw)  # written in order: record 4 is row 1 of shard 1
        sample = store.read_sample(
            entry, 1, 2, ["xt", "teacher_out", "timesteps", "feature.blocks.1"]
        )
        _assert_same(sample["xt"], want.xt[2], "xt")
        _assert_same(sample["teacher_out"], want.teacher_out[2], "teacher_out")
        _assert_same(sample["feature.blocks.1"], want.features["blocks.1"][2], "feature")
        assert float(sample["timesteps"]) == float(want.timesteps[2])
        shared = store.read_shared()
        assert set(shared) == {"negative_prompt_embeds", "sigmas"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_reopening_a_cache_skips_records_it_already_holds(tmp_path: Path, backend: str) -> None:
    write_cache(
        tmp_path, range(5), backend=backend, shard_records=2, finalize=False, complete=False
    )
    w = write_cache(tmp_path, range(9), backend=backend, shard_records=2)
    assert (w.records_written, w.records_skipped) == (4, 5)
    m = read_manifest(tmp_path)
    keys = [k for s in m.shards for k in s.keys]
    assert len(keys) == len(set(keys)) == 9
    assert m.complete
    with open_cache(tmp_path) as store:
        assert store.verify() == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_long_run_commits_into_bounded_journal_segments_and_resumes_in_the_last(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = 1200  # a few one-record entries per segment
    monkeypatch.setattr(jn, "JOURNAL_SEGMENT_BYTES", limit)
    write_cache(
        tmp_path, range(9), backend=backend, shard_records=1, finalize=False, complete=False
    )
    segments = mf.journal_segments(open_storage(tmp_path), backend)
    assert len(segments) >= 3
    assert [s.segment for s in segments] == list(range(len(segments)))
    for s in segments:  # what one commit rewrites stays bounded
        assert (
            len(s.shards) == 1 or sum(len(jn.entry_json(e)) for e in s.shards.json_list()) <= limit
        )
    names = [e.name for s in segments for e in s.shards]
    assert names == [f"r00000-{i:06d}" for i in range(9)]
    sealed = {p.name: p.read_bytes() for p in (tmp_path / "journal").iterdir()}
    sealed.pop(segments[-1].rel.removeprefix("journal/"))

    w = write_cache(
        tmp_path, range(14), backend=backend, shard_records=1, finalize=False, complete=False
    )
    assert (w.records_written, w.records_skipped) == (5, 9)
    for name, data in sealed.items():  # a resumed writer only touches its last segment
        assert (tmp_path / "journal" / name).read_bytes() == data
    m = mf.finalize(open_storage(tmp_path), complete=True)
    assert [e.name for e in m.shards] == [f"r00000-{i:06d}" for i in range(14)]
    assert list((tmp_path / "journal").iterdir()) == []
    with open_cache(tmp_path) as store:
        assert sorted(r.seed for r in store.records()) == list(range(14))
        assert store.verify() == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cache_of_other_settings_or_teacher_is_refused_naming_the_fields(
    tmp_path: Path, backend: str
) -> None:
    write_cache(tmp_path, range(2), backend=backend)
    other = dict(SETTINGS, num_inference_steps=8)
    with pytest.raises(CacheMismatchError, match=r"settings\.num_inference_steps: cache has 4"):
        write_cache(tmp_path, range(2), backend=backend, settings=other)
    with pytest.raises(CacheMismatchError, match="teacher.fingerprint"):
        CacheWriter(
            tmp_path,
            backend=backend,
            teacher={"fingerprint": "0" * 64, "components": {}},
            settings=SETTINGS,
            fields=field_specs(latent_dtype=torch.float32, embed_dtype=torch.bfloat16, features=[]),
        )


def test_a_killed_writer_leaves_no_visible_partial_shard(tmp_path: Path) -> None:
    w = CacheWriter(
        tmp_path,
        backend="webdataset",
        teacher={"fingerprint": "f" * 64},
        settings=SETTINGS,
        fields=field_specs(latent_dtype=torch.float32, embed_dtype=torch.bfloat16, features=[]),
        shard_records=4,
    )
    for i in range(6):
        w.write(make_record(i))
    # Simulate kill -9: the open shard is a temp file, never renamed and never committed.
    temps = list((tmp_path / "shards").glob(".*.tmp"))
    assert len(temps) == 1
    with open_cache(tmp_path) as store:
        assert len(store) == 4 and store.verify() == []
    w2 = write_cache(tmp_path, range(8), shard_records=4)
    assert w2.records_written == 4
    with open_cache(tmp_path) as store:
        assert sorted(r.seed for r in store.records()) == list(range(8))


def _corrupt(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_each_safetensors_member_is_what_the_library_writes_streamed_in_any_read_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load, save

    import wandistill.cache.wds.writer as wds

    write_cache(tmp_path / "a", range(3), shard_records=3)
    init = wds._DirectTarWriter.__init__

    def small_reads(self: wds._DirectTarWriter, fileobj: object, **kw: object) -> None:
        init(self, fileobj, **kw)
        self.tarstream.copybufsize = 777  # tarfile reads each member in 777-byte pieces

    monkeypatch.setattr(wds._DirectTarWriter, "__init__", small_reads)
    write_cache(tmp_path / "b", range(3), shard_records=3)
    a, b = read_manifest(tmp_path / "a").shards[0], read_manifest(tmp_path / "b").shards[0]
    assert a == b
    tar = (tmp_path / "a" / a.file).read_bytes()
    assert tar == (tmp_path / "b" / b.file).read_bytes()
    for st_off, length, _, _ in a.offsets:
        blob = tar[st_off : st_off + length]
        head = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])
        assert blob == save(load(blob), metadata=head["__metadata__"])  # byte for byte


def test_verify_reports_a_changed_byte_outside_every_record_by_the_frame_digest(
    tmp_path: Path,
) -> None:
    write_cache(tmp_path, range(3), shard_records=3)
    entry = read_manifest(tmp_path).shards[0]
    _, _, json_off, json_len = entry.offsets[0]
    assert json_len % 512, "the .json member must end inside a block, before its padding"
    _corrupt(tmp_path / entry.file, json_off + json_len)  # the member's zero padding
    with open_cache(tmp_path) as store:
        problems = store.verify()
        assert store.read_key(entry.keys[0]).key == entry.keys[0]  # records still read
    assert problems == [f"shard {entry.name}: sha256 mismatch in its frame (tar headers or "
                        "padding, .json members or safetensors headers changed after it was "
                        "written, or the manifest's frame_sha256 was edited)"]  # fmt: skip


def test_verify_names_the_shard_of_a_truncated_file(tmp_path: Path) -> None:
    write_cache(tmp_path, range(6), shard_records=3)
    m = read_manifest(tmp_path)
    victim = tmp_path / m.shards[1].file
    os.truncate(victim, victim.stat().st_size // 2)
    with open_cache(tmp_path) as store:
        problems = store.verify()
    assert any(m.shards[1].name in p and "bytes on disk" in p for p in problems)
    assert any(m.shards[1].keys[-1] in p for p in problems)


def test_verify_names_shard_and_record_of_a_flipped_byte(tmp_path: Path) -> None:
    write_cache(tmp_path, range(6), shard_records=3)
    m = read_manifest(tmp_path)
    entry = m.shards[0]
    off, length = entry.offsets[2][:2]
    _corrupt(tmp_path / entry.file, off + 8)  # inside record 2's safetensors header
    with open_cache(tmp_path) as store:
        problems = store.verify()
    assert any("sha256 mismatch" in p and entry.name in p for p in problems)
    assert any(entry.keys[2] in p for p in problems)


def test_manifest_lists_offsets_that_match_the_tar_members(tmp_path: Path) -> None:
    import tarfile

    write_cache(tmp_path, range(5), shard_records=5)
    entry = read_manifest(tmp_path).shards[0]
    with tarfile.open(tmp_path / entry.file) as tar:
        members = {m.name: m for m in tar.getmembers()}
    for key, (st_off, st_len, j_off, j_len) in zip(entry.keys, entry.offsets, strict=True):
        assert (members[f"{key}.safetensors"].offset_data, members[f"{key}.safetensors"].size) == (
            st_off,
            st_len,
        )
        assert (members[f"{key}.json"].offset_data, members[f"{key}.json"].size) == (j_off, j_len)


def test_shards_are_byte_identical_across_runs(tmp_path: Path) -> None:
    write_cache(tmp_path / "a", range(5), shard_records=2)
    write_cache(tmp_path / "b", range(5), shard_records=2)
    for f in sorted((tmp_path / "a" / "shards").iterdir()):
        assert f.read_bytes() == (tmp_path / "b" / "shards" / f.name).read_bytes()


def test_unknown_backend_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="unknown cache backend 'lmdb'"):
        write_cache(tmp_path, range(1), backend="lmdb")


def test_corrupt_manifest_is_reported(tmp_path: Path) -> None:
    from wandistill.errors import CacheError

    write_cache(tmp_path, range(2))
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(CacheError, match="manifest.json.*corrupt"):
        open_cache(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(CacheError, match="not a wandistill cache manifest"):
        open_cache(tmp_path)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sealed_entry_that_breaks_the_schema_is_reported_when_used_naming_index_and_shard(
    tmp_path: Path, backend: str
) -> None:
    """Loading checks names and digests on the JSON; each entry meets its schema when first
    used (a million-shard manifest loads at about json.loads), with the whole-file message."""
    write_cache(tmp_path, range(4), backend=backend, shard_records=2)
    data = json.loads((tmp_path / "manifest.json").read_text())
    bad = {k: v for k, v in data["shards"][1].items() if k != mf.ENTRY_DIGEST}
    data["shards"][1] = seal_entry({**bad, "bytes": -1})  # re-sealed: the digest holds
    (tmp_path / "manifest.json").write_text(json.dumps(data))

    m = mf.load_committed(tmp_path)
    assert m.shards.names() == ["r00000-000000", "r00000-000001"]
    assert m.shards[0].records == 2 and m.shards[0].keys == data["shards"][0]["keys"]
    message = r"manifest.json' is corrupt: shards\[1\] \(r00000-000001\)\.bytes"
    with pytest.raises(CacheError, match=message):
        m.shards[1]
    with pytest.raises(CacheError, match=message), open_cache(tmp_path) as store:
        store.verify()
    assert m.shards.json(1) is m.shards.json_list()[1]  # written back as read
    assert mf.manifest_json(m)["shards"] == data["shards"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_manifest_read_and_written_again_is_byte_identical_and_its_seal_holds(
    tmp_path: Path, backend: str
) -> None:
    write_cache(tmp_path, range(3), backend=backend, shard_records=2)
    before = (tmp_path / "manifest.json").read_bytes()
    m = read_manifest(tmp_path)
    assert [e.records for e in m.shards] == [2, 1] and m.settings.record_steps == [0, 2, 3]
    mf.write_manifest(open_storage(tmp_path), m)
    assert (tmp_path / "manifest.json").read_bytes() == before
    again = json.loads(before)
    assert mf.header_digests(again) == again[mf.HEADER_DIGEST]


@pytest.mark.parametrize("backend", BACKENDS)
def test_shard_files_leave_the_page_cache_only_after_their_fsync(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every shard data file is fsynced, then dropped from the page cache (write-once bulk:
    `fsutil.drop_cached`); the small files (manifest, journal) are left cached."""
    events: list[tuple[str, int]] = []
    real_fsync, real_fadvise = os.fsync, os.posix_fadvise

    def fsync(fd: int) -> None:
        real_fsync(fd)
        events.append(("fsync", os.fstat(fd).st_ino))

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        real_fadvise(fd, offset, length, advice)
        if advice == os.POSIX_FADV_DONTNEED and (offset, length) == (0, 0):  # the whole file
            events.append(("drop", os.fstat(fd).st_ino))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    write_cache(tmp_path, range(6), backend=backend, shard_records=3)
    data = tmp_path / ("shards" if backend == "webdataset" else "data.zarr")
    shard_files = {
        p.stat().st_ino: p
        for p in data.rglob("*")
        if p.is_file() and p.name != "zarr.json" and not p.name.endswith(".lock")
    }
    dropped = {ino for kind, ino in events if kind == "drop"}
    assert shard_files and set(shard_files) <= dropped, "a shard file stayed in the page cache"
    for ino in dropped:
        first_drop = events.index(("drop", ino))
        assert ("fsync", ino) in events[:first_drop], f"{shard_files.get(ino)} dropped unsynced"
    small = {p.stat().st_ino for p in tmp_path.rglob("*.json") if p.is_file()}
    assert not small & dropped


def test_a_bulk_file_starts_writeback_as_it_goes_and_keeps_every_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every FLUSH_BEHIND_BYTES written, a bulk file hints DONTNEED over the window before and
    the one just written (starting its writeback), never past what it wrote; the file is
    still fsynced, dropped whole and published byte for byte."""
    monkeypatch.setattr(fsutil, "FLUSH_BEHIND_BYTES", 1000)
    hints: list[tuple[int, int, int]] = []
    fsynced: list[int] = []
    real_fadvise, real_fsync = os.posix_fadvise, os.fsync

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        real_fadvise(fd, offset, length, advice)
        hints.append((offset, length, os.fstat(fd).st_size))

    def fsync(fd: int) -> None:
        real_fsync(fd)
        fsynced.append(len(hints))

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    monkeypatch.setattr(os, "fsync", fsync)
    pieces = [os.urandom(n) for n in (300, 900, 50, 4000, 10, 2500)]
    with fsutil.atomic_open(tmp_path / "shard.tar", bulk=True) as f:
        for p in pieces:
            f.write(memoryview(p))
    assert (tmp_path / "shard.tar").read_bytes() == b"".join(pieces)
    *ranges, whole = hints
    # (start, length, file size then): each hint covers the previous window and the new one,
    # ending at what was written; 300+900 bytes reach the 1000-byte window first.
    assert ranges == [(0, 1200, 1200), (0, 5250, 5250), (1200, 6560, 7760)]
    assert whole[:2] == (0, 0) and fsynced[0] == len(ranges)  # dropped whole after its fsync
    with pytest.raises(ValueError, match="mode 'wb'"):
        with fsutil.atomic_open(tmp_path / "x", "w", bulk=True):
            pass


def test_a_descriptor_evicted_while_a_read_holds_it_closes_when_that_read_ends(
    tmp_path: Path,
) -> None:
    from wandistill.io.storage import _Descriptors

    files = []
    for i in range(3):
        files.append(tmp_path / f"f{i}")
        files[-1].write_bytes(str(i).encode())
    fds = _Descriptors(limit=1)
    with fds.lease(files[0]) as fd0:
        with fds.lease(files[1]) as fd1:  # evicts f0, which this thread is reading
            assert os.pread(fd0, 1, 0) == b"0" and os.pread(fd1, 1, 0) == b"1"
        assert os.pread(fd0, 1, 0) == b"0"  # still open, still f0
    with pytest.raises(OSError):
        os.fstat(fd0)  # closed by its last lease
    with fds.lease(files[2]) as fd2:  # evicts the idle f1 at once
        assert os.pread(fd2, 1, 0) == b"2"
        with pytest.raises(OSError):
            os.fstat(fd1)
    assert len(fds) == 1
    fds.close()
    with pytest.raises(OSError):
        os.fstat(fd2)


def test_verify_out_of_file_descriptors_is_one_line_with_the_fix_not_a_damaged_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import contextlib
    import errno

    from wandistill.cli import main
    from wandistill.io import storage

    write_cache(tmp_path, range(4), shard_records=2)

    @contextlib.contextmanager
    def emfile(self, path):  # noqa: ANN001, ANN202
        raise OSError(errno.EMFILE, "Too many open files", str(path))
        yield

    monkeypatch.setattr(storage._Descriptors, "lease", emfile)
    with pytest.raises(SystemExit) as info:
        main(["cache", "verify", str(tmp_path)])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "Too many open files" in err and "ulimit -n" in err and "Traceback" not in err
    assert "corrupt" not in err


def _segment_of(rel: str) -> int:
    """journal/rank-00000.json -> 0, journal/rank-00000-000003.json -> 3."""
    stem = rel.rsplit("/", 1)[-1].removesuffix(".json")
    return int(stem.split("-")[2]) if stem.count("-") == 2 else 0


def test_a_polling_reader_rereads_only_the_journal_files_that_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wandistill.cache.reader import CacheReader
    from wandistill.io.storage import LocalStorage

    monkeypatch.setattr(jn, "JOURNAL_SEGMENT_BYTES", 1200)  # a few shards per segment
    write_cache(tmp_path, range(6), shard_records=1, finalize=False, complete=False)
    store = CacheReader(tmp_path)
    reads: list[str] = []
    real = LocalStorage.read

    def counting(self, rel, **kw):  # noqa: ANN001, ANN202
        reads.append(rel)
        return real(self, rel, **kw)

    monkeypatch.setattr(LocalStorage, "read", counting)
    assert store.refresh() == [] and reads == []  # nothing changed: nothing read
    last = mf.journal_segments(open_storage(tmp_path), "webdataset")[-1].segment
    write_cache(tmp_path, range(9), shard_records=1, finalize=False, complete=False)
    reads.clear()
    new = store.refresh()
    assert [e.name for e in new] == [f"r00000-{i:06d}" for i in (6, 7, 8)]
    assert reads and all(_segment_of(r) >= last for r in reads)  # the changed ones only
    assert last >= 1  # so a sealed segment (0) was skipped

    journal = tmp_path / "journal" / "rank-00000.json"  # sealed: an edit is a new version
    kept = journal.read_bytes()
    data = json.loads(kept)
    data["shards"][0]["records"] = 1  # the same value...
    data["shards"][0]["bytes"] += 1  # ...and one that changes the entry
    fsutil.atomic_write_json(journal, data)
    with pytest.raises(CacheError, match="edited after the shard was committed"):
        store.refresh()
    fsutil.atomic_write_bytes(journal, kept)
    mf.finalize(open_storage(tmp_path), complete=True)  # journals folded into the manifest
    assert store.refresh() == [] and store.complete
    assert [e.name for e in store.entries] == [f"r00000-{i:06d}" for i in range(9)]


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(
    "name,tensor",
    [
        ("xt", torch.randn(3, 4, 5).to(torch.bfloat16)),
        ("teacher_out", torch.randn(4, 6).t()),  # not contiguous
        ("xt", torch.randn(2, 3, requires_grad=True)),
        ("xt", torch.zeros(0, 4)),
        ("xt", torch.zeros(3, 0)),
        ("timesteps", torch.tensor(7.5)),
        ("noise", torch.randn(2, 2).to(torch.float16)[:, 1]),
    ],
)
def test_tensor_checksums_match_the_bytes_of_every_step_row(
    name: str, tensor: torch.Tensor
) -> None:
    """One conversion per tensor, rows sliced in numpy: the same crc32c per step row (and per
    tensor) as the tensor's own bytes, whatever its layout, dtype or autograd state."""
    from wandistill.cache.contract import is_step_field
    from wandistill.cache.wds.format import crc32c, tensor_checksums

    got = tensor_checksums({name: tensor})[name]
    if is_step_field(name) and tensor.dim():
        assert got == [crc32c(_bytes_of(tensor[s])) for s in range(tensor.shape[0])]
    else:
        assert got == crc32c(_bytes_of(tensor))


def test_plain_keeps_a_plain_tensor_and_detaches_or_packs_the_rest() -> None:
    from wandistill.cache.contract import plain

    t = torch.randn(3, 4)
    assert plain(t) is t
    for odd in (t.t(), torch.randn(2, requires_grad=True)):
        p = plain(odd)
        assert p is not odd and p.is_contiguous() and not p.requires_grad
        assert torch.equal(p, odd.detach())
