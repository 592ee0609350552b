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
goes into a running sum, and the batch is dropped (`eval.stream`: `Stream`, `_run`); only the
grid's first rows and the per-record figures are kept, so memory does not grow with the held-out
records.

Writes eval.md (the table), eval.json (every figure, per record too; `eval.result`) and
grid.png (see `grid.py`).
Deterministic: no randomness is drawn; the figures repeat exactly, the wall times do not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from wandistill.cache.contract import Record, is_holdout, pad_embeds
from wandistill.cache.files import DimsBlock, SettingsBlock, TeacherBlock
from wandistill.cache.reader import CacheReader
from wandistill.errors import UsageError
from wandistill.eval import equivalent
from wandistill.eval import grid as gridmod
from wandistill.eval.result import MIN_RECORDS, Column, EvalResult
from wandistill.eval.stream import (
    Batch,
    Curve,
    Decoder,
    Leg,
    Stream,
    _Grid,
    _run,
)
from wandistill.io import outputs
from wandistill.io.fsutil import atomic_write_bytes, atomic_write_json
from wandistill.placement.auto import Auto
from wandistill.placement.strategies import Cpu, Cuda, Placement
from wandistill.student.folders import FinishedStudent
from wandistill.student.sampler import sample_latents, student_pipeline
from wandistill.student.schedule import build_scheduler
from wandistill.teacher.folder import TeacherFolder

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
        keys = ("height", "width", "num_frames", "max_sequence_length")
        sizes = SamplerSizes(**{k: int(getattr(settings, k)) for k in keys}, previews=True)
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
    return lambda finals: {c: decode_latents(vae, latents) for c, latents in finals.items()}
