"""`wandistill export`: a trained run + its teacher -> a complete diffusers WanPipeline folder.

    OUT/
      model_index.json          WanPipeline; transformer_2 = [null, null], no boundary_ratio
      transformer/              the student (or its EMA), config.json + safetensors, copied
      scheduler/                the student's K-step scheduler (see schedule.py)
      tokenizer/ text_encoder/ vae/   the teacher's, symlinked (absolute) or, with --copy, copied
      wandistill_export.json    K, the run, the teacher, the schedule: marks the folder as ours

so `WanPipeline.from_pretrained(OUT)(prompt, num_inference_steps=K, guidance_scale=1.0)` is the
whole user code. With no `transformer_2` and no `boundary_ratio`, WanPipeline runs the one
student for every step, which is what a Wan 2.2 student (one model for both experts) needs.

Everything the export needs besides the teacher's text encoder and VAE comes from the run:
`<run>/sampling.json` (written last by `wandistill train`, so it also marks a finished run) holds
K, the scheduler config and the digests of the teacher components the cache was made with; the
teacher passed here must have the same tokenizer, text encoder and VAE. The folder is built under
a temp name beside OUT, every file fsynced, permissions set from the umask (mkdtemp makes 0700),
then renamed into place; an existing OUT is replaced only if it is an export itself.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from wandistill import __version__
from wandistill.errors import UsageError
from wandistill.fsutil import atomic_write_json, fsync_dir, make_temp_dir, publish
from wandistill.student.schedule import StudentSchedule, build_scheduler

MARKER = "wandistill_export.json"
LINKED = ("tokenizer", "text_encoder", "vae")
"""Teacher components the export reuses as they are."""
SAMPLING = "sampling.json"
"""Written by train at the end (see wandistill.train.export)."""


class TeacherFolder(Protocol):
    """What export needs of `wandistill.teacher.folder.TeacherFolder` (the CLI opens it: this
    room never imports the teacher package)."""

    path: Path
    index: Any
    fingerprint: Any
    raw_scheduler_config: Any


@dataclass(frozen=True, slots=True)
class FinishedRun:
    path: Path
    weights: Path
    """The student/ or student_ema/ folder (diffusers save_pretrained)."""
    sampling: dict[str, Any]
    schedule: StudentSchedule


@dataclass(frozen=True, slots=True)
class ExportResult:
    out: Path
    num_inference_steps: int
    linked: bool
    weights: Path


def export(
    run: str | Path,
    teacher: TeacherFolder,
    out: str | Path,
    *,
    ema: bool = True,
    copy: bool = False,
) -> ExportResult:
    """Check run, teacher and OUT (nothing is written on any problem), then build and publish."""
    finished = read_run(Path(run), ema=ema)
    folder = check_teacher(teacher, finished)
    out = Path(out)
    refuse_foreign_out(out)
    tmp = make_temp_dir(out.parent, out.name)
    try:
        _apply_umask(tmp)
        _build(tmp, finished, folder, copy=copy)
        _fsync_tree(tmp)
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(out, finished.schedule.num_inference_steps, not copy, finished.weights)


# --------------------------------------------------------------------------- checks


def read_run(run: Path, *, ema: bool) -> FinishedRun:
    """The run's finished student: sampling.json, the weights folder, all weights finite."""
    name = "student_ema" if ema else "student"
    sampling_path = run / SAMPLING
    weights = run / name
    files = sorted(weights.glob("*.safetensors")) if weights.is_dir() else []
    if not sampling_path.is_file() or not (weights / "config.json").is_file() or not files:
        raise UsageError(
            f"--run {str(run)!r} holds no finished student ({SAMPLING} and {name}/ are written "
            "when `wandistill train` ends)",
            fix="pass the --out folder of a finished `wandistill train`, or finish it with "
            "--resume",
        )
    try:
        sampling = json.loads(sampling_path.read_text(encoding="utf-8"))
        schedule = StudentSchedule.from_json(sampling["student_schedule"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise UsageError(
            f"--run {str(run)!r}: {SAMPLING} is unreadable ({type(e).__name__}: {e})",
            fix="re-run the last `wandistill train ... --resume` to rewrite it",
        ) from None
    bad = _non_finite(files)
    if bad:
        raise UsageError(
            f"--run {str(run)!r}: the {name} weights hold NaN or inf ({', '.join(bad[:3])}); "
            "such a student samples garbage",
            fix="resume from an earlier checkpoint with a lower optim.lr, or export the other "
            "weights (--ema / --no-ema)",
        )
    return FinishedRun(run, weights, sampling, schedule)


def _non_finite(files: list[Path]) -> list[str]:
    """Names of tensors with a NaN or inf, read one tensor at a time."""
    bad = []
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for key in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                t = sf.get_tensor(key)
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    bad.append(key)
    return bad


def check_teacher(folder: TeacherFolder, run: FinishedRun) -> TeacherFolder:
    """The teacher (opened and validated by TeacherFolder), once it has the very tokenizer, text
    encoder and VAE the run's cache was made with (their digests are in the cache's teacher
    fingerprint)."""
    teacher = folder.path
    mine = folder.fingerprint["components"]
    recorded = run.sampling.get("teacher", {}).get("components") or {}
    source = run.sampling.get("teacher", {}).get("path")
    for name in LINKED:
        if name not in mine:
            raise UsageError(
                f"--teacher {str(teacher)!r} has no {name}/ folder", fix="pass a complete folder"
            )
        if recorded.get(name) is not None and mine[name] != recorded[name]:
            raise UsageError(
                f"--teacher {str(teacher)!r}: its {name} is not the one the run's cache was made "
                "with",
                fix=f"pass the teacher the run was distilled from ({source})",
            )
    return folder


def refuse_foreign_out(out: Path) -> None:
    """OUT may be new, empty, or an earlier export (replaced); anything else is someone's data.
    (One small function so a generic ownership-marker mechanism can replace it.)"""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} is a file", fix="choose a new folder for the export")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise UsageError(
            f"--out {str(out)!r} exists and is not a wandistill export; nothing was written",
            fix="choose a new folder, or remove that one yourself",
        )


