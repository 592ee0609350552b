"""`wandistill cache merge`: one cache from several alike ones, shards linked not copied, every
bad input one line that names it, and nothing written (or lost) on a refusal."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
import zarr

from wandistill.cache.contract import is_holdout
from wandistill.cache.merge import MergeConfig, merge
from wandistill.cache.reader import open_cache
from wandistill.cache.wds.decoder import safe_decoder

from cachefixtures import SETTINGS, write_cache
from clirun import run_cli as _run
from s3server import forget_clients

HOLDOUT = {**SETTINGS, "holdout_fraction": 0.3}


def _keys(path: Path) -> list[str]:
    with open_cache(path) as store:
        return [k for e in store.entries for k in e.keys]


@pytest.mark.parametrize("backend", ["webdataset", "zarr"])
def test_merge_keeps_every_key_once_first_input_first(
    tmp_path: Path, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, m = tmp_path / "a", tmp_path / "b", tmp_path / "m"
    write_cache(a, range(0, 6), backend=backend, settings=HOLDOUT)
    write_cache(b, range(4, 11), backend=backend, settings=HOLDOUT)  # 4, 5 in both
    code, out, err = _run(capsys, "cache", "merge", str(a), str(b), "--out", str(m))
    assert code == 0, err
    assert "11 records (6 + 5)" in out and "2 duplicate" in out
    assert "3 hard-linked, 0 copied, 1 re-written" in out  # b's first shard holds 4 and 5
    keys_a, keys_b = _keys(a), _keys(b)
    assert _keys(m) == keys_a + [k for k in keys_b if k not in keys_a]
    with open_cache(m) as store, open_cache(b) as other:
        assert store.complete and store.verify() == []
        key = keys_b[-1]
        assert torch.equal(store.read_key(key).xt, other.read_key(key).xt)
        # The held-out split is a function of the key: M's is the inputs' union.
        frac = store.manifest.settings.holdout_fraction
        held = {k for k in _keys(m) if is_holdout(k, frac)}
        assert held == {k for k in keys_a + keys_b if is_holdout(k, frac)} and held
    code, out, _ = _run(capsys, "cache", "merge", str(a), str(b), "--out", str(m))
    assert code == 0 and "nothing to do" in out


def test_whole_webdataset_shards_are_hard_links_read_by_stock_webdataset(tmp_path: Path) -> None:
    a, b, m = tmp_path / "a", tmp_path / "b", tmp_path / "m"
    write_cache(a, range(0, 4), shard_records=2)
    write_cache(b, range(4, 8), shard_records=2)
    summary = merge(MergeConfig(inputs=(a, b), out=m))
    assert (summary.linked, summary.rewritten, summary.duplicates) == (4, 0, 0)
    src = sorted((b / "shards").glob("*.tar"))[0]
    dst = m / "shards" / "r00000-000002.tar"
    assert os.path.samefile(src, dst)  # the same inode: no byte copied
    tars = sorted(str(p) for p in (m / "shards").glob("*.tar"))
    got = [s["__key__"] for s in wds.WebDataset(tars, shardshuffle=False).decode(safe_decoder())]
    assert got == _keys(m) and len(got) == 8


def test_mismatched_caches_are_refused_naming_the_key_and_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, m = tmp_path / "a", tmp_path / "b", tmp_path / "m"
    write_cache(a, range(2))
    write_cache(b, range(2, 4), settings={**SETTINGS, "num_inference_steps": 5})
    code, _, err = _run(capsys, "cache", "merge", str(a), str(b), "--out", str(m))
    assert code != 0 and "Traceback" not in err
    assert "settings.num_inference_steps" in err and str(a) in err and str(b) in err
    assert not m.exists()  # refused before anything was written
    write_cache(tmp_path / "z", range(4, 6), backend="zarr")
    code, _, err = _run(capsys, "cache", "merge", str(a), str(tmp_path / "z"), "--out", str(m))
    assert code != 0 and "backend" in err and not m.exists()


def test_an_incomplete_input_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b, m = tmp_path / "a", tmp_path / "b", tmp_path / "m"
    write_cache(a, range(2))
    write_cache(b, range(2, 4), finalize=False, complete=False)  # still in its journal
    code, _, err = _run(capsys, "cache", "merge", str(a), str(b), "--out", str(m))
    assert code != 0 and "incomplete" in err and str(b) in err and "precompute" in err
    assert not m.exists()


def test_out_over_a_foreign_folder_or_another_cache_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_cache(a, range(2))
    write_cache(b, range(2, 4))
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    code, _, err = _run(capsys, "cache", "merge", str(a), str(b), "--out", str(foreign))
    assert code == 2 and "not written by wandistill" in err
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    other = tmp_path / "other"
    write_cache(other, range(8, 10))
    before = (other / "manifest.json").read_bytes()
    code, _, err = _run(capsys, "cache", "merge", str(a), str(b), "--out", str(other))
    assert code == 2 and "already is a cache" in err
    assert (other / "manifest.json").read_bytes() == before
    code, _, err = _run(capsys, "cache", "merge", str(a), str(b), "--out", str(a / "m"))
    assert code == 2 and "inside" in err


def test_an_interrupted_merge_reruns_to_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_cache(a, range(0, 4), backend="zarr")
    write_cache(b, range(2, 6), backend="zarr")
    merge(MergeConfig(inputs=(a, b), out=tmp_path / "fresh"))
    from wandistill.cache import merge as merge_mod

    def killed(*_: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(merge_mod.mf, "write_manifest", killed)
        with pytest.raises(KeyboardInterrupt):
            merge(MergeConfig(inputs=(a, b), out=tmp_path / "m"))
    assert not (tmp_path / "m" / "manifest.json").exists()  # no cache: nothing committed
    merge(MergeConfig(inputs=(a, b), out=tmp_path / "m"))

    def files(root: Path) -> dict[str, bytes]:
        skip = (".wandistill", "data.zarr.lock")
        return {
            str(p.relative_to(root)): p.read_bytes()
            for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(skip)
        }

    assert files(tmp_path / "m") == files(tmp_path / "fresh")
    with open_cache(tmp_path / "m") as store:
        assert store.verify() == [] and len(store) == 6


def test_whole_zarr_entries_are_hard_links_read_by_stock_zarr(tmp_path: Path) -> None:
    a, b, m = tmp_path / "a", tmp_path / "b", tmp_path / "m"
    write_cache(a, range(0, 3), backend="zarr", negative=True)  # ragged field, shifted tokens
    write_cache(b, range(3, 8), backend="zarr", negative=True)
    c = tmp_path / "c"  # another zarr layout (2-row blocks): re-written, not linked
    write_cache(c, range(8, 10), backend="zarr", negative=True, shard_records=2)
    summary = merge(MergeConfig(inputs=(a, b, c), out=m))
    assert (summary.linked, summary.rewritten, summary.records) == (3, 1, 10)
    # b's first zarr shard (rows 0..3 there) is M's second record block: same inode.
    assert os.path.samefile(b / "data.zarr/xt/c/0/0/0/0/0/0", m / "data.zarr/xt/c/1/0/0/0/0/0")
    group = zarr.open_group(m / "data.zarr", mode="r")
    with open_cache(m) as store, open_cache(b) as other:
        assert store.verify() == [] and _keys(m) == _keys(a) + _keys(b) + _keys(c)
        for key in _keys(b):
            entry, i = store.locate()[key]
            row = entry.rows[0] + i
            want = other.read_key(key)
            got = store.read_key(key)
            assert torch.equal(got.prompt_embeds, want.prompt_embeds)
            assert torch.equal(got.negative_prompt_embeds, want.negative_prompt_embeds)
            assert torch.equal(torch.from_numpy(np.asarray(group["noise"][row])), want.noise)


def test_an_input_on_an_unusable_object_store_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """URLs merge now (tests/unit/test_cache_merge_s3.py); one whose store cannot be used (here:
    no credentials at all) is one line naming the URL and the fix, before anything is written."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    forget_clients()  # a client made with another test's credentials would be reused
    a, m = tmp_path / "a", tmp_path / "m"
    write_cache(a, range(2))
    code, _, err = _run(capsys, "cache", "merge", str(a), "s3://bucket/b", "--out", str(m))
    assert code == 2 and "s3://bucket/b" in err and "fix:" in err and "Traceback" not in err
    assert err.count("error:") == 1
    assert not m.exists()


