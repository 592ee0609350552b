"""eval streams: records are read a batch at a time while the columns sample, and the running
sums give the same means as scoring every record at once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from wandistill.cache.reader import CacheStore
from wandistill.eval import run as ev
from wandistill.eval.metrics import mse, psnr

from cachefixtures import write_cache


class _Half(torch.nn.Module):
    """A stand-in student for the step-loss diagnostic: half the input, whatever the step."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict):  # noqa: ANN001
        return (hidden_states * self.scale,)


def test_records_are_read_a_batch_at_a_time_and_the_sums_give_the_full_means(
    tmp_path: Path,
) -> None:
    write_cache(tmp_path / "c", range(22), shard_records=5)
    with CacheStore(tmp_path / "c") as store:
        reads: list[int] = []
        read = store.read_record

        def counted(entry, i):  # noqa: ANN001, ANN202
            reads.append(i)
            return read(entry, i)

        store.read_record = counted  # type: ignore[method-assign]
        read_when_sampled: list[int] = []

        def sample(batch: ev.Batch, steps: int) -> torch.Tensor:
            if steps == 3:  # not the warm-up call
                read_when_sampled.append(len(reads))
            return batch.noise * 0.25

        leg = ev.Leg(ev.Column("student@3", "student", 3, 3, 0.0), sample)
        located = ev.held_out(store, "all", None)
        settings = store.manifest.settings
        stream = ev.Stream(
            legs=[leg],
            batches=ev._batches(store, located, settings, store.read_shared(), 4),
            model=_Half(),
            device=torch.device("cpu"),
            grid=ev._Grid(rows=6),
        )
        result = ev._run(stream, settings)
        records = [read(*where) for where in located]

    # batch b (4 records) is sampled when exactly its records and those before it are read
    assert read_when_sampled == [min(4 * (b + 1), 22) for b in range(6)]
    assert result.records == 22 and len(result.per_record) == 22
    assert [r["key"] for r in result.per_record] == [r.key for r in records]
    finals = [r.noise.float() * 0.25 for r in records]
    refs = [r.final_latent.float() for r in records]
    pairs = list(zip(finals, refs, strict=True))
    student = result.column("student@3")
    assert np.isclose(student.latent_mse, np.mean([mse(a, b) for a, b in pairs]))
    want_psnr = np.mean([min(psnr(a, b), ev.PSNR_CAP) for a, b in pairs])
    assert np.isclose(student.latent_psnr, want_psnr)
    noise = result.column("noise")
    assert np.isclose(noise.latent_mse, np.mean([mse(r.noise, r.final_latent) for r in records]))
    step = [mse(r.xt.float() * 0.5, r.teacher_out) for r in records]
    assert np.isclose(result.step_loss, np.mean(step))
    assert len(stream.grid.cells) == 6 and stream.grid.prompts == [r.prompt for r in records[:6]]
