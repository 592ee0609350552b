"""`wandistill eval`: does the K-step student do in K steps what the teacher does in N?

On held-out records of the cache (by `cache.holdout_fraction`, or every record of a separate
cache) every column starts from the record's own cached noise and prompt embedding, and its final
latent is compared with the teacher's N-step final latent, which the cache holds:

    noise        the initial noise itself: the do-nothing baseline
    teacher@N    the cached final latent: the reference (not re-sampled)
    teacher@K    the teacher at K steps: its own scheduler, CFG as the cache ran it (--teacher)
    student@K    the student's K-step sampler: WanPipeline with the student's scheduler, guidance 1
    baseline@K   a step-imitating student (--baseline RUN) at K steps ...
    baseline@N   ... and at its own N steps

Every sampler is diffusers' `WanPipeline.__call__` fed the cache's tensors
(`wandistill.student.sampler.sample_latents`), the call a test proves equal to the exported folder.
The answer to "is it worth distilling" is R_K = MSE(student@K, teacher@N) / MSE(teacher@K,
teacher@N): below 1 the student does in K steps better than the teacher does in K steps. Each
column also reports its forwards per sample (CFG doubles the teacher's) and wall time per sample
(the batched pipeline call divided by the batch, after one untimed warm-up call per column).

With --teacher, the teacher is also sampled at every step count of `equivalent.curve_steps(N)`
and each student and baseline column is placed on that error curve ("student@4 ~ teacher@6.1",
`equivalent.place`), beside R_K.

Streams: records are read `batch_size` at a time, every column samples the batch, every figure
goes into a running sum, and the batch is dropped (`Stream`, `_run`); only the grid's first rows
and the per-record figures are kept, so memory does not grow with the held-out records.

Writes eval.md (the table), eval.json (every figure, per record too) and grid.png (see `grid.py`).
Deterministic: no randomness is drawn; the figures repeat exactly, the wall times do not.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wandistill.cache.contract import Record, is_holdout, pad_embeds
from wandistill.cache.files import DimsBlock, SettingsBlock, TeacherBlock
from wandistill.cache.reader import CacheReader
from wandistill.errors import UsageError
from wandistill.eval import equivalent, viewer
from wandistill.eval import grid as gridmod
from wandistill.eval.metrics import image_psnr, mse, psnr
from wandistill.io import outputs
from wandistill.io.fsutil import atomic_write_bytes, atomic_write_json
from wandistill.placement.strategies import Auto, Cpu, Cuda, Placement
from wandistill.student.folders import FinishedStudent
from wandistill.student.sampler import sample_latents, student_pipeline
from wandistill.student.schedule import build_scheduler
from wandistill.teacher.folder import TeacherFolder

PSNR_CAP = 100.0
"""PSNR of identical latents is infinite; capped so means and JSON stay finite."""
MIN_RECORDS = 8
"""Fewer evaluated records than this and a mean MSE (and R_K) is mostly the luck of the draw:
eval warns (`few_records`)."""


@dataclass(slots=True)
class Column:
    """One way of sampling the held-out records, and how close it lands to teacher@N."""

    name: str
    role: str
    """noise | reference | teacher | student | baseline"""
    steps: int
    forwards_per_sample: int
    seconds_per_sample: float | None
    """None: nothing sampled (noise) or taken from the cache (teacher@N)."""
    latent_mse: float = 0.0
    latent_psnr: float = PSNR_CAP
    ratio: float | None = None
    """latent_mse / latent_mse of teacher@K (None without --teacher)."""
    image_psnr: float | None = None
    equivalent_steps: float | None = None
    """Where latent_mse sits on the teacher's step curve (students, baselines; --teacher)."""
    equivalent: str | None = None
    """The same in words: 'teacher@6.4', '< teacher@2', '> teacher@16'."""
    viewer: viewer.Score | None = None
    """What its samples show against their prompts (`eval/viewer.py`): shares of all four
    attributes right, each attribute, clear shapes, and the spread ratio to teacher@N. None
    unless every prompt is in the trained teacher's grammar."""


