"""Corrupt caches: every fault is reported precisely by `cache verify`, refused (or skipped and
counted) by `train`, and never read back as silently wrong numbers.

Faults: a truncated shard, a flipped byte in a tensor's data / a safetensors header / a json
member, a missing shard, a deleted or damaged zarr chunk, and hand edits of the manifest
(record counts, keys, offsets, sha256, bytes, file paths, settings, dims).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from wandistill.cache import open_cache
from wandistill.cache.manifest import read_manifest
from wandistill.cache.reader import CacheReader
from wandistill.cache.training import TrainingReader
from wandistill.errors import CacheError, CorruptRecordError

from cachefixtures import make_record, write_cache
from clirun import run_cli as _cli

STEP_FIELDS = ("xt", "teacher_out", "timesteps")
TRAIN_SETS = (
    "student.num_layers=1",
    "student.num_attention_heads=2",
    "student.attention_head_dim=12",
    "student.ffn_dim=32",
    "batch_size=2",
    "data_threads=2",
    'device="cpu"',
    "tensorboard=false",
    "checkpoint_every=100",
)


def _train(
    capsys: pytest.CaptureFixture[str], cache: Path, out: Path, *extra: str, steps: int = 2
) -> tuple[int, str, str]:
    sets = [x for s in TRAIN_SETS for x in ("--set", s)]
    args = ["train", "--cache", str(cache), "--out", str(out), "--steps", str(steps)]
    return _cli(capsys, *args, *sets, *extra)


def _verify(capsys: pytest.CaptureFixture[str], cache: Path) -> tuple[int, str]:
    code, _, err = _cli(capsys, "cache", "verify", str(cache))
    assert "Traceback" not in err
    return code, " ".join(err.split())  # rich may wrap long lines


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _tensor_span(cache: Path, entry: dict[str, Any], i: int, name: str) -> tuple[int, int]:
    """Absolute (offset, bytes) of tensor `name` of record i in its tar."""
    off = entry.offsets[i][0]
    path = cache / entry.file
    with open(path, "rb") as f:
        f.seek(off)
        hlen = int.from_bytes(f.read(8), "little")
        table = json.loads(f.read(hlen))
    a, b = table[name]["data_offsets"]
    return off + 8 + hlen + a, b - a


def _edit_manifest(cache: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = cache / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=1))


def _reader(cache: Path, **kw: Any) -> TrainingReader:
    return TrainingReader(cache, batch_size=3, num_threads=2, **kw)


def _one_epoch(reader: TrainingReader) -> list[dict[str, Any]]:
    it = iter(reader)
    return [next(it) for _ in range(reader.batches_per_epoch())]


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """6 records in 2 webdataset shards of 3 (18 training samples)."""
    write_cache(tmp_path / "c", range(6), shard_records=3)
    return tmp_path / "c"


# ----------------------------------------------------------------------------- tensor data


@pytest.mark.parametrize("name", ["xt", "teacher_out", "prompt_embeds", "timesteps"])
def test_a_flipped_byte_in_tensor_data_is_never_read_back(
    cache: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    entry = read_manifest(cache).shards[1]
    key = entry.keys[2]
    pos, n = _tensor_span(cache, entry, 2, name)
    step = 1 if name in STEP_FIELDS else None
    row = n // 3 if step is not None else n
    _flip(cache / entry.file, pos + (step or 0) * row + row // 2)  # inside step 1's row
    with open_cache(cache) as store:
        if step is not None:  # the other rows of the record are intact and still readable
            good = store.read_sample(entry, 2, 0, [name], pad=False)[name]
            want = getattr(make_record(5), name)[0]
            assert torch.equal(
                good.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
            )
        with pytest.raises(CorruptRecordError) as info:
            store.read_sample(entry, 2, step if step is not None else 0, [name])
        assert (info.value.shard, info.value.key) == (entry.name, key)
        assert f"'{name}'{' step 1' if step else ''} fails its crc32c check" in info.value.detail
        with pytest.raises(CorruptRecordError, match=name):
            store.read_record(entry, 2)
    code, err = _verify(capsys, cache)
    assert code == 1
    assert f"shard {entry.name} record {key}: '{name}'" in err and "crc32c" in err
    assert "sha256 mismatch" not in err  # tensor bytes are hashed once: by their crc32c
    with pytest.raises(CacheError, match=f"corrupt record {key} in shard {entry.name}: '{name}'"):
        _one_epoch(_reader(cache))


def test_train_refuses_a_flipped_data_byte_in_one_line_or_skips_and_counts(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    entry = read_manifest(cache).shards[0]
    pos, n = _tensor_span(cache, entry, 1, "prompt_embeds")
    _flip(cache / entry.file, pos + n // 2)
    before = {p.name: p.read_bytes() for p in (cache / "shards").iterdir()}
    code, out, err = _train(capsys, cache, tmp_path / "a", steps=9)
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and "Traceback" not in err
    assert f"corrupt record {entry.keys[1]} in shard {entry.name}" in line
    assert "--skip-corrupt" in err
    code, out, err = _train(capsys, cache, tmp_path / "b", "--skip-corrupt", steps=9)
    assert code == 0 and "trained 9 steps" in out
    assert "--skip-corrupt: skipped" in err and entry.keys[1] in err
    with open_cache(cache) as store:  # training never writes to the cache
        assert {p.name: p.read_bytes() for p in (cache / "shards").iterdir()} == before
        assert len(store) == 6


def test_a_skipping_reader_counts_each_bad_sample_and_keeps_batch_shapes(cache: Path) -> None:
    entry = read_manifest(cache).shards[0]
    pos, n = _tensor_span(cache, entry, 0, "xt")
    _flip(cache / entry.file, pos + n // 2)  # one row: step 1 of record 0
    reader = _reader(cache, skip_corrupt=True)
    batches = _one_epoch(reader)
    assert all(b["xt"].shape[0] == 3 for b in batches)
    (line,) = set(reader.corrupt)  # once per epoch read (prefetch may reach the next epoch)
    assert f"in shard {entry.name}: 'xt' step 1 fails its crc32c check" in line
    served = [(k, int(s)) for b in batches for k, s in zip(b["key"], b["step_slot"], strict=True)]
    assert (entry.keys[0], 1) not in served
    # every good sample is served; none is lost (the bad one's slot repeats a good one)
    assert {(k, s) for e in read_manifest(cache).shards for k in e.keys for s in range(3)} - {
        (entry.keys[0], 1)
    } == set(served)


# ----------------------------------------------------------------------------- headers, json


def test_a_flipped_byte_in_a_safetensors_header_is_caught_by_its_manifest_crc(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    entry = read_manifest(cache).shards[0]
    off = entry.offsets[2][0]
    path = cache / entry.file
    with open(path, "rb") as f:
        f.seek(off)
        hlen = int.from_bytes(f.read(8), "little")
        header = f.read(hlen)
    # Change a digit of a shape: still valid JSON, so only the checksum can tell.
    at = header.index(b'"shape":[3,') + len(b'"shape":[')
    data = bytearray(path.read_bytes())
    data[off + 8 + at] = ord("2")
    path.write_bytes(bytes(data))
    with open_cache(cache) as store, pytest.raises(CorruptRecordError, match="header fails"):
        store.read_sample(entry, 2, 0, ["xt"])
    code, err = _verify(capsys, cache)
    assert code == 1 and f"shard {entry.name} record {entry.keys[2]}: safetensors header" in err


def test_a_flipped_byte_in_a_json_member_names_the_record(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    entry = read_manifest(cache).shards[1]
    joff, jlen = entry.offsets[0][2:]
    raw = (cache / entry.file).read_bytes()[joff : joff + jlen]
    _flip(cache / entry.file, joff + raw.index(b"prompt 3") + 7)  # inside the prompt text
    with open_cache(cache) as store, pytest.raises(CorruptRecordError, match="json member"):
        store.read_record(entry, 0)
    code, err = _verify(capsys, cache)
    assert code == 1 and f"record {entry.keys[0]}: json member fails its crc32c check" in err


# ----------------------------------------------------------------------------- whole shards


def test_a_truncated_shard_is_reported_refused_or_skipped_whole(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    entry = read_manifest(cache).shards[1]
    path = cache / entry.file
    os.truncate(path, entry.offsets[-1][0] + 100)  # inside the last record's tensors
    code, err = _verify(capsys, cache)
    assert code == 1 and f"shard {entry.name}: " in err and "bytes on disk" in err
    assert f"shard {entry.name} record {entry.keys[-1]}: " in err and "truncated" in err
    with pytest.raises(CacheError, match=f"unusable shard {entry.name}: .* bytes"):
        _reader(cache)._space(read_manifest(cache).shards)
    reader = _reader(cache, skip_corrupt=True)
    batches = _one_epoch(reader)
    assert len(batches) == 3 and not {k for b in batches for k in b["key"]} & set(entry.keys)
    assert reader.corrupt == [
        f"unusable shard {entry.name}: file {entry.file} has {path.stat().st_size} bytes, "
        f"the manifest says {entry.bytes} (truncated or replaced); its 3 records skipped"
    ]


def test_a_missing_shard_is_reported_refused_or_skipped(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    entry = read_manifest(cache).shards[0]
    (cache / entry.file).unlink()
    code, err = _verify(capsys, cache)
    assert code == 1 and f"shard {entry.name}: file {entry.file} is missing" in err
    code, _, err = _train(capsys, cache, tmp_path / "a")
    assert code == 1 and "Traceback" not in err
    assert f"error: unusable shard {entry.name}: file {entry.file} is missing" in err
    code, out, err = _train(capsys, cache, tmp_path / "b", "--skip-corrupt")
    assert code == 0 and "0 corrupt sample read(s) and 1 unusable shard(s)" in " ".join(err.split())


# ----------------------------------------------------------------------------- manifest edits


def _bump_records(m: dict[str, Any]) -> None:
    m["shards"][0]["records"] = 5


def _string_records(m: dict[str, Any]) -> None:
    m["shards"][0]["records"] = "3"


def _escape_path(m: dict[str, Any]) -> None:
    m["shards"][0]["file"] = "../../../etc/passwd"


def _list_twice(m: dict[str, Any]) -> None:
    m["shards"].append(dict(m["shards"][0]))


def _drop_keys(m: dict[str, Any]) -> None:
    del m["shards"][1]["keys"]


def _settings_not_dict(m: dict[str, Any]) -> None:
    m["settings"] = ["oops"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_bump_records, "shards[0] (r00000-000000): says 5 records but lists 3 keys"),
        (_string_records, "(r00000-000000).records must be an integer, not the string '3'"),
        (_escape_path, "file = '../../../etc/passwd': path contains an empty, '.' or '..' part"),
        (_list_twice, "shard r00000-000000 is listed twice"),
        (_drop_keys, "shards[1] (r00000-000001).keys is missing"),
        (_settings_not_dict, "settings must be a JSON object, not a JSON array"),
    ],
)
def test_a_structurally_broken_manifest_is_refused_by_every_command(
    cache: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    edit: Callable[[dict[str, Any]], None],
    message: str,
) -> None:
    _edit_manifest(cache, edit)
    for args in (
        ["cache", "verify", str(cache)],
        ["cache", "info", str(cache)],
        ["train", "--cache", str(cache), "--out", str(tmp_path / "run")],
    ):
        code, _, err = _cli(capsys, *args)
        text = " ".join(err.split())
        assert code == 1 and "Traceback" not in err, (args, err)
        assert text.startswith("error:") and "manifest.json" in text and message in text, args
    assert not (tmp_path / "run").exists()


def _rename_key(m: dict[str, Any]) -> None:
    k = m["shards"][0]["keys"][1]
    m["shards"][0]["keys"][1] = k[:-1] + ("0" if k[-1] != "0" else "1")


def _shift_offset(m: dict[str, Any]) -> None:
    m["shards"][0]["offsets"][1][0] += 512


def _swap_offsets(m: dict[str, Any]) -> None:
    o = m["shards"][0]["offsets"]
    o[0], o[1] = o[1], o[0]


def _edit_sha(m: dict[str, Any]) -> None:
    m["shards"][0]["frame_sha256"] = "0" * 64


def _edit_bytes(m: dict[str, Any]) -> None:
    m["shards"][0]["bytes"] += 1


def _drop_offset_row(m: dict[str, Any]) -> None:
    m["shards"][0]["offsets"].pop()


def _more_steps(m: dict[str, Any]) -> None:
    m["settings"]["record_steps"] = [0, 1, 2, 3]


def _other_text_dim(m: dict[str, Any]) -> None:
    m["dims"]["text_dim"] = 64


def _other_dtype(m: dict[str, Any]) -> None:
    m["fields"][3]["dtype"] = "float16"


@pytest.mark.parametrize(
    ("edit", "messages", "train_message"),
    [
        (
            _rename_key,
            [
                "r00000-000000: manifest entry was edited",
                "unexpected member '{k1}.json' (not a record listed in the manifest)",
                "record {k1x}: member {k1x}.safetensors is missing from the tar",
            ],
            "r00000-000000: manifest entry was edited",
        ),
        (
            _shift_offset,
            [
                "r00000-000000: manifest entry was edited",
                "record {k1}: manifest offsets put safetensors at",
            ],
            "r00000-000000: manifest entry was edited",
        ),
        (
            _swap_offsets,
            ["record {k0}: manifest offsets put safetensors", "record {k1}: manifest offsets"],
            "r00000-000000: manifest entry was edited",
        ),
        (
            _edit_sha,
            ["r00000-000000: manifest entry was edited", "r00000-000000: sha256 mismatch"],
            None,
        ),
        (
            _edit_bytes,
            ["r00000-000000: manifest entry was edited", "bytes on disk"],
            "r00000-000000: manifest entry was edited",
        ),
        (_drop_offset_row, ["(r00000-000000): lists 2 offsets rows for 3 keys"], None),
        # The header blocks are sealed: an edit is refused by every open, verify included.
        (_more_steps, ["settings changed after the cache was written"], "settings changed"),
        (_other_text_dim, ["dims changed after the cache was written"], "dims changed"),
        (_other_dtype, ["fields changed after the cache was written"], "fields changed"),
    ],
)
def test_a_hand_edited_manifest_is_caught_precisely(
    cache: Path,
    capsys: pytest.CaptureFixture[str],
    edit: Callable[[dict[str, Any]], None],
    messages: list[str],
    train_message: str | None,
) -> None:
    keys = read_manifest(cache).shards[0].keys
    _edit_manifest(cache, edit)
    edited = json.loads((cache / "manifest.json").read_text())["shards"][0]["keys"]
    names = {"k0": keys[0], "k1": keys[1], "k1x": edited[1]}
    code, err = _verify(capsys, cache)
    assert code == 1
    for m in messages:
        assert m.format(**names) in err, (m, err)
    if train_message is not None:  # the training reader refuses rather than read wrong data
        with pytest.raises(CacheError, match=train_message.format(**names)):
            _one_epoch(_reader(cache))


def test_a_record_listed_in_two_shards_is_reported(cache: Path, capsys) -> None:
    def dup(m: dict[str, Any]) -> None:
        m["shards"][1]["keys"][0] = m["shards"][0]["keys"][0]

    key = read_manifest(cache).shards[0].keys[0]
    _edit_manifest(cache, dup)
    code, err = _verify(capsys, cache)
    assert code == 1 and f"record {key} appears in shards r00000-000000 and r00000-000001" in err
    with pytest.raises(CacheError, match="r00000-000001: manifest entry was edited"):
        _one_epoch(_reader(cache))


def test_an_edited_journal_of_a_running_cache_is_caught_too(tmp_path: Path, capsys) -> None:
    write_cache(tmp_path, range(3), shard_records=3, finalize=False, complete=False)
    journal = tmp_path / "journal" / "rank-00000.json"
    data = json.loads(journal.read_text())
    data["shards"][0]["records"] = 4
    journal.write_text(json.dumps(data))
    code, err = _verify(capsys, tmp_path)
    assert code == 1 and "journal" in err and "says 4 records but lists 3 keys" in err


# ----------------------------------------------------------------------------- compatibility


def test_a_cache_written_before_checksums_is_refused_naming_the_rebuild(tmp_path: Path) -> None:
    import wandistill.cache.manifest as mf

    write_cache(tmp_path, range(4), shard_records=2)

    def strip(m: dict[str, Any]) -> None:  # what a schema 1 (pre-release) wandistill wrote
        for s in m["shards"]:
            del s["crc32c"], s[mf.ENTRY_DIGEST]
        del m["numerics"], m[mf.HEADER_DIGEST]
        m["schema_version"] = 1

    _edit_manifest(tmp_path, strip)
    with pytest.raises(CacheError, match="has cache schema 1, this wandistill reads schema 3") as e:
        open_cache(tmp_path)
    assert "rebuild the cache" in (e.value.fix or "")


# ----------------------------------------------------------------------------- zarr


@pytest.fixture
def zcache(tmp_path: Path) -> Path:
    write_cache(tmp_path / "z", range(6), backend="zarr", shard_records=3)
    return tmp_path / "z"


def _zarr_file(cache: Path, entry: dict[str, Any], array: str) -> Path:
    rel = sorted(r for r in entry.sha256 if r.split("/c/")[0] == array)[0]
    return cache / "data.zarr" / rel


def _zarr_file_rel(cache: Path, entry: dict[str, Any]) -> str:
    return next(r for r in entry.sha256 if not (cache / "data.zarr" / r).exists())


def test_zarr_a_flipped_byte_in_a_chunk_is_refused_and_reported(
    zcache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    entry = read_manifest(zcache).shards[0]
    _flip(_zarr_file(zcache, entry, "xt"), 100)  # first inner chunk: record 0, step 0
    with open_cache(zcache) as store:
        with pytest.raises(Exception, match="crc32c"):
            store.read_sample(entry, 0, 0, ["xt"])
        assert store.read_sample(entry, 0, 1, ["xt"])["xt"].shape == (16, 1, 4, 4)
    code, err = _verify(capsys, zcache)
    assert code == 1 and entry.name in err and entry.keys[0] in err
    with pytest.raises(CacheError, match=f"corrupt record {entry.keys[0]} in shard"):
        _one_epoch(_reader(zcache))


def test_zarr_a_deleted_chunk_file_is_refused_and_reported(
    zcache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    entry = read_manifest(zcache).shards[1]
    _zarr_file(zcache, entry, "teacher_out").unlink()
    code, err = _verify(capsys, zcache)
    assert code == 1 and entry.name in err and "teacher_out" in err
    with pytest.raises(CacheError, match=f"unusable shard {entry.name}: .* is missing"):
        _one_epoch(_reader(zcache))
    reader = _reader(zcache, skip_corrupt=True)
    assert len(_one_epoch(reader)) == 3  # the 9 samples of the other shard
    assert reader.corrupt == [
        f"unusable shard {entry.name}: file data.zarr/"
        f"{_zarr_file_rel(zcache, entry)} is missing; its 3 records skipped"
    ]


def test_zarr_a_hand_edited_entry_is_caught(zcache: Path, capsys) -> None:
    def edit(m: dict[str, Any]) -> None:
        m["shards"][0]["rows"] = [3, 6]  # points at the other shard's rows

    _edit_manifest(zcache, edit)
    code, err = _verify(capsys, zcache)
    assert code == 1 and "(r00000-000000): rows [3, 6] / reserved [0, 3] do not hold" in err


@pytest.mark.parametrize(
    ("array", "name"), [("timesteps", "timesteps"), ("prompt_embeds/values", "prompt_embeds")]
)
def test_zarr_a_flipped_byte_in_a_partially_read_chunk_is_refused(
    zcache: Path, array: str, name: str
) -> None:
    """A training sample reads one timestep out of a record's row chunk and the ragged
    embedding's edge chunks only in part: those chunks must be checked all the same."""
    entry = read_manifest(zcache).shards[0]
    _flip(_zarr_file(zcache, entry, array), 1)  # record 0: first value (step 0 / token 0)
    with open_cache(zcache) as store, pytest.raises(CacheError, match="crc32c"):
        store.read_sample(entry, 0, 0, [name], pad=False)
    # (an embedding chunk holds several records' tokens: any of them may be read first)
    with pytest.raises(CacheError, match=f"corrupt record .* in shard {entry.name}: .*crc32c"):
        _one_epoch(_reader(zcache))


def test_a_copied_cache_verifies_and_a_corrupt_copy_does_not(cache: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(cache, copy)
    with CacheReader(copy) as store:
        assert store.verify() == []
    entry = read_manifest(copy).shards[0]
    pos, n = _tensor_span(copy, entry, 2, "teacher_out")
    _flip(copy / entry.file, pos + n - 1)  # last byte of the last step's row
    with CacheReader(copy) as store:
        problems = store.verify()
    assert any(f"record {entry.keys[2]}: 'teacher_out' step 2 fails" in p for p in problems)
