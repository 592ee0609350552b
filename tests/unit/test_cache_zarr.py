"""zarr v3 cache backend, through the public CacheWriter / CacheStore APIs with backend="zarr"."""

from __future__ import annotations

import json
import multiprocessing as mp
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from wandistill.cache import open_cache, open_writer
from wandistill.cache import zarr_backend as zb
from wandistill.cache.schema import Record, field_specs, record_key

SETTINGS = {"steps": 8, "guidance": 5.0, "max_sequence_length": 24}
C, F, H, W, S = 2, 1, 3, 4, 3
FEATURE_SHAPE = (S, 5, 6)


def make_record(
    i: int,
    *,
    latent: torch.dtype = torch.float32,
    embed: torch.dtype = torch.bfloat16,
    model: torch.dtype | None = None,
    negative: bool | None = None,
) -> Record:
    """Deterministic record i: embedding length varies (0 included), -0.0 and extremes included."""
    g = torch.Generator().manual_seed(1000 + i)

    def lat(*shape: int, dtype: torch.dtype = latent) -> torch.Tensor:
        t = torch.randn(*shape, generator=g) * 3
        t.view(-1)[0] = -0.0
        t.view(-1)[-1] = 60000.0 if dtype == torch.float16 else 1e30
        return t.to(dtype)

    mod = model or latent

    length = (i * 7) % 20  # 0, 7, 14, 1, 8, ...
    neg = (i % 3 == 1) if negative is None else negative
    prompt = f"prompt {i} — ünïcode"
    return Record(
        key=record_key(prompt, i, SETTINGS),
        prompt=prompt,
        seed=i,
        prompt_embeds=torch.randn(length, 8, generator=g).to(embed),
        noise=lat(C, F, H, W),
        timesteps=torch.linspace(999, 100, S) + i,
        xt=lat(S, C, F, H, W, dtype=mod),
        teacher_out=lat(S, C, F, H, W, dtype=mod),
        final_latent=lat(C, F, H, W),
        features={"block_5": lat(*FEATURE_SHAPE, dtype=mod)},
        negative_prompt_embeds=torch.randn(3 + i % 5, 8, generator=g).to(embed) if neg else None,
        extra={"line": i} if i % 2 else {},
    )


def writer(path: Path, *, rank: int = 0, shard_records: int = 3, latent=torch.float32,
           embed=torch.bfloat16, model=None):
    return open_writer(
        path,
        backend="zarr",
        teacher={"fingerprint": "f" * 64, "components": {}},
        settings=SETTINGS,
        fields=field_specs(
            latent_dtype=latent, embed_dtype=embed, model_dtype=model, features=["block_5"]
        ),
        rank=rank,
        shard_records=shard_records,
    )


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(a: torch.Tensor | None, b: torch.Tensor | None, what: str = "") -> None:
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.dtype == b.dtype, what
    assert a.shape == b.shape, what
    assert bits(a) == bits(b), what


def assert_same_record(got: Record, want: Record) -> None:
    assert (got.key, got.prompt, got.seed, got.extra) == (want.key, want.prompt, want.seed,
                                                          want.extra)
    assert got.features.keys() == want.features.keys()
    for name, t in want.tensors().items():
        assert_same(got.tensors().get(name), t, name)
    assert_same(got.negative_prompt_embeds, want.negative_prompt_embeds, "negative")


def all_rows(store) -> list[int]:
    return [e["rows"][0] + i for e in store.entries for i in range(e["records"])]


@pytest.mark.parametrize(
    "latent,embed,model",
    [
        (torch.float32, torch.bfloat16, None),
        (torch.float16, torch.float32, None),
        (torch.bfloat16, torch.bfloat16, None),
        (torch.float32, torch.bfloat16, torch.bfloat16),  # fp32 sampler latents, bf16 model I/O
    ],
)
def test_round_trip_bit_exact(
    tmp_path: Path, latent: torch.dtype, embed: torch.dtype, model: torch.dtype | None
) -> None:
    records = [make_record(i, latent=latent, embed=embed, model=model) for i in range(7)]
    with writer(tmp_path, latent=latent, embed=embed, model=model) as w:
        for r in records:
            assert w.write(r)
    # Readable from the journals before finalize, and identical after.
    for finalize in (False, True):
        if finalize:
            writer(tmp_path, latent=latent, embed=embed, model=model).close(
                finalize=True, complete=True
            )
        with open_cache(tmp_path) as store:
            assert len(store) == 7
            assert [e["records"] for e in store.entries] == [3, 3, 1]
            for r in records:
                assert_same_record(store.read_key(r.key), r)
            assert store.verify() == []

    with open_cache(tmp_path) as store:
        where = store.locate()
        names = ["noise", "xt", "teacher_out", "timesteps", "final_latent", "feature.block_5",
                 "prompt_embeds"]
        for r in records:
            entry, i = where[r.key]
            for step in (0, S - 1):
                got = store.read_sample(entry, i, step, names)
                assert_same(got["xt"], r.xt[step].contiguous(), "xt")
                assert_same(got["teacher_out"], r.teacher_out[step].contiguous(), "teacher_out")
                assert_same(got["timesteps"], r.timesteps[step].contiguous(), "timesteps")
                assert_same(got["feature.block_5"], r.features["block_5"][step].contiguous())
                assert_same(got["noise"], r.noise, "noise")
                assert_same(got["final_latent"], r.final_latent, "final")
                length = r.prompt_embeds.shape[0]
                assert int(got["prompt_len"]) == length
                assert got["prompt_embeds"].shape == (SETTINGS["max_sequence_length"], 8)
                assert_same(got["prompt_embeds"][:length], r.prompt_embeds)
                assert not got["prompt_embeds"][length:].any()
            raw = store.read_sample(entry, i, None, ["prompt_embeds", "xt"], pad=False)
            assert_same(raw["prompt_embeds"], r.prompt_embeds)
            assert_same(raw["xt"], r.xt)
            if r.negative_prompt_embeds is None:
                with pytest.raises(KeyError):
                    store.read_sample(entry, i, None, ["negative_prompt_embeds"])
            else:
                neg = store.read_sample(entry, i, None, ["negative_prompt_embeds"])
                assert_same(neg["negative_prompt_embeds"], r.negative_prompt_embeds)