@dataclass(slots=True)
class EvalResult:
    records: int
    num_inference_steps: int
    """K: the steps the student sampled with."""
    teacher_steps: int
    """N: the steps of the cached teacher trajectories."""
    columns: list[Column]
    step_loss: float
    """The student's output-matching loss at the recorded (x_t, t): a step-imitation
    diagnostic (a K-step student is not trained for it)."""
    r_k: float | None = None
    """MSE(student@K, teacher@N) / MSE(teacher@K, teacher@N); None without --teacher."""
    baseline_r_k: float | None = None
    teacher_curve: dict[str, float] = field(default_factory=dict)
    """Teacher steps (a string: JSON keys) -> the teacher's MSE vs teacher@N from the same noise
    (`equivalent.curve_steps`; empty without --teacher)."""
    view: str = "latents"
    per_record: list[dict[str, Any]] = field(default_factory=list)
    grid: str | None = None
    warnings: list[str] = field(default_factory=list)
    """What makes these figures less meaningful (too few records), also in the table."""

    def column(self, name: str) -> Column:
        return next(c for c in self.columns if c.name == name)

    @property
    def student(self) -> Column:
        return next(c for c in self.columns if c.role == "student")

    @property
    def latent_mse(self) -> float:
        return self.student.latent_mse

    @property
    def latent_psnr(self) -> float:
        return self.student.latent_psnr

    @property
    def noise_mse(self) -> float:
        return self.column("noise").latent_mse

    @property
    def image_psnr(self) -> float | None:
        return self.student.image_psnr

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(latent_mse=self.latent_mse, latent_psnr=self.latent_psnr)
        return out

    def rows(self) -> list[list[str]]:
        """The header, then one row per column (what eval.md and the terminal table show)."""
        k, n = self.num_inference_steps, self.teacher_steps
        head = [
            "column",
            "steps",
            "forwards/sample",
            "wall s/sample",
            f"latent MSE vs teacher@{n}",
            "latent PSNR (dB)",
            f"MSE / MSE(teacher@{k})",
        ]
        images = any(c.image_psnr is not None for c in self.columns)
        if images:
            head.append("image PSNR (dB)")
        if self.teacher_curve:
            head.append("~ teacher steps")
        rows = [head]
        for c in self.columns:
            row = [
                c.name,
                str(c.steps),
                str(c.forwards_per_sample),
                _seconds(c),
                f"{c.latent_mse:.5f}",
                f"{c.latent_psnr:.2f}",
                "-" if c.ratio is None else f"{c.ratio:.3f}",
            ]
            if images:
                row.append("-" if c.image_psnr is None else f"{c.image_psnr:.2f}")
            if self.teacher_curve:
                row.append(c.equivalent or "-")
            rows.append(row)
        return rows

    def notes(self) -> list[str]:
        """What the table says, in sentences: record count, R_K, the baseline, warnings."""
        k, n = self.num_inference_steps, self.teacher_steps
        lines = [f"{self.records} held-out records, each from its own cached noise."]
        if self.r_k is not None:
            verdict = "better than" if self.r_k < 1 else "no better than"
            lines.append(
                f"R_{k} = MSE(student@{k}, teacher@{n}) / MSE(teacher@{k}, teacher@{n}) = "
                f"{self.r_k:.3f}: in {k} steps the student lands {verdict} the teacher does."
            )
        if self.teacher_curve:
            lines.append(
                f"student@{k} ~ {self.student.equivalent} on the teacher's own curve (MSE vs "
                f"teacher@{n} at each step count: "
                + ", ".join(f"@{s} {m:.5f}" for s, m in self.teacher_curve.items())
                + "; interpolated in log MSE)."
            )
        elif k >= n:
            lines.append(
                f"R_{k} is not defined: at K = {k} >= N = {n} the teacher@{k} column is the "
                f"reference itself (train the student for fewer steps than the teacher's)."
            )
        if self.baseline_r_k is not None:
            lines.append(
                f"The step-imitating baseline at {k} steps: ratio {self.baseline_r_k:.3f}."
            )
        lines.append(f"Student output-matching loss at the recorded steps: {self.step_loss:.5f}.")
        lines.extend(f"Warning: {w}" for w in self.warnings)
        return lines

    def viewer_rows(self) -> list[list[str]]:
        """What a viewer sees, per column (header first); [] when no column was judged."""
        scores = [(c.name, c.viewer) for c in self.columns]
        return viewer.table_rows(scores, self.teacher_steps)

    def table(self) -> str:
        """eval.md: one row per column (a markdown table), then what R_K says, then what a
        viewer sees (a second table) where the prompts are the trained teacher's."""
        lines = _markdown(self.rows())
        if seen := self.viewer_rows():
            lines += ["", *_markdown(seen), "", viewer.LEGEND]
        return "\n".join([*lines, "", *self.notes()])

    def console_table(self) -> Any:
        """The same for a terminal: a rich table whose cells wrap to the width it is given."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        k, n = self.num_inference_steps, self.teacher_steps
        _, *rows = self.rows()
        short = ["column", "steps", "fwd", "s/sample", f"MSE vs teacher@{n}", "PSNR dB", "ratio"]
        table = Table(*short, show_lines=False)
        if any(c.image_psnr is not None for c in self.columns):
            table.add_column("image PSNR")
        if self.teacher_curve:
            table.add_column("~ teacher")
        table.columns[0].no_wrap = True  # the column names are what a reader looks for
        for row in rows:
            if self.teacher_curve:  # '@5.5' under '~ teacher': 'teacher@5.5' is cut at 80 columns
                row[-1] = row[-1].replace("teacher@", "@")
            table.add_row(*row)
        legend = (
            f"fwd: transformer forwards per sample; ratio: MSE / MSE(teacher@{k}); "
            "PSNR of latents (images where a VAE decoded them)."
        )
        parts: list[Any] = [table, Text(legend)]
        if seen := self.viewer_rows():
            head, *rows = seen
            second = Table(*head, show_lines=False)
            second.columns[0].no_wrap = True
            for row in rows:
                second.add_row(*row)
            parts += [second, Text(viewer.LEGEND)]
        return Group(*parts, *(Text(line) for line in self.notes()))


def _markdown(rows: list[list[str]]) -> list[str]:
    rows = [rows[0], ["---"] * len(rows[0]), *rows[1:]]
    return ["| " + " | ".join(r) + " |" for r in rows]


def _seconds(c: Column) -> str:
    if c.seconds_per_sample is not None:
        return f"{c.seconds_per_sample:.4f}"
    return "cached" if c.role == "reference" else "-"


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


# --------------------------------------------------------------------------- entry


def evaluate(
    cache: str | Path,
    student: FinishedStudent,
    out_dir: str | Path,
    *,
    teacher: TeacherFolder | None = None,
    baseline: FinishedStudent | None = None,
    steps: int | None = None,
    split: str = "holdout",
    max_records: int | None = None,
    grid_records: int = 8,
    batch_size: int = 8,
    decode: bool = False,
    device: Placement | None = None,
    warn: Callable[[str], None] | None = None,
    curve: list[int] | None = None,
) -> EvalResult:
    """Check every input (nothing written on a problem), claim OUT, sample, score, write.

    `device` (`--device`, parsed by `placement.parse.parse_device`): where the students, the
    teacher's experts and VAE run, through the placement objects precompute uses; default CPU.
    `warn`: where a warning goes once the inputs checked out, before sampling (default: a
    `warning:` line on stderr); it is also kept in the result and its table.
    `curve`: the teacher step counts of the equivalent-steps curve (with `teacher` only;
    default `equivalent.curve_steps(N)`, [] for none)."""
    k = student.check_steps(steps)
    if decode and teacher is None:
        raise UsageError("--decode needs the teacher's VAE", fix="pass --teacher TEACHER")
    torch.manual_seed(0)
    with CacheReader(cache) as store:
        settings, dims = store.manifest.settings, store.manifest.dims
        shared = store.read_shared()
        if teacher is not None:
            _check_teacher(teacher, store.manifest.teacher, cache)
        located = held_out(store, split, max_records)
        notes = [n for n in [few_records(store, split, len(located), max_records)] if n]
        for who in (student, baseline):
            if who is not None:
                _check_source(who, store.manifest.teacher, cache)
        placement = _device_placement(device or Cpu(), teacher, settings)
        where = placement.execution_device()
        model = student.load().to(where)
        _check_fit(model, dims, cache, student.label)
        legs = [_student_leg(f"student@{k}", "student", model, student, k)]
        if baseline is not None:
            legs += _baseline_legs(baseline, k, dims, cache, where)
        steps_curve = None
        if teacher is not None:
            legs.insert(0, _teacher_leg(teacher, settings, k, placement))
            n = int(settings.num_inference_steps)
            points = equivalent.curve_steps(n) if curve is None else sorted(set(curve))
            if any(not 1 <= s <= n for s in points):
                raise UsageError(
                    f"teacher curve steps {points} leave 1..{n} (the cache's N)",
                    fix=f"choose step counts between 1 and {n}",
                )
            steps_curve = Curve(points, legs[0].sample) if points else None
        inputs = {"--cache": cache, "--teacher": teacher.path if teacher else None}
        inputs |= {student.flag: student.path, "--baseline": baseline.path if baseline else None}
        for note in notes:  # once every input checked out: a refused eval shows only its error
            (warn or _stderr_warning)(note)
        with outputs.claim(out_dir, "eval", inputs=inputs) as out:
            vae = (teacher, placement) if decode and teacher is not None else None
            stream = Stream(
                legs=legs,
                batches=_batches(store, located, settings, shared, batch_size),
                model=model,
                device=where,
                grid=_Grid(grid_records),
                decoder=_decoder(*vae) if vae is not None else None,
                curve=steps_curve,
            )
            result = _run(stream, settings)
            result.warnings = notes
            _write(result, stream.grid, out.path)
            return result


def held_out(store: CacheReader, split: str, limit: int | None) -> list[tuple[dict[str, Any], int]]:
    """Where the records to evaluate are, by key (deterministic): held out, or all of a
    separate cache. Located, not read: eval reads them a batch at a time (`_batches`)."""
    frac = store.manifest.settings.holdout_fraction or 0.0
    located = sorted(store.locate().items())
    if split == "holdout":
        if frac <= 0:
            raise UsageError(
                f"cache {str(store.path)!r} has no held-out records (holdout_fraction = 0)",
                fix="pass --split all with a separate eval cache, or precompute with "
                "--set cache.holdout_fraction=0.1",
            )
        located = [(k, v) for k, v in located if is_holdout(k, frac)]
    if limit is not None:
        located = located[:limit]
    if not located:
        raise UsageError(f"cache {str(store.path)!r} has no records in split {split!r}")
    return [v for _, v in located]


def few_records(store: CacheReader, split: str, count: int, limit: int | None) -> str | None:
    """One line when fewer than MIN_RECORDS records are evaluated (and --max-records did not ask
    for that), saying how to get more."""
    if count >= MIN_RECORDS or (limit is not None and limit < MIN_RECORDS):
        return None
    where = f"cache {str(store.path)!r}"
    if split == "all":
        return (
            f"only {count} records in {where}: a mean over so few is mostly noise; precompute "
            f"an eval cache of at least {MIN_RECORDS} prompts"
        )
    total = len(store)
    frac = store.manifest.settings.holdout_fraction or 0.0
    need = min(1.0, 1.5 * MIN_RECORDS / max(total, 1))
    return (
        f"only {count} held-out records in {where} ({total} records, cache.holdout_fraction = "
        f"{frac:g}): a mean over so few is mostly noise; precompute more prompts or a larger "
        f"fraction (--set cache.holdout_fraction={need:.2g}), or pass --split all with a "
        "separate eval cache"
    )


def _stderr_warning(message: str) -> None:
    import shutil
    import sys
    import textwrap

    width = min(shutil.get_terminal_size().columns, 100)  # a log gets 80 (COLUMNS honoured)
    text = textwrap.fill(
        f"warning: {message}",
        width=width,
        subsequent_indent="  ",
        break_long_words=False,
        break_on_hyphens=False,
    )
    print(text, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- checks


def _check_fit(model: torch.nn.Module, dims: DimsBlock, cache: str | Path, label: str) -> None:
    cfg = model.config
    if dims.text_dim is not None and (
        cfg.text_dim != dims.text_dim or cfg.in_channels != dims.latent_channels
    ):
        raise UsageError(
            f"{label} (text_dim {cfg.text_dim}, in_channels {cfg.in_channels}) does not fit cache "
            f"{str(cache)!r} (text_dim {dims.text_dim}, latent channels "
            f"{dims.latent_channels})",
            fix="evaluate the student on a cache of the teacher it was distilled from",
        )


def _check_source(who: FinishedStudent, recorded: TeacherBlock, cache: str | Path) -> None:
    """A run knows its teacher's fingerprint: it must be the cache's (an export does not)."""
    mine = who.sampling.teacher.fingerprint if who.sampling is not None else None
    want = recorded.fingerprint
    if mine and want and mine != want:
        raise UsageError(
            f"{who.label} was distilled from another teacher ({who.sampling.teacher.path}) than "
            f"cache {str(cache)!r} holds ({recorded.path})",
            fix="evaluate on a cache of the teacher the student was distilled from",
        )


def _check_teacher(teacher: TeacherFolder, recorded: TeacherBlock, cache: str | Path) -> None:
    """teacher@K must be the very teacher whose trajectories the cache holds."""
    want = recorded.fingerprint
    if want and teacher.fingerprint.get("fingerprint") != want:
        raise UsageError(
            f"--teacher {str(teacher.path)!r} is not the teacher cache {str(cache)!r} was made "
            f"with ({recorded.path})",
            fix="pass the teacher folder precompute ran on",
        )


# --------------------------------------------------------------------------- legs


def _student_leg(
    name: str, role: str, model: torch.nn.Module, student: FinishedStudent, steps: int
) -> Leg:
    pipe = student_pipeline(model, student.schedule)

    def sample(batch: Batch, s: int) -> torch.Tensor:
        return sample_latents(pipe, batch.noise, batch.embeds, s).cpu()

    return Leg(Column(name, role, steps, steps, 0.0), sample)


def _baseline_legs(
    baseline: FinishedStudent,
    k: int,
    dims: DimsBlock,
    cache: str | Path,
    device: torch.device,
) -> list[Leg]:
    """The step-imitating student at K and at its own steps (N)."""
    baseline.check_steps(k, "--steps (the baseline)")
    model = baseline.load().to(device)
    _check_fit(model, dims, cache, baseline.label)
    m = baseline.num_inference_steps
    return [_student_leg(f"baseline@{s}", "baseline", model, baseline, s) for s in sorted({k, m})]


def _teacher_leg(
    teacher: TeacherFolder, settings: SettingsBlock, k: int, placement: Placement
) -> Leg:
    """The teacher in WanPipeline at K steps: the cache's scheduler, dtype and CFG."""
    from diffusers import WanPipeline

    from wandistill.placement import load as pl
    from wandistill.placement.estimate import dtype_from_name

    dtype = dtype_from_name(settings.dtype or "fp32")
    experts = {
        name: pl.load_component(teacher, name, dtype=dtype, placement=placement)
        for name in teacher.experts
    }
    pipe = WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=None,
        transformer=experts["transformer"],
        transformer_2=experts.get("transformer_2"),
        boundary_ratio=teacher.boundary_ratio,
        scheduler=build_scheduler(
            {**(settings.scheduler_config or {}), "_class_name": settings.scheduler}
        ),
        expand_timesteps=teacher.expand_timesteps,
    )
    pipe.set_progress_bar_config(disable=True)
    g = float(settings.guidance_scale)
    g2 = settings.guidance_scale_2 if teacher.boundary_ratio is not None else None
    cfg = g > 1.0

    def sample(batch: Batch, s: int) -> torch.Tensor:
        return sample_latents(
            pipe,
            batch.noise,
            batch.embeds,
            s,
            negative_BLD=batch.negative if cfg else None,
            guidance_scale=g,
            guidance_scale_2=None if g2 is None else float(g2),
        ).cpu()

    # At K = N the column re-samples the cached reference: named apart from it.
    name = f"teacher@{k}" if k != int(settings.num_inference_steps) else f"teacher@{k} again"
    return Leg(Column(name, "teacher", k, k * (2 if cfg else 1), 0.0), sample)


