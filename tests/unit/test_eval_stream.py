"""eval streams: records are read a batch at a time while the columns sample, and the running
sums give the same means as scoring every record at once."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from wandistill.cache.files import SettingsBlock
from wandistill.cache.reader import CacheReader
from wandistill.eval import result as er
from wandistill.eval import run as ev
from wandistill.eval import stream as es
from wandistill.eval import viewer
from wandistill.eval.equivalent import curve_steps, place
from wandistill.eval.metrics import mse, psnr
from wandistill.teacher.world import parse_prompt

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
    with CacheReader(tmp_path / "c") as store:
        reads: list[int] = []
        read = store.read_record

        def counted(entry, i):  # noqa: ANN001, ANN202
            reads.append(i)
            return read(entry, i)

        store.read_record = counted  # type: ignore[method-assign]
        read_when_sampled: list[int] = []

        def sample(batch: es.Batch, steps: int) -> torch.Tensor:
            if steps == 3:  # not the warm-up call
                read_when_sampled.append(len(reads))
            return batch.noise * 0.25

        leg = es.Leg(er.Column("student@3", "student", 3, 3, 0.0), sample)
        located = ev.held_out(store, "all", None)
        settings = store.manifest.settings
        stream = es.Stream(
            legs=[leg],
            batches=ev._batches(store, located, settings, store.read_shared(), 4),
            model=_Half(),
            device=torch.device("cpu"),
            grid=es._Grid(rows=6),
        )
        result = es._run(stream, settings)
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
    want_psnr = np.mean([min(psnr(a, b), er.PSNR_CAP) for a, b in pairs])
    assert np.isclose(student.latent_psnr, want_psnr)
    noise = result.column("noise")
    assert np.isclose(noise.latent_mse, np.mean([mse(r.noise, r.final_latent) for r in records]))
    step = [mse(r.xt.float() * 0.5, r.teacher_out) for r in records]
    assert np.isclose(result.step_loss, np.mean(step))
    assert len(stream.grid.cells) == 6 and stream.grid.prompts == [r.prompt for r in records[:6]]


def test_the_teacher_curve_is_sampled_per_batch_and_places_the_student_between_its_points(
    tmp_path: Path,
) -> None:
    """A stand-in teacher whose error falls with steps: the curve's means are the per-record
    means, and the student is placed by log-MSE interpolation between the points around it."""
    write_cache(tmp_path / "c", range(10), shard_records=4)
    with CacheReader(tmp_path / "c") as store:
        records = [store.read_record(*w) for w in ev.held_out(store, "all", None)]

        def teacher(batch: es.Batch, steps: int) -> torch.Tensor:
            ref = torch.stack([r.final_latent for r in batch.records]).float()
            return ref + (batch.noise - ref) * 2.0 ** (-steps)

        def student(batch: es.Batch, steps: int) -> torch.Tensor:  # between teacher@3 and @4
            ref = torch.stack([r.final_latent for r in batch.records]).float()
            return ref + (batch.noise - ref) * 2.0 ** (-3.5)

        legs = [
            es.Leg(er.Column("teacher@2", "teacher", 2, 4, 0.0), teacher),
            es.Leg(er.Column("student@2", "student", 2, 2, 0.0), student),
        ]
        settings = store.manifest.settings
        stream = es.Stream(
            legs=legs,
            batches=ev._batches(store, ev.held_out(store, "all", None), settings, {}, 3),
            model=_Half(),
            device=torch.device("cpu"),
            grid=es._Grid(rows=2),
            curve=es.Curve([2, 3, 4, 5], teacher),
        )
        result = es._run(stream, settings)
    for s in (2, 3, 4, 5):
        refs = [r.final_latent.float() for r in records]
        want = np.mean(
            [
                mse(f + (r.noise.float() - f) * 2.0**-s, f)
                for r, f in zip(records, refs, strict=True)
            ]
        )
        assert np.isclose(result.teacher_curve[str(s)], want)
    assert all(len(row["teacher_curve"]) == 4 for row in result.per_record)
    # MSE scales by 4 per step, the student's error sits half a step past teacher@3 in log MSE
    assert result.student.equivalent_steps == pytest.approx(3.5)
    assert result.student.equivalent == "teacher@3.5"
    assert "student@2 ~ teacher@3.5 on the teacher's own curve" in result.table()
    from rich.console import Console

    console = Console(width=80, record=True, file=io.StringIO())
    console.print(result.console_table())
    row = next(line for line in console.export_text().splitlines() if "student@2" in line)
    assert "@3.5" in row and f"{result.student.latent_mse:.5f}" in row  # nothing cut at 80


def test_a_student_off_the_curve_is_named_below_its_first_or_above_its_last_point() -> None:
    curve = {2: 0.1, 4: 0.01, 8: 0.001}
    assert place(curve, 0.5).text == "< teacher@2" and place(curve, 0.5).steps is None
    assert place(curve, 1e-4).text == "> teacher@8" and place(curve, 1e-4).steps is None
    assert place(curve, 0.1).steps == 2 and place(curve, 0.001).text == "teacher@8"
    assert place(curve, 10**-1.5).steps == pytest.approx(3.0)  # log-linear: halfway in log
    assert place({2: 0.1, 3: 0.0}, 0.05).steps == pytest.approx(2.5)  # a zero point: linear
    assert place({}, 0.1) is None


def test_the_curve_has_every_step_up_to_16_and_a_half_octave_subset_beyond() -> None:
    assert curve_steps(4) == [2, 3, 4]
    assert curve_steps(16) == list(range(2, 17))
    assert curve_steps(50) == [2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 50]
    assert curve_steps(1) == []


def test_each_column_reports_what_a_viewer_sees_in_the_table_and_json(tmp_path: Path) -> None:
    """Records of the trained teacher's grammar: the reference (rendered patterns) shows every
    prompt, a student drawing the wrong shape loses exactly the shape, noise shows nothing."""
    from dataclasses import replace

    from wandistill.teacher.world import synthetic_pattern, synthetic_prompts

    from cachefixtures import make_record

    prompts = [p for p in synthetic_prompts(40, seed=3) if " column" not in p][:12]
    records = [
        replace(make_record(i), prompt=p, final_latent=synthetic_pattern(p))
        for i, p in enumerate(prompts)
    ]
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(len(records), 16, 1, 8, 8, generator=g)

    def batches() -> Iterator[es.Batch]:
        for i in range(0, len(records), 5):
            chunk = records[i : i + 5]
            embeds = torch.zeros(len(chunk), 24, 32)
            yield es.Batch(chunk, noise[i : i + 5], embeds, embeds)

    def upright(batch: es.Batch, steps: int) -> torch.Tensor:  # each prompt's shape a column
        out = []
        for r in batch.records:
            spec = parse_prompt(r.prompt)
            out.append(synthetic_pattern(replace(spec, shape="column").text))
        return torch.stack(out)

    leg = es.Leg(er.Column("student@3", "student", 3, 3, 0.0), upright)
    stream = es.Stream(legs=[leg], batches=batches(), model=_Half(),
                       device=torch.device("cpu"), grid=es._Grid(rows=2))  # fmt: skip
    result = es._run(stream, SettingsBlock(num_inference_steps=4))
    ref, student = result.column("teacher@4").viewer, result.column("student@3").viewer
    assert (ref.all, ref.shape, ref.spread_ratio) == (1.0, 1.0, 1.0)
    assert (student.all, student.shape) == (0.0, 0.0)
    assert (student.colour, student.size, student.position) == (1.0, 1.0, 1.0)
    assert result.column("noise").viewer.all < 0.2
    assert result.per_record[0]["shown"]["student@3"] == [1, 0, 1, 1]
    table = result.table()
    head = "| column | shown | colour | shape | size | position | clear | spread / teacher@4 |"
    assert head in table and "| student@3 | 0.00 | 1.00 | 0.00 | 1.00 | 1.00 | 1.00 | " in table
    assert viewer.LEGEND in table
    ev._write(result, stream.grid, tmp_path)
    saved = json.loads((tmp_path / "eval.json").read_text())
    cols = {c["name"]: c for c in saved["columns"]}
    assert cols["student@3"]["viewer"]["shape"] == 0.0 and cols["teacher@4"]["viewer"]["all"] == 1


def test_prompts_outside_the_grammar_leave_the_viewer_columns_out(tmp_path: Path) -> None:
    write_cache(tmp_path / "c", range(6), shard_records=4)
    with CacheReader(tmp_path / "c") as store:
        settings = store.manifest.settings
        leg = es.Leg(er.Column("student@3", "student", 3, 3, 0.0), lambda b, s: b.noise)
        stream = es.Stream(
            legs=[leg],
            batches=ev._batches(store, ev.held_out(store, "all", None), settings, {}, 4),
            model=_Half(),
            device=torch.device("cpu"),
            grid=es._Grid(rows=1),
        )
        result = es._run(stream, settings)
    assert all(c.viewer is None for c in result.columns)
    assert viewer.LEGEND not in result.table() and "shown" not in result.per_record[0]
