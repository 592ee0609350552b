"""One pass over the records: every leg (student, teacher@K, baselines) samples each batch,
every figure is summed against the cached final latents, then the batch is dropped, so memory
holds one batch whatever the number of records. `_run` returns the `EvalResult`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from wandistill.cache.contract import Record
from wandistill.cache.files import SettingsBlock
from wandistill.eval import equivalent, viewer
from wandistill.eval import grid as gridmod
from wandistill.eval.metrics import image_psnr, mse, psnr
from wandistill.eval.result import PSNR_CAP, Column, EvalResult


@dataclass(frozen=True, slots=True)
class Batch:
    records: list[Record]
    noise: torch.Tensor
    embeds: torch.Tensor
    negative: torch.Tensor


@dataclass(slots=True)
class Leg:
    """A column that samples: `sample(batch)` -> final latents [B, C, F, H, W]."""

    column: Column
    sample: Callable[[Batch, int], torch.Tensor]
    """(batch, steps) -> latents; steps = column.steps (1 for the warm-up)."""


Decoder = Callable[[dict[str, torch.Tensor]], dict[str, np.ndarray]]
"""Final latents per column -> uint8 frames per column (the teacher's VAE, --decode)."""


@dataclass(slots=True)
class _Grid:
    """The grid's rows: the first `rows` records' cells, kept as the batches go by (the rest of
    the finals are dropped with their batch)."""

    rows: int
    prompts: list[str] = field(default_factory=list)
    cells: list[list[np.ndarray]] = field(default_factory=list)
    decoded: bool = False

    def add(
        self,
        batch: Batch,
        names: list[str],
        finals: dict[str, torch.Tensor],
        frames: dict[str, np.ndarray] | None,
    ) -> None:
        take = min(self.rows - len(self.prompts), len(batch.records))
        ref = finals[names[1]]
        for i in range(take):
            self.prompts.append(batch.records[i].prompt)
            if frames is not None:
                self.cells.append([gridmod.frames_cell(frames[c][i]) for c in names])
            else:
                self.cells.append([gridmod.latent_cell(finals[c][i], ref[i]) for c in names])
        self.decoded = frames is not None


@dataclass(slots=True)
class _Sums:
    """Running sums of one column's per-record figures: the means need nothing else."""

    mse: float = 0.0
    psnr: float = 0.0
    image_psnr: float = 0.0
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Curve:
    """The teacher re-sampled at each of `steps` for the equivalent-steps curve (--teacher)."""

    steps: list[int]
    sample: Callable[[Batch, int], torch.Tensor]


@dataclass(slots=True)
class Stream:
    """One pass over the records: every leg samples each batch, every figure is summed, then
    the batch is dropped. Memory holds one batch (all its recorded steps) and every column's
    finals for it, whatever the number of records."""

    legs: list[Leg]
    batches: Iterator[Batch]
    model: torch.nn.Module
    device: torch.device
    grid: _Grid
    decoder: Decoder | None = None
    curve: Curve | None = None


def _run(stream: Stream, settings: SettingsBlock) -> EvalResult:
    """Sample, then score every column against the cached final latents, batch by batch."""
    n = int(settings.num_inference_steps)
    g = settings.guidance_scale if settings.guidance_scale is not None else 1.0
    columns = [
        Column("noise", "noise", 0, 0, None),
        Column(f"teacher@{n}", "reference", n, n * (2 if g > 1 else 1), None),
        *(leg.column for leg in stream.legs),
    ]
    names = [c.name for c in columns]
    sums = {c: _Sums() for c in names}
    per_record: list[dict[str, Any]] = []
    curve_sums: dict[int, float] = {}
    tally = viewer.Tally()
    loss = 0.0
    for i, b in enumerate(stream.batches):
        if i == 0:
            first = Batch(b.records[:1], b.noise[:1], b.embeds[:1], b.negative[:1])
            for leg in stream.legs:  # warm-up: lazy inits stay out of the timing
                leg.sample(first, 1)
        loss += _step_loss_sum(stream.model, b, stream.device)
        finals = _sample_batch(stream.legs, b, names[1], sums)
        rows = [{"key": r.key, "prompt": r.prompt, "latent_mse": {}} for r in b.records]
        ref = finals[names[1]]
        for c in names:
            for row, a, r in zip(rows, finals[c], ref, strict=True):
                row["latent_mse"][c] = mse(a, r)
                sums[c].mse += row["latent_mse"][c]
                sums[c].psnr += min(psnr(a, r), PSNR_CAP)
        frames = stream.decoder(finals) if stream.decoder is not None else None
        if frames is not None:
            for c in names:
                sums[c].image_psnr += sum(
                    min(image_psnr(a, r), PSNR_CAP)
                    for a, r in zip(frames[c], frames[names[1]], strict=True)
                )
        stream.grid.add(b, names, finals, frames)
        for row, shown in zip(rows, tally.add([r.prompt for r in b.records], finals), strict=True):
            if shown:
                row["shown"] = shown
        if stream.curve is not None:
            teacher = [leg.column for leg in stream.legs if leg.column.role == "teacher"]
            known = {c.steps: finals[c.name] for c in teacher}
            _curve_batch(stream.curve, known, b, ref, rows, curve_sums)
        per_record += rows
    count, seen = len(per_record), tally.scores(names[1])
    for c in columns:
        c.latent_mse, c.latent_psnr = sums[c.name].mse / count, sums[c.name].psnr / count
        if c.seconds_per_sample is not None:
            c.seconds_per_sample = sums[c.name].seconds / count
        if stream.decoder is not None:
            c.image_psnr = sums[c.name].image_psnr / count
        c.viewer = seen.get(c.name)
    result = _summary(columns, count, n, loss / count, per_record)
    _place_on_curve(result, {s: m / count for s, m in sorted(curve_sums.items())})
    return result


def _curve_batch(
    curve: Curve,
    known: dict[int, torch.Tensor],
    batch: Batch,
    ref: torch.Tensor,
    rows: list[dict[str, Any]],
    sums: dict[int, float],
) -> None:
    """The teacher at every curve step count for one batch (`known`: the teacher@K column's
    finals, reused at K), each record's MSE vs teacher@N summed; the finals are then dropped."""
    for s in curve.steps:
        finals = known[s] if s in known else curve.sample(batch, s)
        for row, a, r in zip(rows, finals, ref, strict=True):
            row.setdefault("teacher_curve", {})[str(s)] = m = mse(a, r)
            sums[s] = sums.get(s, 0.0) + m


def _place_on_curve(result: EvalResult, curve: dict[int, float]) -> None:
    """Each student and baseline column placed on the teacher's curve (`equivalent.place`)."""
    if not curve:
        return
    result.teacher_curve = {str(s): m for s, m in curve.items()}
    for c in result.columns:
        if c.role in ("student", "baseline"):
            where = equivalent.place(curve, c.latent_mse)
            if where is not None:
                c.equivalent_steps, c.equivalent = where.steps, where.text


def _sample_batch(
    legs: list[Leg], batch: Batch, reference: str, sums: dict[str, _Sums]
) -> dict[str, torch.Tensor]:
    """Every column's final latents for one batch; each leg's wall time added to its sums."""
    finals = {
        "noise": batch.noise,
        reference: torch.stack([r.final_latent for r in batch.records]).float(),
    }
    for leg in legs:
        t0 = time.perf_counter()
        finals[leg.column.name] = leg.sample(batch, leg.column.steps)
        sums[leg.column.name].seconds += time.perf_counter() - t0
    return finals


def _summary(
    columns: list[Column], records: int, n: int, step_loss: float, per_record: list[Any]
) -> EvalResult:
    """Ratios to teacher@K, R_K and the baseline's ratio at K."""
    teacher_k = next((c for c in columns if c.role == "teacher"), None)
    if teacher_k is not None and teacher_k.steps < n and teacher_k.latent_mse > 0:
        for c in columns:
            c.ratio = c.latent_mse / teacher_k.latent_mse
    student = next(c for c in columns if c.role == "student")
    base_k = next((c for c in columns if c.role == "baseline" and c.steps == student.steps), None)
    return EvalResult(
        records=records,
        num_inference_steps=student.steps,
        teacher_steps=n,
        columns=columns,
        step_loss=step_loss,
        r_k=student.ratio,
        baseline_r_k=base_k.ratio if base_k is not None else None,
        per_record=per_record,
    )


@torch.no_grad()
def _step_loss_sum(model: torch.nn.Module, batch: Batch, device: torch.device) -> float:
    """The sum over a batch's records of the student's output vs the teacher's guided output
    at every recorded (x_t, t) (the mean over records is the step-loss diagnostic)."""
    dtype = next(model.parameters()).dtype
    total = 0.0
    for rec, emb in zip(batch.records, batch.embeds, strict=True):
        s = rec.xt.shape[0]
        pred = model(
            hidden_states=rec.xt.to(device=device, dtype=dtype),
            timestep=rec.timesteps.to(device),
            encoder_hidden_states=emb.expand(s, -1, -1).to(device, dtype),
            return_dict=False,
        )[0].cpu()
        total += mse(pred, rec.teacher_out)
    return total