def test_resume_skips_committed_records(tmp_path: Path) -> None:
    records = [make_record(i) for i in range(7)]
    with writer(tmp_path, shard_records=2) as w:
        for r in records[:5]:
            w.write(r)
    early = open_cache(tmp_path)  # a reader that is open while the arrays grow
    assert early.read_key(records[0].key).key == records[0].key
    with writer(tmp_path, shard_records=2) as w:
        for r in records:
            w.write(r)
        assert (w.records_skipped, w.records_written) == (5, 2)
    new = early.refresh()
    assert [k for e in new for k in e["keys"]] == [r.key for r in records[5:]]
    for r in records:  # rows past the array shape it first saw: re-opened, not an error
        assert_same_record(early.read_key(r.key), r)
    early.close()
    with open_cache(tmp_path) as store:
        assert len(store) == 7
        rows = all_rows(store)
        assert len(set(rows)) == 7
        assert sorted(store.locate()) == sorted(r.key for r in records)
        for r in records:
            assert_same_record(store.read_key(r.key), r)
        assert store.verify() == []


def test_uncommitted_rows_are_ignored(tmp_path: Path) -> None:
    """A writer killed after its sink wrote data but before the journal commit leaves reserved
    rows behind; readers never see them, and the next writer claims fresh rows."""
    records = [make_record(i) for i in range(4)]
    with writer(tmp_path, shard_records=4):
        pass
    ghost = zb.ZarrSink(tmp_path)
    ghost.begin("r00009-000000")
    for r in records[:2]:
        ghost.add(r)
    ghost_entry = ghost.end()  # data written, never journaled
    aborted = zb.ZarrSink(tmp_path)
    aborted.begin("r00008-000000")
    aborted.add(records[3])
    aborted.abort()
    with writer(tmp_path, shard_records=4) as w:
        for r in records:
            assert w.write(r)
    with open_cache(tmp_path) as store:
        assert len(store) == 4
        (entry,) = store.entries
        assert entry["rows"][0] >= ghost_entry["reserved"][1]
        for r in records:
            assert_same_record(store.read_key(r.key), r)
        assert store.verify() == []


def _write_rank(path: str, rank: int, indices: list[int], block: int) -> None:
    zb.BLOCK_RECORDS = block  # module default, read when a sink creates the group
    with writer(Path(path), rank=rank, shard_records=block) as w:
        for i in indices:
            w.write(make_record(i))


@pytest.mark.parametrize("block", [2, 64])
def test_concurrent_writer_threads_lose_no_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    monkeypatch.setattr(zb, "BLOCK_RECORDS", block)
    jobs = {rank: list(range(rank, 40, 4)) for rank in range(4)}
    errors: list[BaseException] = []
    # The manifest's temp name is pid-unique, not thread-unique: create the cache up front so
    # the threads race only on the zarr data (processes, the real case, race on both).
    writer(tmp_path).close()

    def run(rank: int) -> None:
        try:
            with writer(tmp_path, rank=rank, shard_records=block) as w:
                for i in jobs[rank]:
                    w.write(make_record(i))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    _check_all_there(tmp_path, 40, block)


def test_concurrent_writer_processes_lose_no_rows(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_write_rank, args=(str(tmp_path), rank, list(range(rank, 24, 2)), 2))
        for rank in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    _check_all_there(tmp_path, 24, 2)


