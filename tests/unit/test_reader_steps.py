"""The training reader plans whole optimizer steps (B x A x W) and serves the objectives' points."""

from __future__ import annotations

from pathlib import Path

import torch

from wandistill.cache import open_cache
from wandistill.cache.training import TrainingReader

from cachefixtures import write_cache


def _steps(path: Path, n: int, *, world: int, accum: int, batch: int = 2) -> list[list]:
    """The samples of the first n optimizer steps, each as the set of its micro-batches."""
    readers = [
        iter(TrainingReader(path, batch_size=batch, rank=r, world_size=world, grad_accum=accum))
        for r in range(world)
    ]
    steps = []
    for _ in range(n):
        micro = []
        for it in readers:
            for _ in range(accum):
                b = next(it)
                micro.append(tuple(zip(b["key"], b["step_slot"].tolist(), strict=True)))
        steps.append(sorted(micro))
    return steps


def test_ranks_times_accumulation_see_the_same_micro_batches_across_epochs(tmp_path: Path) -> None:
    # 6 records x 3 steps = 18 samples; global batch 4 -> 4 steps per epoch, 2 samples dropped.
    # Planning micro-batches of B x W alone would put epoch 1 at different places.
    write_cache(tmp_path, range(6))
    one = _steps(tmp_path, 9, world=1, accum=2)
    two = _steps(tmp_path, 9, world=2, accum=1)
    four = _steps(tmp_path, 9, world=1, accum=4, batch=1)
    assert one == two
    assert [sorted(s for mb in st for s in mb) for st in one] == [
        sorted(s for mb in st for s in mb) for st in four
    ]
    epoch0 = {s for st in one[:4] for mb in st for s in mb}
    assert len(epoch0) == 16 and one[4] != one[0], "epoch 1 starts at step 4, reshuffled"


def test_a_resume_mid_step_replays_that_whole_step(tmp_path: Path) -> None:
    write_cache(tmp_path, range(6))
    full = TrainingReader(tmp_path, batch_size=2, grad_accum=2)
    it = iter(full)
    batches = [next(it)["key"] for _ in range(7)]  # 3 whole steps + 1 micro-batch of step 4
    state = full.state_dict()
    assert (state["epoch"], state["batches_done"], state["grad_accum"]) == (0, 3, 2)
    resumed = TrainingReader(tmp_path, batch_size=2, grad_accum=2)
    resumed.load_state_dict(state)
    assert next(iter(resumed))["key"] == batches[6]
    # The same position from a layout with the same global batch (2 ranks x accumulation 1).
    other = TrainingReader(tmp_path, batch_size=2, world_size=2, rank=0)
    other.load_state_dict(state)
    assert next(iter(other))["key"] == batches[6]


def test_slots_narrow_the_space_and_next_slots_add_the_next_trajectory_point(
    tmp_path: Path,
) -> None:
    write_cache(tmp_path, range(4))
    reader = TrainingReader(
        tmp_path, batch_size=4, slots=[1, 2], next_slots=[1, 2, 3], fields=["xt", "timesteps"]
    )
    assert reader.batches_per_epoch() == 2  # 4 records x 2 slots
    with open_cache(tmp_path) as store:
        records = {r.key: r for r in store.records()}
    it = iter(reader)
    for _ in range(2):
        batch = next(it)
        for b, (key, slot) in enumerate(
            zip(batch["key"], batch["step_slot"].tolist(), strict=True)
        ):
            rec = records[key]
            assert slot in (1, 2)
            torch.testing.assert_close(batch["xt"][b], rec.xt[slot])
            if slot == 1:
                torch.testing.assert_close(batch["xt_next"][b], rec.xt[2])
                assert batch["timesteps_next"][b] == rec.timesteps[2]
            else:  # the last recorded step: the next point is the end of the trajectory
                torch.testing.assert_close(batch["xt_next"][b], rec.final_latent)
                assert batch["timesteps_next"][b] == 0