@pytest.mark.parametrize("backend", ["webdataset", "zarr"])
def test_a_corrupt_input_shard_is_refused_by_name_or_skipped_and_counted(
    tmp_path: Path, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A flipped byte in an input shard is never linked into M: merge verifies every input
    shard first, refuses naming the shard, or with --skip-corrupt leaves it out and counts it."""
    a, b, m = tmp_path / "a", tmp_path / "b", tmp_path / "m"
    write_cache(a, range(0, 4), backend=backend, shard_records=2)
    write_cache(b, range(4, 8), backend=backend, shard_records=2)
    with open_cache(b) as store:
        entry = store.entries[0]
    victim = max(
        (p for p in b.rglob("*") if p.is_file() and p.suffix != ".json" and "lock" not in p.name),
        key=lambda p: p.stat().st_size,
    )
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    code, _, err = _run(capsys, "cache", "merge", str(a), str(b), "--out", str(m))
    assert code == 1 and err.count("error:") == 1 and "fails verification" in err, err
    assert f"input cache {str(b)!r}: shard" in err and "--skip-corrupt" in err
    assert not (m / "manifest.json").exists()
    code, out, err = _run(
        capsys, "cache", "merge", str(a), str(b), "--out", str(m), "--skip-corrupt"
    )
    assert code == 0, err
    assert "--skip-corrupt: left out 1 corrupt input shard(s), 2 record(s)" in err, err
    with open_cache(m) as store:
        assert store.verify() == [] and len(store) == 6
    assert entry.name in err or backend == "zarr"
