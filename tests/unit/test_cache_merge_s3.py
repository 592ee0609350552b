"""`wandistill cache merge` on an object store (a real S3 server on 127.0.0.1, moto): the same
records and manifest as the local merge, shards copied by the store itself when inputs and
output share it (counted at the server: CopyObject requests, no shard bytes through the
client), streamed across stores, every input verified first, nothing published on a refusal."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import torch

from wandistill.cache.manifest import load_committed
from wandistill.cache.merge import MergeConfig, merge
from wandistill.cache.reader import open_cache

from cachefixtures import SETTINGS, write_cache
from clirun import run_cli as _run
from s3server import BUCKET, forget_clients, s3_server, traffic

BOOKKEEPING = (".wandistill", "data.zarr.lock")
"""Objects of the claim and the zarr claim lock: who held M, not what M holds."""


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    with s3_server() as env:
        yield env


def _url(name: str) -> str:
    return f"s3://{BUCKET}/{name}"


def _objects(url: str) -> dict[str, bytes]:
    """Every object under `url` but the bookkeeping ones, by name relative to it."""
    fs, root = fsspec.filesystem("s3"), url.removeprefix("s3://")
    fs.invalidate_cache()  # this test's client listed the prefix before: ask afresh
    names = [n for n in fs.find(root) if not n.rsplit("/", 1)[-1].startswith(BOOKKEEPING)]
    return {n[len(root) + 1 :]: fs.cat_file(n) for n in names}


def _records(cache: str | Path) -> list[tuple[str, dict[str, torch.Tensor]]]:
    with open_cache(cache) as store:
        assert store.complete and store.verify() == []
        return [(r.key, r.tensors()) for r in store.records()]


def _same_records(a: str | Path, b: str | Path) -> None:
    got, want = _records(a), _records(b)
    assert [k for k, _ in got] == [k for k, _ in want] and got
    for (_, x), (_, y) in zip(got, want, strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x)


def _three(where: str | Path, backend: str) -> list[str | Path]:
    """Three caches, the second and third overlapping (key 6 in both): whole shards to copy and
    one shard to re-write."""
    spans = [range(0, 4), range(4, 7), range(6, 10)]
    out: list[str | Path] = []
    for n, span in enumerate(spans):
        cache = f"{where}/in{n}" if isinstance(where, str) else where / f"in{n}"
        write_cache(cache, span, backend=backend, shard_records=2)
        out.append(cache)
    return out


@pytest.mark.parametrize("backend", ["webdataset", "zarr"])
def test_three_s3_caches_merge_on_s3_by_server_side_copy_like_the_local_merge(
    s3: dict[str, str], tmp_path: Path, backend: str
) -> None:
    local = merge(MergeConfig(inputs=tuple(_three(tmp_path, backend)), out=tmp_path / "m"))
    inputs = _three(_url(f"three-{backend}"), backend)
    shard_bytes = sum(len(v) for v in _objects(_url(f"three-{backend}")).values())
    traffic.reset()
    remote = merge(MergeConfig(inputs=tuple(inputs), out=_url(f"three-{backend}-m")))
    merged = load_committed(_url(f"three-{backend}-m"))
    assert merged.shards == load_committed(tmp_path / "m").shards
    assert (
        (remote.records, remote.per_input, remote.duplicates)
        == (
            local.records,
            local.per_input,
            local.duplicates,
        )
        == (10, [4, 3, 3], 1)
    )
    whole = local.linked + local.copied
    assert (remote.server_copied, remote.copied, remote.client_bytes) == (whole, 0, 0)
    assert remote.rewritten == local.rewritten == 1
    # Counted at the server: one CopyObject per copied file (and shared.safetensors), and no
    # more body bytes uploaded than the re-written shard, the manifest and the bookkeeping.
    copies = traffic.calls["CopyObject"]
    assert copies >= whole + 1 and traffic.calls["UploadPartCopy"] == 0
    if backend == "webdataset":
        assert copies == whole + 1
    assert traffic.uploaded < shard_bytes / 2, (traffic.uploaded, shard_bytes)
    if backend == "webdataset":  # each input shard read once, to verify it (was ~3x in place)
        assert traffic.downloaded < 1.5 * shard_bytes, (traffic.downloaded, shard_bytes)
    _same_records(_url(f"three-{backend}-m"), tmp_path / "m")


@pytest.mark.parametrize("backend", ["webdataset", "zarr"])
def test_local_inputs_merge_into_s3_and_s3_inputs_into_a_local_folder(
    s3: dict[str, str], tmp_path: Path, backend: str
) -> None:
    local_inputs = _three(tmp_path / "in", backend)
    merge(MergeConfig(inputs=tuple(local_inputs), out=tmp_path / "m"))
    traffic.reset()
    up = merge(MergeConfig(inputs=tuple(local_inputs), out=_url(f"up-{backend}")))
    assert up.server_copied == 0 and up.copied > 0 and up.client_bytes > 0
    assert traffic.calls["CopyObject"] == 0
    _same_records(_url(f"up-{backend}"), tmp_path / "m")
    assert load_committed(_url(f"up-{backend}")).shards == load_committed(tmp_path / "m").shards
    remote_inputs = _three(_url(f"down-{backend}"), backend)
    down = merge(MergeConfig(inputs=tuple(remote_inputs), out=tmp_path / "down"))
    assert down.server_copied == 0 and down.copied == up.copied and down.linked == 0
    _same_records(tmp_path / "down", tmp_path / "m")
    assert load_committed(tmp_path / "down").shards == load_committed(tmp_path / "m").shards


@pytest.mark.parametrize("backend", ["webdataset", "zarr"])
def test_a_flipped_byte_in_an_s3_input_is_refused_or_skipped_and_nothing_is_published(
    s3: dict[str, str], backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, m = _url(f"flip-{backend}-a"), _url(f"flip-{backend}-b"), _url(f"flip-{backend}-m")
    write_cache(a, range(0, 4), backend=backend, shard_records=2)
    write_cache(b, range(4, 8), backend=backend, shard_records=2)
    fs = fsspec.filesystem("s3")
    shards = [
        n
        for n in fs.find(b.removeprefix("s3://"))
        if "/shards/" in n or ("/data.zarr/" in n and "/c/" in n)
    ]
    victim = max(shards, key=fs.size)
    data = bytearray(fs.cat_file(victim))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(victim, bytes(data))
    code, _, err = _run(capsys, "cache", "merge", a, b, "--out", m)
    assert code == 1 and err.count("error:") == 1 and "fails verification" in err, err
    assert f"input cache {b!r}: shard" in err and "--skip-corrupt" in err
    assert _objects(m) == {}  # refused before M was claimed: not one object
    code, out, err = _run(capsys, "cache", "merge", a, b, "--out", m, "--skip-corrupt")
    assert code == 0, err
    assert "--skip-corrupt: left out 1 corrupt input shard(s), 2 record(s)" in err, err
    assert "copied by the object store" in out
    with open_cache(m) as store:
        assert store.verify() == [] and len(store) == 6


def test_mismatched_s3_inputs_are_refused_in_one_line_and_nothing_is_written(
    s3: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, m = _url("odd-a"), _url("odd-b"), _url("odd-m")
    write_cache(a, range(2))
    write_cache(b, range(2, 4), settings={**SETTINGS, "num_inference_steps": 5})
    code, _, err = _run(capsys, "cache", "merge", a, b, "--out", m)
    assert code != 0 and err.count("error:") == 1 and "Traceback" not in err
    assert "settings.num_inference_steps" in err and a in err and b in err
    assert _objects(m) == {}


def test_an_s3_output_holding_another_cache_is_refused_and_kept(
    s3: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, c, d = (_url(f"keep-{x}") for x in "abcd")
    for n, cache in enumerate((a, b, c, d)):
        write_cache(cache, range(2 * n, 2 * n + 2))
    foreign = c  # objects no wandistill claim wrote (no marker): refused as foreign
    before = _objects(foreign)
    code, _, err = _run(capsys, "cache", "merge", a, b, "--out", foreign)
    assert code == 2 and "not written by wandistill" in err and err.count("error:") == 1
    assert _objects(foreign) == before
    other = _url("keep-other")  # a cache wandistill wrote, but not this merge's result
    merge(MergeConfig(inputs=(c, d), out=other))
    before = _objects(other)
    code, _, err = _run(capsys, "cache", "merge", a, b, "--out", other)
    assert code == 2 and "already is a cache" in err and err.count("error:") == 1
    assert _objects(other) == before
    code, out, _ = _run(capsys, "cache", "merge", a, b, "--out", _url("keep-m"))
    assert code == 0
    code, out, _ = _run(capsys, "cache", "merge", a, b, "--out", _url("keep-m"))
    assert code == 0 and "nothing to do" in out


def test_an_unreachable_store_is_one_line_and_nothing_is_written(
    s3: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_cache(a, range(2))
    write_cache(b, range(2, 4))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: refused
    forget_clients()
    try:
        code, _, err = _run(capsys, "cache", "merge", str(a), str(b), "--out", _url("gone"))
    finally:
        forget_clients()
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    assert _url("gone") in err and "fix:" in err


@pytest.mark.parametrize("backend", ["webdataset", "zarr"])
def test_an_interrupted_s3_merge_reruns_to_the_same_bytes(
    s3: dict[str, str], backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = _url(f"cut-{backend}-a"), _url(f"cut-{backend}-b")
    write_cache(a, range(0, 4), backend=backend, shard_records=2)
    write_cache(b, range(2, 6), backend=backend, shard_records=2)
    merge(MergeConfig(inputs=(a, b), out=_url(f"cut-{backend}-fresh")))
    from wandistill.cache import merge as merge_mod

    def killed(*_: object) -> None:
        raise KeyboardInterrupt

    m = _url(f"cut-{backend}-m")
    with monkeypatch.context() as patch:
        patch.setattr(merge_mod.mf, "write_manifest", killed)
        with pytest.raises(KeyboardInterrupt):
            merge(MergeConfig(inputs=(a, b), out=m))
    left = _objects(m)
    assert left and "manifest.json" not in left  # copies made, nothing committed
    merge(MergeConfig(inputs=(a, b), out=m))
    assert _objects(m) == _objects(_url(f"cut-{backend}-fresh"))
    with open_cache(m) as store:
        assert store.verify() == [] and len(store) == 6


def test_an_input_replaced_after_its_check_is_refused_before_the_manifest(
    s3: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, m = _url("swap-a"), _url("swap-b"), _url("swap-m")
    write_cache(a, range(0, 2), shard_records=2)
    write_cache(b, range(2, 4), shard_records=2)
    write_cache(_url("swap-c"), range(2, 4), shard_records=1)  # other bytes, same keys
    fs = fsspec.filesystem("s3")
    from wandistill.cache import merge as merge_mod

    real = merge_mod.plan

    def swap_then_plan(*args: object, **kw: object) -> object:
        victim = f"{BUCKET}/swap-b/shards/r00000-000000.tar"
        fs.pipe_file(victim, fs.cat_file(f"{BUCKET}/swap-c/shards/r00000-000000.tar"))
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(merge_mod, "plan", swap_then_plan)
    with pytest.raises(merge_mod.CacheError, match="changed after it was verified"):
        merge(MergeConfig(inputs=(a, b), out=m))
    assert "manifest.json" not in _objects(m)
