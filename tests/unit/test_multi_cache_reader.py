"""Several caches as one dataset: equal batches per rank, weights as shares of each epoch,
exact resume, follow on any cache, every mismatch named."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from wandistill.cache.multi import shares
from wandistill.cache.training import TrainingReader
from wandistill.errors import CacheError, CacheMismatchError, ConfigError, UsageError

from cachefixtures import SETTINGS, TEACHER, write_cache


def _take(reader: TrainingReader, n: int) -> list[list[tuple[str, int]]]:
    it = iter(reader)
    out = []
    for _ in range(n):
        b = next(it)
        out.append(list(zip(b["key"], b["step_slot"].tolist(), strict=True)))
    return out


@pytest.fixture
def two(tmp_path: Path) -> tuple[Path, Path]:
    """Cache a: records 0..4, cache b: records 5..11 (uneven shards): 15 + 21 samples."""
    a, b = tmp_path / "a", tmp_path / "b"
    write_cache(a, range(5), shard_records=3)
    write_cache(b, range(5, 12), shard_records=4, backend="zarr")
    return a, b


def _keys(path: Path, records: range) -> set[str]:
    out = set()
    for b in _take(TrainingReader(path, batch_size=1), len(records) * 3):
        out.update(k for k, _ in b)
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_two_caches_give_every_rank_the_same_batches_and_every_sample_once(
    two: tuple[Path, Path], world: int
) -> None:
    readers = [
        TrainingReader(list(two), batch_size=2, rank=r, world_size=world) for r in range(world)
    ]
    epochs = [_take(r, r.batches_per_epoch()) for r in readers]
    assert len({len(e) for e in epochs}) == 1
    assert len(epochs[0]) == 36 // (2 * world)
    seen = [s for e in epochs for b in e for s in b]
    assert len(seen) == len(set(seen)), "a sample was given to two ranks"
    keys_a, keys_b = _keys(two[0], range(5)), _keys(two[1], range(7))
    assert {k for k, _ in seen} <= keys_a | keys_b
    assert {k for k, _ in seen} & keys_a and {k for k, _ in seen} & keys_b


def test_order_is_deterministic_and_mixes_caches_within_batches(two: tuple[Path, Path]) -> None:
    a = _take(TrainingReader(list(two), batch_size=6, seed=3), 12)
    assert a == _take(TrainingReader(list(two), batch_size=6, seed=3), 12)
    assert a != _take(TrainingReader(list(two), batch_size=6, seed=4), 12)
    keys_a = _keys(two[0], range(5))
    mixed = [b for b in a if {k in keys_a for k, _ in b} == {True, False}]
    assert mixed, "no batch held samples of both caches"


def test_weights_set_each_caches_share_of_every_epoch(two: tuple[Path, Path]) -> None:
    # 36 samples an epoch; weights 3:1 -> 27 from a (15 samples: repeated), 9 from b (of 21).
    reader = TrainingReader(list(two), weights=[3, 1], batch_size=4, seed=1)
    assert reader.steps_per_epoch() == 9
    keys_a = _keys(two[0], range(5))
    run = _take(reader, 18)
    epochs = [run[:9], run[9:]]
    for e in epochs:
        c = Counter(k in keys_a for b in e for k, _ in b)
        assert c[True] == 27 and c[False] == 9
    first = [s for b in epochs[0] for s in b]
    from_a = Counter(s for s in first if s[0] in keys_a)
    assert len(from_a) == 15 and max(from_a.values()) == 2, "a's 15 samples, 12 of them twice"
    assert epochs[0] != epochs[1], "each epoch draws afresh"
    assert shares([15, 21], [1.0, 1.0]) == [18, 18]
    assert shares([10, 0, 5], [1.0, 1.0, 1.0]) == [5, 5, 5]


def test_a_mixed_batch_holds_each_samples_own_tensors(two: tuple[Path, Path]) -> None:
    alone = {}
    for path in two:
        for b in TrainingReader(path, batch_size=1, pad="batch"):
            alone[(b["key"][0], int(b["step_slot"][0]))] = b
            if len(alone) in (15, 36):  # every sample of this cache
                break
    batch = next(iter(TrainingReader(list(two), batch_size=8, pad="batch")))
    assert batch["prompt_embeds"].shape[1] == int(batch["prompt_len"].max())
    for row, (key, slot) in enumerate(zip(batch["key"], batch["step_slot"].tolist(), strict=True)):
        one = alone[(key, slot)]
        n = int(one["prompt_len"][0])
        assert int(batch["prompt_len"][row]) == n
        assert bool((batch["prompt_embeds"][row, :n] == one["prompt_embeds"][0, :n]).all())
        assert bool((batch["prompt_embeds"][row, n:] == 0).all())
        for name in ("xt", "teacher_out", "timesteps"):
            assert bool((batch[name][row] == one[name][0]).all())
    # The per-sample path (the next trajectory point, for perflow) over both caches too.
    nxt = next(iter(TrainingReader(list(two), batch_size=8, next_slots=[1, 2, 3])))
    assert nxt["key"] == batch["key"] and nxt["xt_next"].shape == batch["xt"].shape
    assert bool((nxt["xt"] == batch["xt"]).all())


def test_resume_mid_epoch_over_two_caches_gives_the_same_sequence(two: tuple[Path, Path]) -> None:
    kw = {"weights": [1, 2], "batch_size": 4, "seed": 5, "prefetch_batches": 3}
    full = _take(TrainingReader(list(two), **kw), 14)  # past the epoch boundary (9 steps)
    first = TrainingReader(list(two), **kw)
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()
    assert state["caches"] == [str(p) for p in two] and state["weights"] == [1.0, 2.0]
    resumed = TrainingReader(list(two), **kw)
    resumed.load_state_dict(state)
    assert _take(resumed, 10) == full[4:]
    other = TrainingReader(list(two), batch_size=4, seed=5)
    with pytest.raises(UsageError, match="same --cache list and train.cache_weights"):
        other.load_state_dict(state)


def test_each_cache_keeps_its_own_held_out_split(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_cache(a, range(20), settings={**SETTINGS, "holdout_fraction": 0.5})
    write_cache(b, range(20, 30))
    reader = TrainingReader([a, b], batch_size=1)
    held = TrainingReader(a, batch_size=1)
    train_a = len(held._spaces()[0]) // 3
    assert 0 < train_a < 20
    assert reader.steps_per_epoch() == (train_a + 10) * 3


def test_caches_of_other_teachers_or_settings_are_refused_naming_each_difference(
    tmp_path: Path,
) -> None:
    write_cache(tmp_path / "a", range(3))
    write_cache(tmp_path / "b", range(3, 6), settings={**SETTINGS, "guidance_scale": 7.0})
    with pytest.raises(CacheMismatchError) as e:
        TrainingReader([tmp_path / "a", tmp_path / "b"], batch_size=1)
    assert "settings.guidance_scale" in e.value.message and "'" + str(tmp_path / "b") in str(
        e.value.message
    )
    assert "same recipe and teacher" in (e.value.fix or "")
    import cachefixtures

    other = {**TEACHER, "fingerprint": "e" * 64}
    old = cachefixtures.TEACHER
    cachefixtures.TEACHER = other
    try:
        write_cache(tmp_path / "c", range(6, 9))
    finally:
        cachefixtures.TEACHER = old
    with pytest.raises(CacheMismatchError, match="teacher.fingerprint"):
        TrainingReader([tmp_path / "a", tmp_path / "c"], batch_size=1)


def test_a_record_key_in_two_caches_is_refused_and_named(tmp_path: Path) -> None:
    write_cache(tmp_path / "a", range(4))
    write_cache(tmp_path / "b", range(3, 6))
    with pytest.raises(CacheError, match=r"1 record key\(s\) are in more than one cache"):
        TrainingReader([tmp_path / "a", tmp_path / "b"], batch_size=1)
    with pytest.raises(UsageError, match="given more than once"):
        TrainingReader([tmp_path / "a", tmp_path / "a"], batch_size=1)


@pytest.mark.parametrize("weights", [[1, 0], [1, -2], [1, float("nan")], [1, "2"], [1]])
def test_a_weight_that_is_not_a_positive_number_is_refused(
    two: tuple[Path, Path], weights: list
) -> None:
    with pytest.raises(ConfigError, match="train.cache_weights") as e:
        TrainingReader(list(two), weights=weights, batch_size=1)
    assert e.value.fix


def test_follow_trains_on_a_second_cache_still_being_written(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_cache(a, range(4), shard_records=4)
    write_cache(b, range(4, 6), shard_records=4, finalize=False, complete=False)
    reader = TrainingReader([a, b], batch_size=3, follow=True, poll_interval=0.05)
    got: list[str] = []
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            for batch in reader:
                got.extend(batch["key"])
        except BaseException as e:  # surfaced below
            errors.append(e)

    t = threading.Thread(target=consume)
    t.start()
    deadline = time.monotonic() + 20
    while len(got) < 18 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(got) == 18  # a's 12 samples and b's first 6
    write_cache(b, range(6, 9), shard_records=4, rank=1, finalize=False, complete=False)
    write_cache(b, [], shard_records=4, rank=0, finalize=True, complete=True)
    t.join(20)
    assert not t.is_alive() and not errors
    assert len(got) == 27 and len(set(got)) == 9
    assert reader.generations[0] == sorted(reader.generations[0])
    assert all(":" in name for g in reader.generations for name in g)
    with pytest.raises(UsageError, match="cannot be used with --follow"):
        TrainingReader([a, b], weights=[1, 1], batch_size=3, follow=True)