# --------------------------------------------------------------------------- build


def _apply_umask(folder: Path) -> None:
    """mkdtemp makes 0700; give the folder the permissions a plain mkdir would have."""
    mask = os.umask(0)
    os.umask(mask)
    folder.chmod(0o777 & ~mask)


def _build(tmp: Path, run: FinishedRun, teacher: TeacherFolder, *, copy: bool) -> None:
    (tmp / "transformer").mkdir()
    for f in sorted(run.weights.iterdir()):
        if f.is_file():
            shutil.copyfile(f, tmp / "transformer" / f.name)  # copyfile: umask, not 0600
    scheduler = _scheduler(run.schedule, teacher)
    scheduler.save_pretrained(tmp / "scheduler")
    for name in LINKED:
        source = (teacher.path / name).resolve()
        if copy:
            shutil.copytree(source, tmp / name, copy_function=shutil.copyfile)
        else:
            os.symlink(source, tmp / name, target_is_directory=True)
    atomic_write_json(tmp / "model_index.json", _model_index(teacher, type(scheduler).__name__))
    atomic_write_json(
        tmp / MARKER,
        {
            "format": "wandistill-export",
            "wandistill_version": __version__,
            "num_inference_steps": run.schedule.num_inference_steps,
            "guidance_scale": 1.0,
            "run": str(run.path.resolve()),
            "weights": run.weights.name,
            "teacher": str(teacher.path.resolve()),
            "components": "copied" if copy else "symlinked",
            "student_schedule": run.schedule.to_json(),
        },
    )


def _scheduler(schedule: StudentSchedule, teacher: TeacherFolder) -> Any:
    """The run's scheduler; a step-imitation run on a cache that predates scheduler recording
    samples with the teacher folder's own (what it imitated)."""
    if schedule.scheduler is not None:
        return schedule.make_scheduler()
    return build_scheduler(dict(teacher.raw_scheduler_config or {}))


def _model_index(teacher: TeacherFolder, scheduler_class: str) -> dict[str, Any]:
    """WanPipeline with the student for every step: no transformer_2, no boundary_ratio."""
    import diffusers

    t = teacher.index
    return {
        "_class_name": "WanPipeline",
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", scheduler_class],
        "text_encoder": list(t.text_encoder),
        "tokenizer": list(t.tokenizer),
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": [None, None],
        "vae": list(t.vae),
        "expand_timesteps": t.expand_timesteps,
    }


def _fsync_tree(folder: Path) -> None:
    """fsync every file we wrote (not through the teacher symlinks), then every directory."""
    for root, dirs, files in os.walk(folder):  # os.walk does not follow directory symlinks
        for name in files:
            path = Path(root) / name
            if not path.is_symlink():
                with open(path, "rb") as fh:
                    os.fsync(fh.fileno())
        for name in dirs:
            if not (Path(root) / name).is_symlink():
                fsync_dir(Path(root) / name)
    fsync_dir(folder)


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename tmp onto OUT; an earlier export there is parked, swapped out, then deleted."""
    if out.is_dir() and any(out.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old)
        publish(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        publish(tmp, out)  # a rename onto an empty directory replaces it
