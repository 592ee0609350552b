"""zarr v3 cache backend, through the public CacheWriter / CacheReader APIs with backend="zarr"."""

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
from wandistill.cache.contract import Record, field_specs, record_key
from wandistill.cache.files import ZarrEntry
from wandistill.cache.zarr import layout as zl
from wandistill.cache.zarr import reader as zr
from wandistill.cache.zarr import writer as zw
from wandistill.io.storage import open_storage

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


def writer(
    path: Path,
    *,
    rank: int = 0,
    shard_records: int = 3,
    latent=torch.float32,
    embed=torch.bfloat16,
    model=None,
):
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
    assert (got.key, got.prompt, got.seed, got.extra) == (
        want.key,
        want.prompt,
        want.seed,
        want.extra,
    )
    assert got.features.keys() == want.features.keys()
    for name, t in want.tensors().items():
        assert_same(got.tensors().get(name), t, name)
    assert_same(got.negative_prompt_embeds, want.negative_prompt_embeds, "negative")


def all_rows(store) -> list[int]:
    return [e.rows[0] + i for e in store.entries for i in range(e.records)]


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
            assert [e.records for e in store.entries] == [3, 3, 1]
            for r in records:
                assert_same_record(store.read_key(r.key), r)
            assert store.verify() == []

    with open_cache(tmp_path) as store:
        where = store.locate()
        names = [
            "noise",
            "xt",
            "teacher_out",
            "timesteps",
            "final_latent",
            "feature.block_5",
            "prompt_embeds",
        ]
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
    assert [k for e in new for k in e.keys] == [r.key for r in records[5:]]
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
    ghost = zw.ZarrSink(open_storage(tmp_path))
    ghost.begin("r00009-000000")
    for r in records[:2]:
        ghost.add(r)
    ghost_entry = ghost.end()  # data written, never journaled
    aborted = zw.ZarrSink(open_storage(tmp_path))
    aborted.begin("r00008-000000")
    aborted.add(records[3])
    aborted.abort()
    with writer(tmp_path, shard_records=4) as w:
        for r in records:
            assert w.write(r)
    with open_cache(tmp_path) as store:
        assert len(store) == 4
        (entry,) = store.entries
        assert entry.rows[0] >= ghost_entry["reserved"][1]
        for r in records:
            assert_same_record(store.read_key(r.key), r)
        assert store.verify() == []


def _write_rank(path: str, rank: int, indices: list[int], block: int) -> None:
    zw.BLOCK_RECORDS = block  # module default, read when a sink creates the group
    with writer(Path(path), rank=rank, shard_records=block) as w:
        for i in indices:
            w.write(make_record(i))


@pytest.mark.parametrize("block", [2, 64])
def test_concurrent_writer_threads_lose_no_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    monkeypatch.setattr(zw, "BLOCK_RECORDS", block)
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


@pytest.mark.slow
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
            assert e.rows[0] % block == 0
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
                assert_same(as_torch(nvals, nvals[nstart : nstart + nn]), r.negative_prompt_embeds)
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
    rel = next(k for k in entry.sha256 if k.startswith("xt/"))
    (tmp_path / "data.zarr" / rel).unlink()
    with open_cache(tmp_path) as store:
        problems = store.verify()
    assert problems
    assert all(entry.name in p for p in problems)
    for key in entry.keys:  # every record of that zarr shard is named
        assert any(key in p and "missing" in p and rel in p for p in problems), problems


def test_verify_reports_flipped_byte(tmp_path: Path) -> None:
    records, entry = _written(tmp_path)
    rel = next(k for k in entry.sha256 if k.startswith("noise/"))
    path = tmp_path / "data.zarr" / rel
    data = bytearray(path.read_bytes())
    data[5] ^= 0x01  # inside the first inner chunk: this entry's first record
    path.write_bytes(bytes(data))
    with open_cache(tmp_path) as store:
        problems = store.verify()
        with pytest.raises(ValueError, match="checksum"):  # crc32c guards every read too
            store.read_record(entry, 0)
    assert any("sha256 mismatch" in p and entry.name in p and rel in p for p in problems)
    assert any(entry.keys[0] in p and "checksum" in p for p in problems), problems


# --------------------------------------------------------------------------- reads, every path


ALL_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
]