def _batches(
    store: CacheReader,
    located: list[tuple[dict[str, Any], int]],
    settings: SettingsBlock,
    shared: dict[str, torch.Tensor],
    size: int,
) -> Iterator[Batch]:
    """The records, read `size` at a time (one batch of records in memory, whatever the
    split's size), embeddings zero-padded as the pipeline pads them; the negative is the
    record's own or the cache's shared one."""
    msl = int(settings.max_sequence_length)
    default = shared.get("negative_prompt_embeds")

    def negative(r: Record) -> torch.Tensor:
        own = r.negative_prompt_embeds
        neg = own if own is not None else default
        return pad_embeds(neg if neg is not None else r.prompt_embeds[:0], msl)

    for i in range(0, len(located), size):
        chunk = [store.read_record(*where) for where in located[i : i + size]]
        yield Batch(
            records=chunk,
            noise=torch.stack([r.noise for r in chunk]).float(),
            embeds=torch.stack([pad_embeds(r.prompt_embeds, msl) for r in chunk]),
            negative=torch.stack([negative(r) for r in chunk]),
        )


def _first(batch: Batch) -> Batch:
    return Batch(batch.records[:1], batch.noise[:1], batch.embeds[:1], batch.negative[:1])


# --------------------------------------------------------------------------- run


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
            for leg in stream.legs:  # warm-up: lazy inits stay out of the timing
                leg.sample(_first(b), 1)
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
    count = len(per_record)
    for c in columns:
        c.latent_mse, c.latent_psnr = sums[c.name].mse / count, sums[c.name].psnr / count
        if c.seconds_per_sample is not None:
            c.seconds_per_sample = sums[c.name].seconds / count
        if stream.decoder is not None:
            c.image_psnr = sums[c.name].image_psnr / count
    seen = tally.scores(names[1])
    for c in columns:
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


