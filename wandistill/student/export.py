"""`wandistill export`: a trained run + its teacher -> a complete diffusers WanPipeline folder.

    OUT/
      model_index.json          WanPipeline; transformer_2 = [null, null], no boundary_ratio
      transformer/              the student (or its EMA), config.json + safetensors, copied
      scheduler/                the student's K-step scheduler (see schedule.py)
      tokenizer/ text_encoder/ vae/   the teacher's, symlinked (absolute) or, with --copy, copied
      wandistill_export.json    K, the run, the teacher, the schedule, the sampler sizes

so `WanPipeline.from_pretrained(OUT)(prompt, num_inference_steps=K, guidance_scale=1.0)` is the
whole user code. With no `transformer_2` and no `boundary_ratio`, WanPipeline runs the one
student for every step, which is what a Wan 2.2 student (one model for both experts) needs.

Everything the export needs besides the teacher's text encoder and VAE comes from the run:
`<run>/sampling.json` (read as a typed `folders.SamplingFile`) holds K, the scheduler config and
the digests of the teacher components the cache was made with; the teacher passed here must have
the same tokenizer, text encoder and VAE.

OUT is claimed like every output folder (`wandistill.outputs.claim(out, "export")`: new, empty or
an earlier export; one writer). The new pipeline is built in a temp folder inside OUT (which the
claim clears if a writer died), every file fsynced, then moved entry by entry into place with
`model_index.json` last: a reader that finds model_index.json finds every piece it names. An
earlier export's model_index.json is removed first, so no reader loads a mix of old and new.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from wandistill import __version__, outputs
from wandistill.errors import UsageError
from wandistill.fsutil import atomic_write_json, copy_tree, fsync_dir, make_temp_dir
from wandistill.student.folders import EXPORT_MARKER, SAMPLING, FinishedStudent, read_run
from wandistill.student.schedule import StudentSchedule, build_scheduler

MARKER = EXPORT_MARKER
LINKED = ("tokenizer", "text_encoder", "vae")
"""Teacher components the export reuses as they are."""
INDEX = "model_index.json"

__all__ = ["LINKED", "MARKER", "SAMPLING", "ExportResult", "check_teacher", "export"]


class TeacherFolder(Protocol):
    """What export needs of `wandistill.teacher.folder.TeacherFolder` (the CLI opens it: this
    room never imports the teacher package)."""

    path: Path
    index: Any
    fingerprint: Any
    raw_scheduler_config: Any


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
    """Check run, teacher and OUT (nothing is written on any problem), then build and install."""
    finished = read_run(Path(run), ema=ema)
    refuse_non_finite(finished)
    check_teacher(teacher, finished)
    inputs = {"--run": run, "--teacher": teacher.path}
    with outputs.claim(out, "export", inputs=inputs) as claimed:
        tmp = make_temp_dir(claimed.path, "export")
        try:
            _build(tmp, finished, teacher, copy=copy)
            _fsync_tree(tmp)
            _install(tmp, claimed.path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return ExportResult(Path(out), finished.num_inference_steps, not copy, finished.weights)


# --------------------------------------------------------------------------- checks


def refuse_non_finite(run: FinishedStudent) -> None:
    """A student whose weights hold NaN or inf samples garbage: refuse it by name."""
    bad = _non_finite(sorted(run.weights.glob("*.safetensors")))
    if bad:
        raise UsageError(
            f"{run.label}: the {run.weights.name} weights hold NaN or inf "
            f"({', '.join(bad[:3])}); such a student samples garbage",
            fix="resume from an earlier checkpoint with a lower optim.lr, or export the other "
            "weights (--ema / --no-ema)",
        )


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


def check_teacher(folder: TeacherFolder, run: FinishedStudent) -> TeacherFolder:
    """The teacher (opened and validated by TeacherFolder), once it has the very tokenizer, text
    encoder and VAE the run's cache was made with (their digests are in the cache's teacher
    fingerprint). Sample checks a teacher it pairs with a run's student the same way."""
    teacher = folder.path
    mine = folder.fingerprint["components"]
    ref = run.sampling.teacher if run.sampling is not None else None
    recorded = ref.components if ref is not None else {}
    for name in LINKED:
        if name not in mine:
            raise UsageError(
                f"--teacher {str(teacher)!r} has no {name}/ folder", fix="pass a complete folder"
            )
        if recorded.get(name) is not None and mine[name] != recorded[name]:
            raise UsageError(
                f"--teacher {str(teacher)!r}: its {name} is not the one the run's cache was made "
                "with",
                fix=f"pass the teacher the run was distilled from ({ref.path if ref else '?'})",
            )
    return folder


# --------------------------------------------------------------------------- build


def _build(tmp: Path, run: FinishedStudent, teacher: TeacherFolder, *, copy: bool) -> None:
    (tmp / "transformer").mkdir()
    for f in sorted(run.weights.iterdir()):
        if f.is_file():
            shutil.copyfile(f, tmp / "transformer" / f.name)  # copyfile: umask, not 0600
    scheduler = _scheduler(run.schedule, teacher)
    scheduler.save_pretrained(tmp / "scheduler")
    for name in LINKED:
        source = (teacher.path / name).resolve()
        if copy:
            copy_tree(source, tmp / name)  # a failure is that file's one error
        else:
            os.symlink(source, tmp / name, target_is_directory=True)
    atomic_write_json(tmp / INDEX, _model_index(teacher, type(scheduler).__name__))
    sizes = run.sizes.model_dump() if run.sizes is not None else None
    atomic_write_json(
        tmp / MARKER,
        {
            "format": "wandistill-export",
            "wandistill_version": __version__,
            "num_inference_steps": run.num_inference_steps,
            "guidance_scale": 1.0,
            "run": str(run.path.resolve()),
            "weights": run.weights.name,
            "teacher": str(teacher.path.resolve()),
            "components": "copied" if copy else "symlinked",
            "student_schedule": run.schedule.to_json(),
            "sampler": sizes,
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


def _install(tmp: Path, out: Path) -> None:
    """Move the built entries into OUT, model_index.json last. What an earlier export left
    (the claim made sure OUT holds nothing else of anyone's) is parked in a temp folder, which
    the claim of a later run removes if this process dies before it does."""
    old = make_temp_dir(out, "export.old")
    try:
        _park(out / INDEX, old)  # from here until the end, OUT is no loadable pipeline
        fsync_dir(out)
        keep = outputs.BOOKKEEPING | {tmp.name, old.name}
        for entry in sorted(out.iterdir()):
            if entry.name not in keep:
                _park(entry, old)
        for entry in sorted(tmp.iterdir()):
            if entry.name != INDEX:
                os.replace(entry, out / entry.name)
        fsync_dir(out)
        os.replace(tmp / INDEX, out / INDEX)
        fsync_dir(out)
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _park(entry: Path, old: Path) -> None:
    if entry.exists() or entry.is_symlink():
        os.replace(entry, old / entry.name)