def _all_dtype_record(i: int) -> Record:
    """A record whose features cover every storable dtype (step fields and per-row shapes)."""
    r = make_record(i, latent=torch.bfloat16)
    g = torch.Generator().manual_seed(7 + i)
    for dt in ALL_DTYPES:
        raw = (
            torch.randint(0, 255, (S, 2, 5), generator=g)
            if not dt.is_floating_point
            else (torch.randn(S, 2, 5, generator=g) * 100)
        )
        r.features[str(dt).split(".")[1]] = raw.to(dt)
    r.features["flat"] = torch.randn(S, generator=g).to(torch.bfloat16)  # (S,): one chunk a row
    return r


def _sink_entries(path: Path, records: list[Record], per_shard: int, **kw) -> list[ZarrEntry]:
    """Write `records` with ZarrSink directly; entries as CacheWriter would journal them."""
    sink = zw.ZarrSink(open_storage(path), **kw)
    entries = []
    for k in range(0, len(records), per_shard):
        sink.begin(f"r00000-{k:06d}")
        part = records[k : k + per_shard]
        for r in part:
            sink.add(r)
        entry = sink.end()
        entry.update(name=f"r00000-{k:06d}", rank=0, records=len(part), keys=[r.key for r in part])
        entries.append(ZarrEntry.model_validate(entry, strict=True))
    return entries


def _steps_of(name: str, t: torch.Tensor) -> list[int | None]:
    from wandistill.cache.contract import is_step_field

    return [None, 0, t.shape[0] - 1, -1] if is_step_field(name) and t.dim() else [None]