def _check_all_there(path: Path, n: int, block: int) -> None:
    writer(path).close(finalize=True, complete=True)
    with open_cache(path) as store:
        assert len(store) == n
        rows = all_rows(store)
        assert len(set(rows)) == n
        for e in store.entries:  # every writer shard starts on its own zarr shard
            assert e["rows"][0] % block == 0
        for i in range(n):
            r = make_record(i)
            assert_same_record(store.read_key(r.key), r)
        assert store.verify() == []
    group = zarr.open_group(path / "data.zarr", mode="r")
    assert group["noise"].shards[0] == block


def test_stock_zarr_reads_the_cache(tmp_path: Path) -> None:
    """Reading a zarr cache without wandistill, only zarr + json + numpy (+ torch for bf16):

        man = json.load(open(cache / "manifest.json"))      # the commit record
        g = zarr.open_group(cache / "data.zarr", mode="r")
        for e in man["shards"]:
            for i, key in enumerate(e["keys"]):
                row = e["rows"][0] + i                       # rows are per shard entry
                meta = e["meta"][i]                          # key, prompt, seed, extra
                noise = g["noise"][row]                      # (C,F,H,W); xt[row, step]
                start, n = g["prompt_embeds/offsets"][row]   # ragged, not padded
                emb = g["prompt_embeds/values"][start : start + n]   # (n, D)
                if g["prompt_embeds/values"].attrs.get("wandistill_dtype") == "bfloat16":
                    emb = torch.from_numpy(emb.view(np.int16)).view(torch.bfloat16)

    Rows outside the manifest's entries (reserved, never committed) must be ignored.
    """
    records = {r.key: r for r in (make_record(i, latent=torch.bfloat16) for i in range(5))}
    with writer(tmp_path, latent=torch.bfloat16) as w:
        for r in records.values():
            w.write(r)
    writer(tmp_path, latent=torch.bfloat16).close(finalize=True, complete=True)

    man = json.loads((tmp_path / "manifest.json").read_text())
    g = zarr.open_group(tmp_path / "data.zarr", mode="r")

    def as_torch(arr: zarr.Array, a: np.ndarray) -> torch.Tensor:
        if arr.attrs.get("wandistill_dtype") == "bfloat16":
            assert a.dtype == np.uint16
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    seen = 0
    for e in man["shards"]:
        assert e["file"] == "data.zarr"
        for i, key in enumerate(e["keys"]):
            r = records[key]
            row = e["rows"][0] + i
            assert e["meta"][i]["prompt"] == r.prompt
            assert_same(as_torch(g["noise"], g["noise"][row]), r.noise)
            assert_same(as_torch(g["xt"], g["xt"][row, 1]), r.xt[1].contiguous())
            assert_same(as_torch(g["timesteps"], g["timesteps"][row]), r.timesteps)
            values = g["prompt_embeds/values"]
            start, n = (int(x) for x in g["prompt_embeds/offsets"][row])
            assert_same(as_torch(values, values[start : start + n]), r.prompt_embeds)
            nstart, nn = (int(x) for x in g["negative_prompt_embeds/offsets"][row])
            if r.negative_prompt_embeds is None:
                assert (nstart, nn) == (-1, -1)
            else:
                nvals = g["negative_prompt_embeds/values"]
                assert_same(as_torch(nvals, nvals[nstart : nstart + nn]),
                            r.negative_prompt_embeds)
            seen += 1
    assert seen == 5


def _written(tmp_path: Path) -> tuple[list[Record], dict]:
    records = [make_record(i) for i in range(6)]
    with writer(tmp_path, shard_records=3) as w:
        for r in records:
            w.write(r)
    writer(tmp_path).close(finalize=True, complete=True)
    with open_cache(tmp_path) as store:
        assert store.verify() == []
        return records, store.entries[1]


def test_verify_reports_deleted_shard_file(tmp_path: Path) -> None:
    records, entry = _written(tmp_path)
    rel = next(k for k in entry["sha256"] if k.startswith("xt/"))
    (tmp_path / "data.zarr" / rel).unlink()
    with open_cache(tmp_path) as store:
        problems = store.verify()
    assert problems
    assert all(entry["name"] in p for p in problems)
    for key in entry["keys"]:  # every record of that zarr shard is named
        assert any(key in p and "missing" in p and rel in p for p in problems), problems


def test_verify_reports_flipped_byte(tmp_path: Path) -> None:
    records, entry = _written(tmp_path)
    rel = next(k for k in entry["sha256"] if k.startswith("noise/"))
    path = tmp_path / "data.zarr" / rel
    data = bytearray(path.read_bytes())
    data[5] ^= 0x01  # inside the first inner chunk: this entry's first record
    path.write_bytes(bytes(data))
    with open_cache(tmp_path) as store:
        problems = store.verify()
        with pytest.raises(ValueError, match="checksum"):  # crc32c guards every read too
            store.read_record(entry, 0)
    assert any("sha256 mismatch" in p and entry["name"] in p and rel in p for p in problems)
    assert any(entry["keys"][0] in p and "checksum" in p for p in problems), problems
