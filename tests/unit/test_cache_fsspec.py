"""Caches at fsspec URLs, against a real S3 server on 127.0.0.1 (moto): the same records as a
local cache, the same commit rules (only what a journal or the manifest names is read), one
writer per cache through a lease lock, and every bad input one line naming the URL and the fix.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsspec
import pytest
import torch
import zarr

from wandistill.cache.manifest import load_committed
from wandistill.cache.reader import open_cache
from wandistill.cache.training import TrainingReader
from wandistill.cli import main
from wandistill.errors import UsageError
from wandistill.io import lease, outputs, storage, storage_errors, storage_fsspec
from wandistill.runtime import waiting

from cachefixtures import make_record, write_cache
from s3server import BUCKET, forget_clients, hostile_endpoints, s3_server


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    with s3_server() as env:
        yield env


@pytest.fixture(scope="module")
def hostile() -> Iterator[dict[str, str]]:
    """Endpoints that are not a working S3 (tests/s3server.py)."""
    with hostile_endpoints() as urls:
        yield urls


def _url(name: str) -> str:
    return f"s3://{BUCKET}/{name}"


def _fs() -> fsspec.AbstractFileSystem:
    return fsspec.filesystem("s3")


def _samples(cache: str | Path) -> list[dict[str, torch.Tensor]]:
    reader = TrainingReader(cache, batch_size=2, num_threads=2)
    return list(itertools.islice(reader, reader.batches_per_epoch()))  # one epoch (it cycles)


def test_a_cache_on_s3_holds_the_same_bytes_and_samples_as_a_local_one(
    s3: dict[str, str], tmp_path: Path
) -> None:
    write_cache(tmp_path / "local", range(6), shard_records=4)
    write_cache(_url("same"), range(6), shard_records=4)
    local, remote = load_committed(tmp_path / "local"), load_committed(_url("same"))
    assert [s.frame_sha256 for s in remote.shards] == [s.frame_sha256 for s in local.shards]
    with open_cache(_url("same")) as store:
        assert store.verify() == []
        assert store.read_shared().keys() == {"negative_prompt_embeds", "sigmas"}
    for a, b in zip(_samples(tmp_path / "local"), _samples(_url("same")), strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))


def test_a_shard_object_no_journal_names_is_never_read(s3: dict[str, str]) -> None:
    write_cache(_url("orphan"), range(4), shard_records=4)
    fs = _fs()
    shard = f"{BUCKET}/orphan/shards/r00000-000000.tar"
    fs.pipe_file(f"{BUCKET}/orphan/shards/r00000-000001.tar", fs.cat_file(shard))
    m = load_committed(_url("orphan"))
    assert [s.name for s in m.shards] == ["r00000-000000"] and m.num_records == 4


def test_an_aborted_shard_upload_leaves_no_object(s3: dict[str, str]) -> None:
    writer = write_cache(_url("aborted"), range(2), shard_records=2, finalize=False)
    writer.write(make_record(7))  # a third record opens a second shard...
    writer.abort()  # ...which a failure drops
    names = _fs().find(f"{BUCKET}/aborted/shards")
    assert names == [f"{BUCKET}/aborted/shards/r00000-000000.tar"]
    assert load_committed(_url("aborted")).num_records == 2


def test_a_partially_uploaded_shard_is_named_by_verify_and_refused_by_the_reader(
    s3: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    write_cache(_url("partial"), range(4), shard_records=4)
    fs = _fs()
    shard = f"{BUCKET}/partial/shards/r00000-000000.tar"
    fs.pipe_file(shard, fs.cat_file(shard)[:5000])
    with open_cache(_url("partial")) as store:
        assert store.unusable() == {
            "r00000-000000": "shard r00000-000000: file shards/r00000-000000.tar has 5000 bytes, "
            f"the manifest says {store.entries[0].bytes} (truncated or replaced)"
        }
    with pytest.raises(SystemExit) as e:
        main(["cache", "verify", _url("partial")])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "shard r00000-000000: 5000 bytes on disk, manifest says" in err


def test_cache_info_and_verify_take_an_s3_url(
    s3: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    write_cache(_url("cli"), range(3), shard_records=2)
    main(["cache", "verify", _url("cli")])
    assert f"OK: 3 records in 2 shards of {_url('cli')} verified" in capsys.readouterr().out
    main(["cache", "info", "--json", _url("cli")])
    assert json.loads(capsys.readouterr().out)["complete"] is True


# --------------------------------------------------------------------------- one writer


def test_a_live_writer_holds_an_s3_cache_and_a_second_claim_names_it(s3: dict[str, str]) -> None:
    url = _url("locked")
    first = outputs.claim(url, "cache")
    try:
        holder = json.loads(_fs().cat_file(f"{BUCKET}/locked/{outputs.LOCK}"))
        assert (holder["host"], holder["pid"]) == (socket.gethostname(), os.getpid())
        with pytest.raises(UsageError) as e:
            outputs.claim(url, "cache")
        assert e.value.message.startswith(f"--out {url!r} is in use by another wandistill")
        assert f"host {socket.gethostname()}, pid {os.getpid()}" in e.value.message
    finally:
        first.release()
    assert not _fs().exists(f"{BUCKET}/locked/{outputs.LOCK}")
    outputs.claim(url, "cache").release()  # free again once released


@pytest.mark.parametrize(
    "holder",
    [
        {"host": socket.gethostname(), "pid": 2**22 + 7, "heartbeat": time.time()},  # killed
        {"host": "elsewhere", "pid": 1, "heartbeat": time.time() - 2 * lease.LOCK_LEASE_S},
    ],
    ids=["dead-pid-on-this-host", "heartbeat-past-its-lease"],
)
def test_a_dead_writers_lock_and_temp_objects_are_taken_over(
    s3: dict[str, str], holder: dict[str, object]
) -> None:
    root = f"{BUCKET}/stale-{holder['host']}"
    fs = _fs()
    fs.pipe_file(f"{root}/{outputs.MARKER}", json.dumps(outputs._marker("cache")).encode())
    fs.pipe_file(f"{root}/{outputs.LOCK}", json.dumps(holder).encode())
    fs.pipe_file(f"{root}/shards/.r00000-000000.tar.123-456.tmp", b"half")
    folder = outputs.claim(f"s3://{root}", "cache")
    try:
        assert json.loads(fs.cat_file(f"{root}/{outputs.LOCK}"))["pid"] == os.getpid()
        assert not fs.exists(f"{root}/shards/.r00000-000000.tar.123-456.tmp")
    finally:
        folder.release()


def _lock(root: str, host: str) -> lease.LeaseLock:
    return lease.LeaseLock(storage.FsspecStorage(f"s3://{root}"), outputs.LOCK, {"host": host})


def test_two_runs_taking_over_one_stale_lock_at_once_end_with_one_holder(
    s3: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """B read the stale lock before A took it over; B's delete (of A's fresh lock) and create
    land while A settles. A yields to B, and B's lock is left alone."""
    root = f"{BUCKET}/race"
    stale = {"host": "gone", "pid": 1, "heartbeat": time.time() - 2 * lease.LOCK_LEASE_S}
    _fs().pipe_file(f"{root}/{outputs.LOCK}", json.dumps(stale).encode())
    a, b = _lock(root, "a"), _lock(root, "b")

    def b_takes_over() -> None:
        b.store.rm(b.rel)
        assert b.store.create(b.rel, b._body())

    monkeypatch.setattr(a, "_settle", b_takes_over)
    assert a.acquire()["host"] == "b" and not a.is_locked
    a.release()  # holds nothing: B's lock stays
    assert json.loads(_fs().cat_file(f"{root}/{outputs.LOCK}"))["token"] == b.token