def _stock(group: zarr.Group, path: str, selection) -> torch.Tensor:
    """What stock zarr reads, as the documented snippet turns it into a tensor."""
    arr = group[path]
    value = np.asarray(arr[selection])
    if arr.attrs.get("wandistill_dtype") == "bfloat16":
        return torch.from_numpy(value.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(value.copy())


def test_every_dtype_reads_bit_exact_through_the_source_and_stock_zarr(tmp_path: Path) -> None:
    records = [_all_dtype_record(i) for i in range(7)]
    entries = _sink_entries(tmp_path, records, 3, block_records=2, token_chunk=4, token_block=8)
    src = zr.ZarrSource(tmp_path)
    group = zarr.open_group(tmp_path / "data.zarr", mode="r")
    k = 0
    for entry in entries:
        for i in range(entry.records):
            want = records[k]
            k += 1
            row = entry.rows[0] + i
            assert_same_record(src.read_record(entry, i), want)
            for name, t in want.tensors().items():
                for step in _steps_of(name, t):
                    a = src.read_tensors(entry, i, {name: step})[name]
                    assert_same(a, t if step is None else t[step].contiguous(), f"{name} {step}")
                    assert a.is_contiguous() and a.dtype == t.dtype
                    if name not in RAGGED_NAMES:
                        sel = row if step is None else (row, step)
                        assert_same(_stock(group, name, sel), a, f"stock {name} {step}")
            for name in RAGGED_NAMES:
                if name in want.tensors():
                    offs = src.offsets(entry, name)
                    stock = group[f"{name}/offsets"][entry.rows[0] : entry.rows[1]]
                    assert (offs == stock).all()
    src.close()


RAGGED_NAMES = ("prompt_embeds", "negative_prompt_embeds")


def test_offsets_cover_every_record_whichever_shard_brings_a_negative(tmp_path: Path) -> None:
    """negative_prompt_embeds/offsets has a row for every committed record, [-1, -1] where the
    record has none, even for shards written before the array existed and shards without any
    negative written after (docs/cache-format.md)."""
    pattern = [False, False, True, False, False, False, True, True, False]
    records = [make_record(i, negative=neg) for i, neg in enumerate(pattern)]
    with writer(tmp_path, shard_records=2) as w:
        for r in records:
            w.write(r)
    writer(tmp_path).close(finalize=True, complete=True)
    man = json.loads((tmp_path / "manifest.json").read_text())
    g = zarr.open_group(tmp_path / "data.zarr", mode="r")
    by_key = {r.key: r for r in records}
    for e in man["shards"]:
        for i, key in enumerate(e["keys"]):
            row = e["rows"][0] + i
            for name in RAGGED_NAMES:
                offsets = g[f"{name}/offsets"]
                assert offsets.shape[0] > row, (name, row)  # stock read of any committed row
                start, n = (int(x) for x in offsets[row])
                want = getattr(by_key[key], name)
                if want is None:
                    assert (start, n) == (-1, -1)
                else:
                    assert_same(_stock(g, f"{name}/values", slice(start, start + n)), want)
    with open_cache(tmp_path) as store:
        for r in records:
            assert_same_record(store.read_key(r.key), r)
        assert store.verify() == []


def test_typed_entry_round_trips_and_names_a_malformed_field(tmp_path: Path) -> None:
    from wandistill.cache.files import Entries, ZarrEntry
    from wandistill.errors import CacheError

    _, entry = _written(tmp_path)
    assert isinstance(entry, ZarrEntry)
    assert (entry.records, len(entry.keys), entry.rows[1] - entry.rows[0]) == (3, 3, 3)
    with open_cache(tmp_path) as store:
        raw = store.entries.json(1)
    again = Entries(ZarrEntry, [raw])
    assert again[0] == entry and again.json(0) is raw
    for field, value in [("rows", [5, 2]), ("meta", []), ("sha256", "x"), ("file", "../x")]:
        bad = Entries(ZarrEntry, [raw, {**raw, field: value}], where="'m.json'")
        assert bad[0] == entry  # entries are checked one at a time, when used
        with pytest.raises(CacheError, match=rf"'m.json' is corrupt: shards\[1\] \({entry.name}\)"):
            bad[1]


def test_threads_read_bit_exact_with_a_tiny_index_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many threads, an index cache smaller than the indexes in use (evictions): every read is
    still bit-exact and the cache stays within its budget."""
    monkeypatch.setattr(zr, "SMALL_ROW_BYTES", 0)  # these rows are tiny: read them one by one
    records = [make_record(i, latent=torch.bfloat16) for i in range(12)]
    entries = _sink_entries(tmp_path, records, 4, block_records=2, token_chunk=4, token_block=8)
    src = zr.ZarrSource(tmp_path, index_cache_bytes=400)
    jobs = [
        (e, i, records[n * 4 + i], s)
        for n, e in enumerate(entries)
        for i in range(e.records)
        for s in range(S)
    ] * 4
    errors: list[BaseException] = []

    def run(part: list) -> None:
        try:
            for e, i, r, s in part:
                got = src.read_tensors(
                    e,
                    i,
                    {
                        "xt": s,
                        "teacher_out": s,
                        "prompt_embeds": None,
                        "noise": None,
                        "timesteps": s,
                    },
                )
                assert_same(got["xt"], r.xt[s].contiguous())
                assert_same(got["teacher_out"], r.teacher_out[s].contiguous())
                assert_same(got["prompt_embeds"], r.prompt_embeds)
                assert_same(got["noise"], r.noise)
                assert_same(got["timesteps"], r.timesteps[s])
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(jobs[k::6],)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    stats = src.store.indexes.cache_stats()
    assert stats["evictions"] > 0 and stats["hits"] > 0
    assert src.store.indexes.cache_info()["current_size"] <= 400
    src.close()


def test_one_index_read_per_shard_file_then_one_read_per_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading one (record, step) reads that inner chunk; the zarr shard's index is read once
    per shard file and then served from zarr's CacheReader."""
    monkeypatch.setattr(zr, "SMALL_ROW_BYTES", 0)  # these rows are tiny: read them one by one
    from zarr.abc.store import RangeByteRequest, SuffixByteRequest
    from zarr.storage import LocalStore

    records = [make_record(i) for i in range(4)]
    (entry,) = _sink_entries(tmp_path, records, 4, block_records=4)
    src = zr.ZarrSource(tmp_path)
    src.read_tensors(entry, 0, {"xt": 0})  # opens the group and the array
    calls: list[tuple[str, object]] = []
    real_get = LocalStore.get

    async def counting_get(self, key, prototype, byte_range=None):
        calls.append((key, byte_range))
        return await real_get(self, key, prototype, byte_range)

    monkeypatch.setattr(LocalStore, "get", counting_get)
    for i in range(4):
        for s in range(S):
            assert_same(src.read_tensors(entry, i, {"xt": s})["xt"], records[i].xt[s].contiguous())
    assert all(key.startswith("xt/c/") for key, _ in calls), calls
    assert not any(isinstance(r, SuffixByteRequest) for _, r in calls)  # cached by the first read
    assert len(calls) == 4 * S and all(isinstance(r, RangeByteRequest) for _, r in calls)
    src.close()


def _shard_file(tmp_path: Path, entry: dict, prefix: str) -> tuple[str, Path]:
    rel = next(k for k in entry.sha256 if k.startswith(prefix))
    return rel, tmp_path / "data.zarr" / rel


def test_a_missing_inner_chunk_reads_as_the_fill_value(tmp_path: Path) -> None:
    records = [make_record(i) for i in range(4)]
    (entry,) = _sink_entries(tmp_path, records, 4, block_records=4)
    _, path = _shard_file(tmp_path, entry, "xt/")
    size = path.stat().st_size
    # Let zarr itself drop one inner chunk: write fill values with write_empty_chunks off.
    g = zarr.open_group(tmp_path / "data.zarr", mode="r+")
    row = entry.rows[0] + 2
    g["xt"].with_config({"write_empty_chunks": False})[row, 1] = 0
    g["noise"].with_config({"write_empty_chunks": False})[row] = 0
    assert size - path.stat().st_size == C * F * H * W * 4 + 4  # the chunk is really gone
    src = zr.ZarrSource(tmp_path)
    for i, r in enumerate(records):
        got = src.read_record(entry, i)
        want_xt = r.xt.clone()
        want_noise = r.noise.clone()
        if i == 2:
            want_xt[1] = 0
            want_noise.zero_()
        assert_same(got.xt, want_xt)
        assert_same(got.noise, want_noise)
        for s in range(S):
            assert_same(src.read_tensors(entry, i, {"xt": s})["xt"], want_xt[s].contiguous())
    src.close()


def test_a_missing_shard_file_names_shard_record_and_file(tmp_path: Path) -> None:
    records, entry = _written(tmp_path)
    rel, path = _shard_file(tmp_path, entry, "teacher_out/")
    path.unlink()
    with open_cache(tmp_path) as store:
        with pytest.raises(zl.ZarrChunkError) as info:
            store.read_sample(entry, 1, 0, ["teacher_out"])
        msg = str(info.value)
        assert entry.name in msg and entry.keys[1] in msg and rel in msg and "missing" in msg
        assert store.read_sample(entry, 1, 0, ["xt"])["xt"].shape == (C, F, H, W)  # others fine


@pytest.mark.parametrize("how", ["half", "data"])
def test_a_truncated_shard_file_names_the_record(tmp_path: Path, how: str) -> None:
    """`half`: cut in the middle (the index at the end is gone); `data`: the index survives but
    the chunks it points to do not."""
    records, entry = _written(tmp_path)
    rel, path = _shard_file(tmp_path, entry, "xt/")
    data = path.read_bytes()
    if how == "half":
        path.write_bytes(data[: len(data) // 2])
    else:  # a zarr v3 shard index: 16 bytes per inner chunk, then its crc32c
        arr = zarr.open_group(tmp_path / "data.zarr", mode="r")["xt"]
        cut = 16 * int(np.prod([s // c for s, c in zip(arr.shards, arr.chunks, strict=True)])) + 4
        path.write_bytes(data[: (len(data) - cut) // 2] + data[-cut:])
    with open_cache(tmp_path) as store:
        key = entry.keys[2]
        with pytest.raises(zl.ZarrChunkError, match="truncated") as info:
            store.read_sample(entry, 2, 1, ["xt", "prompt_embeds"])
        msg = str(info.value)
        assert entry.name in msg and key in msg and rel in msg
        with pytest.raises(ValueError, match=key):  # also a ValueError, like zarr's checksum error
            store.read_record(entry, 2)
        problems = store.verify()
        assert any(rel in p and "sha256 mismatch" in p for p in problems), problems
        assert any(key in p for p in problems), problems


def test_the_checksum_guards_the_hot_path(tmp_path: Path) -> None:
    records, entry = _written(tmp_path)
    rel, path = _shard_file(tmp_path, entry, "xt/")
    raw = bytearray(path.read_bytes())
    off = raw.find(bits(records[4].xt[2]))  # record 1 of this entry, step 2: its inner chunk
    assert off >= 0 and raw.find(bits(records[4].xt[2]), off + 1) < 0
    raw[off + 3] ^= 0x10
    path.write_bytes(bytes(raw))
    src = zr.ZarrSource(tmp_path)
    with pytest.raises(ValueError, match=f"{entry.keys[1]}.*{rel}.*checksum"):
        src.read_tensors(entry, 1, {"xt": 2})
    assert_same(src.read_tensors(entry, 1, {"xt": 1})["xt"], records[4].xt[1].contiguous())
    src.close()


def test_sink_hashes_what_it_wrote_and_reuses_its_blocks(tmp_path: Path) -> None:
    """Sizes and sha256 in the entry come from the bytes zarr wrote (no read-back): they must
    match the files. A shard larger than the block and a reused block stay intact."""
    import hashlib

    records = [make_record(i) for i in range(9)]
    entries = _sink_entries(tmp_path, records, 5, block_records=2)  # 5 > 2: blocks grow
    total = 0
    for entry in entries:
        size = 0
        for rel, digest in entry.sha256.items():
            data = (tmp_path / "data.zarr" / rel).read_bytes()
            assert hashlib.sha256(data).hexdigest() == digest, rel
            size += len(data)
        assert size == entry.bytes
        assert {rel.split("/c/")[0] for rel in entry.sha256} == {
            *(n for n in entry.fields if n not in RAGGED_NAMES),
            *(f"{n}/{part}" for n in entry.token_rows for part in ("values", "offsets")),
        }
        total += entry.records
    assert total == 9
    src = zr.ZarrSource(tmp_path)
    k = 0
    for entry in entries:
        for i in range(entry.records):
            assert_same_record(src.read_record(entry, i), records[k])
            k += 1
        assert src.verify(entry) == []
    src.close()


def test_sink_fsyncs_every_file_it_wrote_once_before_returning_the_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the journal will name must be durable when `end()` returns: every zarr shard file
    and every zarr.json the shard wrote is fsynced, each file once, and so is every directory
    it wrote into (the renames)."""
    import os

    synced: list[Path] = []
    real = os.fsync

    def record(fd: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    zw.ZarrSink(open_storage(tmp_path), block_records=2)  # nothing written yet
    _sink_entries(tmp_path, [make_record(0)], 1, block_records=2)  # the group and its arrays
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "data.zarr").rglob("*")}
    monkeypatch.setattr(os, "fsync", record)
    (entry,) = _sink_entries(tmp_path, [make_record(i) for i in (1, 2, 3)], 3, block_records=2)
    root = tmp_path / "data.zarr"
    shard_files = {root / rel for rel in entry.sha256}
    metadata = {p for p in root.rglob("zarr.json") if p.stat().st_mtime_ns != before.get(p)}
    files = [p for p in synced if p.is_file()]
    assert shard_files and metadata
    assert set(files) == shard_files | metadata
    assert len(files) == len(set(files))  # once each
    dirs = {p for p in synced if p.is_dir()}
    assert {(root / rel).parent for rel in entry.sha256} <= dirs


def test_sink_rejected_record_leaves_the_shard_unchanged(tmp_path: Path) -> None:
    sink = zw.ZarrSink(open_storage(tmp_path), block_records=4)
    sink.begin("r00000-000000")
    good = [make_record(0), make_record(1)]
    sink.add(good[0])
    bad = make_record(5)
    bad.xt = bad.xt.to(torch.float16)  # dtype differs from the first record's
    with pytest.raises(Exception, match="xt"):
        sink.add(bad)
    sink.add(good[1])
    entry = sink.end()
    entry.update(name="r00000-000000", rank=0, records=2, keys=[r.key for r in good])
    entry = ZarrEntry.model_validate(entry, strict=True)
    src = zr.ZarrSource(tmp_path)
    for i, r in enumerate(good):
        assert_same_record(src.read_record(entry, i), r)
    src.close()


@pytest.mark.parametrize(
    "array,name,step",
    [("prompt_embeds/values", "prompt_embeds", None), ("timesteps", "timesteps", 2)],
)
def test_partly_wanted_chunks_are_checked_too(
    tmp_path: Path, array: str, name: str, step: int | None
) -> None:
    """A sample that wants part of an inner chunk (an embedding's edge chunks, one timestep of a
    row) still has that chunk's crc32c checked, on the training hot path."""
    records, entry = _written(tmp_path)  # records 3, 4, 5: 1, 8 and 15 tokens
    rel, path = _shard_file(tmp_path, entry, f"{array}/")
    raw = bytearray(path.read_bytes())
    raw[1] ^= 0x04  # the shard's first inner chunk: record 3's first token / first timestep
    path.write_bytes(bytes(raw))
    src = zr.ZarrSource(tmp_path)
    with pytest.raises(zl.ZarrChunkError, match=f"{entry.keys[0]}: {name}: .*checksum"):
        src.read_tensors(entry, 0, {name: step})
    if name == "prompt_embeds":  # the same 32-token chunk holds record 4's 8 tokens
        with pytest.raises(zl.ZarrChunkError, match="checksum"):
            src.read_tensors(entry, 1, {name: None})
    else:  # record 4's timesteps are another chunk
        got = src.read_tensors(entry, 1, {name: step})[name]
        assert_same(got, records[4].timesteps[step].contiguous())
    src.close()


def test_disk_full_mid_shard_keeps_committed_shards_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC while zarr writes a shard file: an OSError naming the cache, nothing committed
    lost, and a rerun writes the rest."""
    import errno

    from zarr.storage import LocalStore

    records = [make_record(i) for i in range(6)]
    w = writer(tmp_path, shard_records=3)
    for r in records[:3]:
        w.write(r)
    real_set = LocalStore.set

    async def full(self, key, value):
        if "/c/" in key:
            raise OSError(errno.ENOSPC, "No space left on device")
        return await real_set(self, key, value)

    monkeypatch.setattr(LocalStore, "set", full)
    for r in records[3:5]:
        w.write(r)
    with pytest.raises(OSError, match="No space left") as info:
        w.write(records[5])
    assert info.value.errno == errno.ENOSPC and str(tmp_path) in str(info.value)
    w.abort()
    monkeypatch.setattr(LocalStore, "set", real_set)
    with open_cache(tmp_path) as store:
        assert [k for e in store.entries for k in e.keys] == [r.key for r in records[:3]]
        assert store.verify() == []
    with writer(tmp_path, shard_records=3) as w2:
        for r in records:
            w2.write(r)
        assert (w2.records_skipped, w2.records_written) == (3, 3)
    with open_cache(tmp_path) as store:
        for r in records:
            assert_same_record(store.read_key(r.key), r)
        assert store.verify() == []


def test_a_failed_file_write_is_raised_after_every_other_file_of_the_shard_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard's arrays are written concurrently. When one file's write fails, `end()` raises
    that error only once the other files' writes are over: nothing still writes into the cache
    when the writer aborts."""
    import asyncio
    import errno
    import time

    from zarr.storage import LocalStore

    real_set = LocalStore.set
    finished: list[str] = []

    async def flaky(self, key, value):
        if "/c/" not in key:
            return await real_set(self, key, value)
        if key.startswith("noise/"):
            raise OSError(errno.EIO, "Input/output error")
        await asyncio.sleep(0.05)  # still in flight when the failure comes
        await real_set(self, key, value)
        finished.append(key)

    zw.ZarrSink(open_storage(tmp_path), block_records=2)
    monkeypatch.setattr(LocalStore, "set", flaky)
    with pytest.raises(OSError, match="Input/output error"):
        _sink_entries(tmp_path, [make_record(0), make_record(1)], 2, block_records=2)
    done = list(finished)
    time.sleep(0.2)
    assert done and finished == done
    assert {k.split("/c/")[0] for k in done} >= {"xt", "teacher_out", "final_latent"}


def test_a_shard_written_in_several_gathers_has_the_same_bytes_as_one_gather(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above WRITE_GATHER_BYTES a shard's arrays go out in groups (bounded memory); the files,
    their sha256 and what reads back are the same as with every array in one gather."""
    records = [make_record(i, negative=True) for i in range(5)]
    (one,) = _sink_entries(tmp_path / "one", records, 5, block_records=2)
    monkeypatch.setattr(zw, "WRITE_GATHER_BYTES", 1)  # every array on its own
    (split,) = _sink_entries(tmp_path / "split", records, 5, block_records=2)
    assert one.sha256 == split.sha256 and len(one.sha256) > 4
    src = zr.ZarrSource(tmp_path / "split")
    for i, r in enumerate(records):
        assert_same_record(src.read_record(split, i), r)
    src.close()


@pytest.mark.parametrize(
    "sizes,budget", [([5, 1, 9, 3, 3], 6), ([1, 1, 1], 100), ([7], 1), ([], 4)]
)
def test_writes_group_biggest_first_and_no_group_passes_the_budget_but_a_lone_write(
    sizes: list[int], budget: int
) -> None:
    writes = [(k, slice(0, n), np.zeros(n, dtype=np.uint8)) for k, n in enumerate(sizes)]
    groups = zl._by_bytes(writes, budget)
    flat = [w for g in groups for w in g]
    assert sorted(w[0] for w in flat) == list(range(len(sizes)))
    assert [w[2].nbytes for w in flat] == sorted(sizes, reverse=True)
    for g in groups:
        assert len(g) == 1 or sum(w[2].nbytes for w in g) <= budget
