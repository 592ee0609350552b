"""The training reader: equal batches per rank, deterministic order, exact resume, follow mode."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from wandistill.cache.reader import CacheReader
from wandistill.cache.training import DEFAULT_FIELDS, TrainingReader
from wandistill.errors import CacheError

from cachefixtures import write_cache


def _take(reader: TrainingReader, n: int) -> list[list[tuple[str, int]]]:
    it = iter(reader)
    out = []
    for _ in range(n):
        b = next(it)
        out.append(list(zip(b["key"], b["step_slot"].tolist(), strict=True)))
    return out


def _epoch(path: Path, rank: int, world: int, batch: int = 2, seed: int = 0) -> list:
    r = TrainingReader(path, batch_size=batch, rank=rank, world_size=world, seed=seed)
    return list(_take(r, r.batches_per_epoch()))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_rank_gets_the_same_number_of_batches_from_uneven_shards(
    tmp_path: Path, world: int
) -> None:
    # 11 records in shards of 4, 4, 3: 33 samples; uneven however it is split.
    write_cache(tmp_path, range(11), shard_records=4)
    epochs = [_epoch(tmp_path, r, world) for r in range(world)]
    assert len({len(e) for e in epochs}) == 1
    assert len(epochs[0]) == 33 // (2 * world)
    seen = [s for e in epochs for b in e for s in b]
    assert len(seen) == len(set(seen)), "a sample was given to two ranks"
    # The rank slices of one global batch, concatenated, are the same whatever the world size.
    single = [s for b in _epoch(tmp_path, 0, 1, batch=2 * world) for s in b]
    interleaved = [s for g in zip(*epochs, strict=True) for b in g for s in b]
    assert interleaved == single[: len(interleaved)]


def test_order_is_deterministic_and_depends_on_seed_and_epoch(tmp_path: Path) -> None:
    write_cache(tmp_path, range(6), shard_records=4)
    a = _take(TrainingReader(tmp_path, batch_size=3, seed=1), 12)
    b = _take(TrainingReader(tmp_path, batch_size=3, seed=1), 12)
    c = _take(TrainingReader(tmp_path, batch_size=3, seed=2), 12)
    assert a == b and a != c
    assert a[:6] != a[6:12], "epoch 1 must be reshuffled"
    assert sorted(s for bt in a[:6] for s in bt) == sorted(s for bt in a[6:12] for s in bt)


def test_order_does_not_depend_on_how_the_cache_was_sharded(tmp_path: Path) -> None:
    write_cache(tmp_path / "a", range(7), shard_records=2)
    write_cache(tmp_path / "b", range(7), shard_records=5)
    assert _take(TrainingReader(tmp_path / "a", batch_size=2), 10) == _take(
        TrainingReader(tmp_path / "b", batch_size=2), 10
    )


def test_mid_epoch_resume_continues_exactly(tmp_path: Path) -> None:
    write_cache(tmp_path, range(6), shard_records=4)
    full = _take(TrainingReader(tmp_path, batch_size=4, prefetch_batches=3), 9)
    first = TrainingReader(tmp_path, batch_size=4, prefetch_batches=3)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    assert state["batches_done"] == 3  # not what was prefetched
    resumed = TrainingReader(tmp_path, batch_size=4)
    resumed.load_state_dict(state)
    assert _take(resumed, 6) == full[3:]


def test_resume_with_another_layout_of_the_same_global_batch(tmp_path: Path) -> None:
    write_cache(tmp_path, range(8), shard_records=4)
    one = TrainingReader(tmp_path, batch_size=4)
    it = iter(one)
    for _ in range(2):
        next(it)
    two = [TrainingReader(tmp_path, batch_size=2, rank=r, world_size=2) for r in range(2)]
    for r in two:
        r.load_state_dict(one.state_dict())
    rest_single = _take(one, 3)
    rest_pair = [sum(g, []) for g in zip(*(_take(r, 3) for r in two), strict=True)]
    assert rest_pair == rest_single


def test_batches_hold_padded_embeddings_and_one_step(tmp_path: Path) -> None:
    write_cache(tmp_path, range(4), shard_records=4)
    batch = next(iter(TrainingReader(tmp_path, batch_size=3)))
    assert batch["prompt_embeds"].shape == (3, 24, 32)
    assert batch["xt"].shape == batch["teacher_out"].shape == (3, 16, 1, 4, 4)
    assert batch["timesteps"].shape == (3,)
    for emb, n in zip(batch["prompt_embeds"], batch["prompt_len"], strict=True):
        assert bool((emb[n:] == 0).all()) and bool((emb[n - 1] != 0).any())


def test_too_small_a_cache_for_one_global_batch_is_an_error(tmp_path: Path) -> None:
    write_cache(tmp_path, range(1), shard_records=4)
    with pytest.raises(CacheError, match="fewer than one global batch"):
        next(iter(TrainingReader(tmp_path, batch_size=2, world_size=2)))


def test_follow_mode_picks_up_a_shard_published_after_the_reader_started(tmp_path: Path) -> None:
    write_cache(tmp_path, range(4), shard_records=4, finalize=False, complete=False)
    reader = TrainingReader(tmp_path, batch_size=3, follow=True, poll_interval=0.05)
    got: list[str] = []
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            for b in reader:
                got.extend(b["key"])
        except BaseException as e:  # surfaced below
            errors.append(e)

    t = threading.Thread(target=consume)
    t.start()
    deadline = time.monotonic() + 20
    while len(got) < 12 and time.monotonic() < deadline:  # first shard: 4 records x 3 steps
        time.sleep(0.02)
    assert len(got) == 12
    write_cache(tmp_path, range(4, 7), shard_records=4, rank=1, finalize=False, complete=False)
    write_cache(tmp_path, [], shard_records=4, rank=0, finalize=True, complete=True)
    t.join(20)
    assert not t.is_alive() and not errors
    assert len(got) == 21 and len(set(got)) == 7
    assert len(reader.generations) == 2


def test_follow_mode_keeps_only_the_generations_not_yet_trained_on(tmp_path: Path) -> None:
    """One shard per generation (a sync that releases one name per poll): the batches are each
    generation's own permutation, back to back, and a consumed generation is dropped from
    memory, so a long follow run holds what is still ahead of it, not the whole run."""
    from wandistill.cache.samples import SampleSpace

    write_cache(tmp_path, range(12), shard_records=2, finalize=False, complete=False)

    def one_at_a_time(fresh: list[str], complete: bool) -> tuple[list[str], bool]:
        return fresh[:1], len(fresh) <= 1

    reader = TrainingReader(
        tmp_path, batch_size=3, follow=True, poll_interval=0.0, sync=one_at_a_time
    )
    held, got = [], []
    for b in reader:
        got.extend(zip(b["key"], b["step_slot"].tolist(), strict=True))
        held.append(reader.pool.held())
    gens = reader.generations
    assert len(gens) == 6 and len(got) == 36  # 12 records x 3 steps, batches of 3
    assert max(held) <= 2 * 6  # at most the generation being read and the next one
    ref = TrainingReader(tmp_path, batch_size=3, follow=True)  # the permutations it draws
    store = CacheReader(tmp_path)
    entries = {e.name: e for e in store.entries}
    want = []
    for k, names in enumerate(gens):
        space: SampleSpace = ref._space([entries[n] for n in names])
        order = ref._permutation(len(space), "follow", k)
        for j in order.tolist():
            entry, row, slot = space[j]
            want.append((entry.keys[row], slot))
    store.close()
    assert got == want


def test_follow_mode_times_out_on_a_stalled_cache(tmp_path: Path) -> None:
    write_cache(tmp_path, range(1), shard_records=4, finalize=False, complete=False)
    reader = TrainingReader(
        tmp_path, batch_size=8, follow=True, poll_interval=0.02, follow_timeout=0.2
    )
    with pytest.raises(CacheError, match="no new shard"):
        next(iter(reader))


def test_a_corrupt_record_fails_loudly_or_is_skipped_and_counted(tmp_path: Path) -> None:
    from wandistill.cache.manifest import read_manifest

    write_cache(tmp_path, range(4), shard_records=4)
    entry = read_manifest(tmp_path).shards[0]
    path = tmp_path / entry.file
    data = bytearray(path.read_bytes())
    data[entry.offsets[1][0] : entry.offsets[1][0] + 8] = b"\xff" * 8  # header length
    path.write_bytes(bytes(data))
    with pytest.raises(CacheError, match=f"corrupt record {entry.keys[1]}"):
        _take(TrainingReader(tmp_path, batch_size=4), 3)
    skipping = TrainingReader(tmp_path, batch_size=4, skip_corrupt=True)
    batches = _take(skipping, 3)
    assert all(len(b) == 4 for b in batches)
    assert skipping.corrupt and all(entry.keys[1] in m for m in skipping.corrupt)


def _check_rows(batch: dict, store: CacheReader, pad: str) -> None:
    """Every row of a batch is exactly its (record, step) as `read_sample` reads it alone."""
    where = store.locate()
    lengths = batch["prompt_len"].tolist()
    want_len = max(lengths) if pad == "batch" else store.max_sequence_length
    assert batch["prompt_embeds"].shape[1] == want_len
    for b, (key, slot) in enumerate(zip(batch["key"], batch["step_slot"].tolist(), strict=True)):
        want = store.read_sample(*where[key], slot, list(DEFAULT_FIELDS), pad=False)
        assert lengths[b] == want["prompt_embeds"].shape[0]
        assert torch.equal(batch["prompt_embeds"][b, : lengths[b]], want["prompt_embeds"])
        assert not bool(batch["prompt_embeds"][b, lengths[b] :].any())
        for name in ("xt", "teacher_out", "timesteps"):
            assert torch.equal(batch[name][b], want[name]), (key, slot, name)


@pytest.mark.parametrize("backend", ["webdataset", "zarr"])
@pytest.mark.parametrize("pad", ["batch", "max_sequence_length"])
def test_batches_read_in_place_hold_exactly_each_samples_record_step(
    tmp_path: Path, backend: str, pad: str
) -> None:
    write_cache(tmp_path, range(5), backend=backend, shard_records=2)
    reader = TrainingReader(tmp_path, batch_size=3, pad=pad, num_threads=2)
    it = iter(reader)
    for _ in range(reader.batches_per_epoch()):
        _check_rows(next(it), reader.store, pad)


def test_a_step_row_failing_its_checksum_is_replaced_by_the_batchs_first_good_sample(
    tmp_path: Path,
) -> None:
    from wandistill.cache.manifest import read_manifest

    write_cache(tmp_path, range(4), shard_records=4)
    entry = read_manifest(tmp_path).shards[0]
    reader = TrainingReader(tmp_path, batch_size=4, skip_corrupt=True, pad="batch")
    base, table, _ = reader.store.source.header(entry, 1)  # type: ignore[attr-defined]
    path = tmp_path / entry.file
    data = bytearray(path.read_bytes())
    data[base + table["xt"]["data_offsets"][0]] ^= 0xFF  # record 1, step 0 of x_t
    path.write_bytes(bytes(data))
    bad = entry.keys[1]
    it = iter(reader)
    short = 0
    for _ in range(reader.batches_per_epoch()):
        batch = next(it)
        pairs = list(zip(batch["key"], batch["step_slot"].tolist(), strict=True))
        assert (bad, 0) not in pairs and len(pairs) == 4
        if len(set(pairs)) < 4:  # the batch that held (bad, 0): its first good sample repeated
            short += 1
            assert pairs[-1] == pairs[0]
        _check_rows(batch, reader.store, "batch")
    assert short == 1 and reader.corrupt  # (prefetch may have met it again in epoch 1)
    assert all(f"{bad} " in m and "'xt' step 0 fails its crc32c check" in m for m in reader.corrupt)


def test_a_sample_that_cannot_share_its_batchs_tensors_gets_a_problem_not_a_row() -> None:
    from wandistill.cache.batch import BatchBuffers

    out = BatchBuffers(4, pad_len=5)
    emb = torch.bfloat16
    problems = out.allocate(
        [
            {"xt": ((2, 3), torch.float32), "prompt_embeds": ((4, 8), emb)},
            {"xt": ((2, 4), torch.float32), "prompt_embeds": ((3, 8), emb)},
            {"prompt_embeds": ((2, 8), emb)},
            {"xt": ((2, 3), torch.float32), "prompt_embeds": ((6, 8), emb)},
        ]
    )
    assert problems[0] is None
    assert "'xt' is (2, 4)" in str(problems[1]) and "has no 'xt'" in str(problems[2])
    assert "6 tokens, more than max_sequence_length 5" in str(problems[3])
    assert out.tensors["prompt_embeds"].shape == (4, 5, 8) and out.lengths["prompt_embeds"][0] == 4
    assert not bool(out.tensors["prompt_embeds"][0, 4:].any())


def test_an_epoch_over_more_shards_than_open_files_keeps_only_that_many_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wandistill.io.storage as storage

    monkeypatch.setattr(storage, "MAX_OPEN_FILES", 3)
    write_cache(tmp_path, range(12), shard_records=1)  # 12 shard files
    fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    before = fds()
    reader = TrainingReader(tmp_path, batch_size=4, num_threads=2, prefetch_batches=1)
    seen = [s for b in _take(reader, 2 * reader.batches_per_epoch()) for s in b]
    assert len(set(seen)) == len(seen) // 2 == 12 * 3  # every (record, step) once per epoch
    assert fds() - before <= 3 + 2  # the cap, plus one per reader thread mid-read


def test_running_out_of_file_descriptors_is_an_error_not_a_corrupt_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wandistill.io.storage import LocalStorage

    write_cache(tmp_path, range(4), shard_records=2)

    def emfile(self, rel, requests):  # noqa: ANN001, ANN202
        raise OSError(errno.EMFILE, "Too many open files", str(tmp_path / rel))

    monkeypatch.setattr(LocalStorage, "read_into", emfile)
    reader = TrainingReader(tmp_path, batch_size=2, skip_corrupt=True)
    with pytest.raises(OSError, match="Too many open files"):
        _take(reader, 1)
    assert reader.corrupt == []  # nothing was dropped as if it were damaged


def test_follow_mode_stops_in_one_line_when_the_caches_writer_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An incomplete cache whose claim lock nobody holds (its precompute died) can never be
    completed: --follow says so instead of waiting out follow_timeout; while a writer holds
    the lock, it says what it waits for."""
    from wandistill.io import outputs
    from wandistill.runtime import waiting

    monkeypatch.setattr(waiting, "NOTICE_S", 0.001)  # look at the writer on the first idle poll
    write_cache(tmp_path, range(4), shard_records=4, finalize=False, complete=False)
    writer = outputs.claim(tmp_path, "cache")
    try:
        reader = TrainingReader(
            tmp_path, batch_size=3, follow=True, poll_interval=0.01, follow_timeout=0.3
        )
        with pytest.raises(CacheError, match="no new shard"):
            list(reader)
        assert "waiting: for new shards in" in capsys.readouterr().err
    finally:
        writer.release()
    reader = TrainingReader(tmp_path, batch_size=3, follow=True, poll_interval=0.01)
    with pytest.raises(CacheError, match="nothing writes it any more: no process holds its lock"):
        list(reader)