def test_a_holder_whose_lock_was_taken_over_neither_beats_over_it_nor_deletes_it(
    s3: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = f"{BUCKET}/taken"
    monkeypatch.setattr(lease, "LOCK_SETTLE_S", 0.0)
    a, b = _lock(root, "a"), _lock(root, "b")
    assert a.acquire() is None and a.beat_once() and not a.lost
    _fs().pipe_file(f"{root}/{outputs.LOCK}", b._body())  # presumed dead, taken over by B
    assert not a.beat_once() and a.lost
    a.release()
    assert json.loads(_fs().cat_file(f"{root}/{outputs.LOCK}"))["token"] == b.token


def test_an_s3_prefix_holding_foreign_objects_is_refused(s3: dict[str, str]) -> None:
    _fs().pipe_file(f"{BUCKET}/foreign/notes.txt", b"mine")
    with pytest.raises(UsageError, match="is not empty and was not written by wandistill"):
        outputs.claim(_url("foreign"), "cache")
    assert _fs().cat_file(f"{BUCKET}/foreign/notes.txt") == b"mine"


# --------------------------------------------------------------------------- bad inputs


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    # A slow call may first say what it waits for (after 3 s: load decides whether it shows).
    err = "".join(line for line in err.splitlines(True) if not line.startswith("waiting: "))
    assert "Traceback" not in err and err.startswith("error: "), err
    return err


@pytest.mark.parametrize(
    ("env", "url", "message", "fix"),
    [
        (
            {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"},
            _url("c"),
            "cannot be reached",
            "AWS_ENDPOINT_URL",
        ),
        (
            {"AWS_ENDPOINT_URL": "{stalled}", "WANDISTILL_STORAGE_TIMEOUT": "0.5"},
            _url("c"),
            "accepted the connection but did not answer within 0.5 s",
            "WANDISTILL_STORAGE_TIMEOUT",
        ),
        (
            {"AWS_ENDPOINT_URL": "{not_s3}"},
            _url("c"),
            "answered, but not as an S3 server",
            "point AWS_ENDPOINT_URL at the S3 API",
        ),
        (
            {
                "AWS_ACCESS_KEY_ID": None,
                "AWS_SECRET_ACCESS_KEY": None,
                "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                "AWS_CONFIG_FILE": "/nonexistent",
            },
            _url("c"),
            "no credentials for the object store",
            "AWS_ACCESS_KEY_ID",
        ),
        ({}, "s3://no-such-bucket/c", "the bucket 'no-such-bucket' does not exist", "create"),
        ({}, "gs://somewhere/c", "no fsspec backend for gs:// is installed", "wandistill[gcs]"),
    ],
    ids=[
        "unreachable-endpoint",
        "stalled-endpoint",
        "not-s3",
        "no-credentials",
        "no-bucket",
        "no-backend",
    ],
)
def test_a_bad_object_store_is_one_line_naming_the_url_and_the_fix(
    s3: dict[str, str],
    hostile: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    env: dict[str, str | None],
    url: str,
    message: str,
    fix: str,
) -> None:
    for k, v in env.items():
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v.format(**hostile))
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if the [gcs] extra were not installed
    forget_clients()
    try:
        for argv in (["cache", "info", url], ["cache", "verify", url]):
            err = _fails(argv, capsys)
            assert url in err.splitlines()[0] and message in err.splitlines()[0], err
            assert fix in err.splitlines()[1], err
    finally:
        forget_clients()


def test_a_zarr_cache_on_s3_holds_the_same_files_and_samples_as_a_local_one(
    s3: dict[str, str], tmp_path: Path
) -> None:
    write_cache(tmp_path / "local", range(5), backend="zarr", shard_records=2)
    write_cache(_url("zarr"), range(5), backend="zarr", shard_records=2)
    local, remote = load_committed(tmp_path / "local"), load_committed(_url("zarr"))
    assert [s.sha256 for s in remote.shards] == [s.sha256 for s in local.shards]
    with open_cache(_url("zarr")) as store, open_cache(tmp_path / "local") as mine:
        assert store.verify() == []
        for a, b in zip(store.records(), mine.records(), strict=True):
            assert a.key == b.key and torch.equal(a.xt, b.xt)
    for a, b in zip(_samples(tmp_path / "local"), _samples(_url("zarr")), strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
    stock = zarr.open_group(f"s3://{BUCKET}/zarr/data.zarr", mode="r")  # stock zarr reads it
    assert stock["xt"].shape[0] == stock["prompt_embeds/offsets"].shape[0] >= 5


def test_two_writers_on_one_s3_zarr_cache_claim_disjoint_rows(
    s3: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lease, "LOCK_SETTLE_S", 0.05)  # (moto answers at once)
    with ThreadPoolExecutor(2) as pool:
        jobs = [
            pool.submit(write_cache, _url("zarr2"), idx, backend="zarr", shard_records=2, rank=r)
            for r, idx in enumerate([range(0, 5), range(5, 9)])
        ]
        [j.result() for j in jobs]
    m = load_committed(_url("zarr2"))
    rows = sorted(tuple(s.rows) for s in m.shards)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(rows)), rows
    with open_cache(_url("zarr2")) as store:
        assert store.verify() == []
        assert sorted(r.seed for r in store.records()) == list(range(9))
    assert not _fs().exists(f"{BUCKET}/zarr2/data.zarr.lock")  # each claim released its lock


def test_a_dead_writers_zarr_claim_lock_is_taken_over(s3: dict[str, str]) -> None:
    dead = {"host": socket.gethostname(), "pid": 2**22 + 7, "heartbeat": time.time()}  # killed
    _fs().pipe_file(f"{BUCKET}/zarr3/data.zarr.lock", json.dumps(dead).encode())
    write_cache(_url("zarr3"), range(3), backend="zarr", shard_records=2)
    assert load_committed(_url("zarr3")).num_records == 3


def test_verify_names_a_missing_and_a_truncated_zarr_shard_object(
    s3: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    write_cache(_url("zarr4"), range(4), backend="zarr", shard_records=2)
    fs = _fs()
    xt = f"{BUCKET}/zarr4/data.zarr/xt/c/0/0/0/0/0/0"
    noise = f"{BUCKET}/zarr4/data.zarr/noise/c/0/0/0/0/0"
    fs.rm_file(xt)
    fs.pipe_file(noise, fs.cat_file(noise)[:100])
    with pytest.raises(SystemExit) as e:
        main(["cache", "verify", _url("zarr4")])
    err = capsys.readouterr().err
    assert e.value.code == 1
    assert "data.zarr/xt/c/0/0/0/0/0/0 is missing" in err, err
    assert "data.zarr/noise/c/0/0/0/0/0 sha256 mismatch" in err, err


def test_a_polling_reader_on_s3_rereads_only_the_journal_objects_that_changed(
    s3: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from wandistill.cache import journal as jn
    from wandistill.cache import manifest as mf
    from wandistill.cache.reader import CacheReader

    monkeypatch.setattr(jn, "JOURNAL_SEGMENT_BYTES", 1200)  # a few shards per segment
    url = _url("follow-memo")
    write_cache(url, range(6), shard_records=1, finalize=False, complete=False)
    store = CacheReader(url)
    reads: list[str] = []
    real = storage.FsspecStorage.read

    def counting(self, rel, **kw):  # noqa: ANN001, ANN202
        reads.append(rel)
        return real(self, rel, **kw)

    monkeypatch.setattr(storage.FsspecStorage, "read", counting)
    assert store.refresh() == [] and reads == []  # ETags unchanged: nothing read
    segments = mf.journal_segments(storage.open_storage(url), "webdataset")
    assert len(segments) >= 2
    write_cache(url, range(9), shard_records=1, finalize=False, complete=False)
    reads.clear()
    new = store.refresh()
    assert [e.name for e in new] == [f"r00000-{i:06d}" for i in (6, 7, 8)]
    sealed = {s.rel for s in segments[:-1]}
    assert reads and not sealed & set(reads)  # sealed segments were not read again
    mf.finalize(storage.open_storage(url), complete=True)
    assert store.refresh() == [] and store.complete
    assert [e.name for e in store.entries] == [f"r00000-{i:06d}" for i in range(9)]


def test_a_fresh_cache_is_written_to_a_bucket_whose_name_contains_bucket(
    s3: dict[str, str],
) -> None:
    """A not-found for a new prefix of `my-bucket` is just not found (its text holds "bucket");
    only the S3 error code NoSuchBucket means there is no bucket."""
    _fs().mkdir("my-bucket")
    url = "s3://my-bucket/fresh/cache"
    write_cache(url, range(3), shard_records=2)
    assert load_committed(url).num_records == 3


def _client_error(code: str, status: int, headers: dict[str, str]) -> Exception:
    from botocore.exceptions import ClientError

    meta = {"HTTPStatusCode": status, "HTTPHeaders": headers}
    return ClientError({"Error": {"Code": code, "Message": ""}, "ResponseMetadata": meta}, "Get")


@pytest.mark.parametrize(
    ("code", "status", "headers", "kind"),
    [
        ("AccessDenied", 403, {"x-amz-request-id": "1"}, "forbidden"),
        ("", 403, {"x-amz-request-id": "1"}, "forbidden"),
        ("InvalidAccessKeyId", 403, {"x-amz-request-id": "1"}, "bad-credentials"),
        ("NoSuchBucket", 404, {"x-amz-request-id": "1"}, "no-bucket"),
        ("NoSuchKey", 404, {"x-amz-request-id": "1"}, "not-found"),
        ("", 404, {"server": "nginx"}, "not-s3"),
        ("PreconditionFailed", 412, {"x-amzn-requestid": "1"}, "exists"),
    ],
)
def test_object_store_errors_are_classified_by_type_and_status_not_by_words(
    code: str, status: int, headers: dict[str, str], kind: str
) -> None:
    """The message words are the same ("bucket" everywhere) in every case: the kind comes
    from the error code, the HTTP status and the S3 headers, through s3fs's wrapping too."""
    wrapped = FileNotFoundError("no such bucket here")  # as s3fs raises it, botocore's as cause
    wrapped.__cause__ = _client_error(code, status, headers)
    assert storage_errors.classify(wrapped) == kind
    assert storage_errors.storage_error("s3://b/x", wrapped).kind == kind


@pytest.mark.parametrize(
    "beat",
    [time.time() + 86_400, "NaN", float("inf"), "garbage", None, [1]],
    ids=["a-day-ahead", "nan-text", "inf", "garbage", "missing", "a-list"],
)
def test_a_lock_with_an_unbelievable_heartbeat_expires_on_the_readers_clock(
    s3: dict[str, str], capsys: pytest.CaptureFixture[str], beat: object
) -> None:
    """Future, NaN or garbage heartbeats never make a lock immortal: unchanged for a lease on
    the reader's own clock, it is stale and taken over, with one line saying it waits."""
    root = f"{BUCKET}/beat-{abs(hash(str(beat)))}"
    holder = {"host": "elsewhere", "pid": 1, "token": "theirs"}
    if beat is not None:
        holder["heartbeat"] = beat
    _fs().pipe_file(f"{root}/{outputs.LOCK}", json.dumps(holder).encode())
    lock = lease.LeaseLock(
        storage.FsspecStorage(f"s3://{root}"), outputs.LOCK, {"host": "me"}, lease_s=0.3
    )
    assert lock.acquire() is None
    try:
        assert json.loads(_fs().cat_file(f"{root}/{outputs.LOCK}"))["token"] == lock.token
        err = capsys.readouterr().err
        assert f"waiting: lock object s3://{root}/{outputs.LOCK} has heartbeat" in err, err
    finally:
        lock.release()


def test_a_live_holder_with_a_clock_ahead_is_not_taken_over(s3: dict[str, str]) -> None:
    """A future heartbeat that keeps changing is a live writer: refused, naming the lock
    object and how to remove it safely."""
    root = f"{BUCKET}/ahead"
    store = storage.FsspecStorage(f"s3://{root}")
    writer = lease.LeaseLock(store, outputs.LOCK, {"host": "ahead", "pid": 1}, lease_s=0.4)
    stop = threading.Event()

    def beat_from_the_future() -> None:
        while not stop.wait(0.05):
            body = {**writer.me, "token": writer.token, "heartbeat": time.time() + 3600}
            body["n"] = time.monotonic_ns()
            _fs().pipe_file(f"{root}/{outputs.LOCK}", json.dumps(body).encode())

    t = threading.Thread(target=beat_from_the_future)
    t.start()
    try:
        time.sleep(0.2)
        reader = lease.LeaseLock(store, outputs.LOCK, {"host": "me"}, lease_s=0.4)
        holder = reader.acquire()
        assert holder is not None and holder.get("host") == "ahead"
        e = reader.refusal(holder, "--out 'x'", "--out")
        assert f"lock object is s3://{root}/{outputs.LOCK}" in e.message
        assert f"aws s3 rm s3://{root}/{outputs.LOCK}" in (e.fix or "")
    finally:
        stop.set()
        t.join()


def test_a_slow_object_store_call_says_what_it_waits_for(
    s3: dict[str, str],
    hostile: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An endpoint that accepts and never answers: one `waiting:` line naming the object and
    the bounds, then the one-line error once the bounded attempts are spent."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", hostile["stalled"])
    monkeypatch.setenv("WANDISTILL_STORAGE_TIMEOUT", "1")
    monkeypatch.setattr(storage_fsspec, "_WATCHED", waiting.Watched(notice_s=0.2))  # its own clock
    forget_clients()
    try:
        with pytest.raises(SystemExit) as e:
            main(["cache", "info", _url("c")])
    finally:
        forget_clients()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("error:") == 1, err
    assert err.count("waiting: object store s3://") >= 1, err  # one per 10 s while it lasts
    assert "no answer for" in err and "each attempt gives up after" in err, err