# --------------------------------------------------------------------------- write


def _write(result: EvalResult, grid: _Grid, out: Path) -> None:
    """grid.png (latents, or VAE-decoded frames with --decode), eval.json, eval.md."""
    names = [c.name for c in result.columns]
    result.view = "decoded" if grid.decoded else "latents"
    gridmod.write_grid(out / "grid.png", names, grid.prompts, grid.cells)
    result.grid = str(out / "grid.png")
    atomic_write_json(out / "eval.json", result.to_json())
    atomic_write_bytes(out / "eval.md", (result.table() + "\n").encode())


def _device_placement(
    device: Placement, folder: TeacherFolder | None, settings: SettingsBlock
) -> Placement:
    """`device` made concrete: auto is a GPU if the teacher's experts and VAE fit one at the
    cache's sizes (the first GPU if there is no teacher to plan), else the CPU."""
    from wandistill.placement import load as pl
    from wandistill.placement.estimate import SamplerSizes, dtype_from_name

    if folder is not None:
        sizes = SamplerSizes(
            int(settings.height),
            int(settings.width),
            int(settings.num_frames),
            1,
            int(settings.max_sequence_length),
            previews=True,
        )
        return pl.resolve_placement(
            device,
            folder=folder,
            dtype=dtype_from_name(settings.dtype or "fp32"),
            sizes=sizes,
            components=(*folder.experts, "vae"),
            only=(Cuda, Cpu),
        )
    if isinstance(device, Auto):
        device = Cuda() if torch.cuda.is_available() else Cpu()
    return pl.resolve_placement(device, folder={}, dtype=torch.float32)


def _decoder(teacher: TeacherFolder, placement: Placement) -> Decoder:
    """The teacher's VAE, loaded once: each batch's columns decoded to frames (image PSNR of
    each against teacher@N's frames is summed by `_run`)."""
    from wandistill.placement import load as pl
    from wandistill.teacher.decode import decode_latents

    vae = pl.load_component(teacher, "vae", dtype=torch.float32, placement=placement)

    def decode(finals: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        return {c: decode_latents(vae, latents) for c, latents in finals.items()}

    return decode
