"""`wandistill export`: a trained run + its teacher -> a complete diffusers WanPipeline folder.

    OUT/
      model_index.json          WanPipeline; transformer_2 = [null, null], no boundary_ratio
      transformer/              the student (or its EMA), config.json + safetensors, copied
      (per-expert students: transformer/ is the high-noise one, transformer_2/ the low-noise
      one, and model_index.json holds the run's boundary_ratio: docs/export.md)
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

A LoRA run (`[train.student.lora]`) exports, by default, its adapter for the teacher folder:

    OUT/
      pytorch_lora_weights.safetensors   diffusers' Wan LoRA format (`transformer.` keys + config)
      scheduler/                         the student's K-step scheduler
      wandistill_export.json             format "wandistill-lora", K, the run, the teacher

used as `pipe = WanPipeline.from_pretrained(TEACHER); pipe.load_lora_weights(OUT);
pipe.scheduler = <class>.from_pretrained(OUT, subfolder="scheduler")`, then K steps at guidance
1.0. `--merge-lora` instead writes the pipeline above with the adapter merged into the teacher's
transformer (fuse_lora + unload_lora). Either way the --teacher's base component must be the
very one the run's cache was made with (its file digests).

A per-expert LoRA run (one adapter per Wan 2.2 expert) exports two LoRA files for the Wan 2.2
teacher folder, `OUT/transformer/` and `OUT/transformer_2/` (each a `pytorch_lora_weights.
safetensors` in the same format), used as `pipe.load_lora_weights(OUT/transformer)` and
`pipe.load_lora_weights(OUT/transformer_2, load_into_transformer_2=True)`: the teacher's own
pipeline then switches experts at its boundary_ratio, which must be the one the run split at
(checked). `--merge-lora` writes the per-expert pipeline (transformer, transformer_2,
boundary_ratio) with each adapter merged into its expert.

OUT is claimed like every output folder (`wandistill.io.outputs.claim(out, "export")`: new, empty or
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

from wandistill import __version__
from wandistill.checks.finite import is_finite
from wandistill.errors import UsageError
from wandistill.io import outputs
from wandistill.io.fsutil import (
    atomic_write_json,
    copy_tree,
    fsync_dir,
    fsync_tree,
    make_temp_dir,
)
from wandistill.student import experts
from wandistill.student.folders import EXPORT_MARKER, FinishedStudent, read_run
from wandistill.student.lora import LORA_FILE
from wandistill.student.schedule import StudentSchedule, build_scheduler

LINKED = ("tokenizer", "text_encoder", "vae")
"""Teacher components the export reuses as they are."""
INDEX = "model_index.json"

__all__ = ["LINKED", "ExportResult", "check_teacher", "export"]


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
    lora: bool = False
    """OUT holds a LoRA file for the teacher folder, not a pipeline."""
    usage: str = ""
    """A LoRA export: the stock diffusers lines that sample it (also in the marker)."""


def export(
    run: str | Path,
    teacher: TeacherFolder,
    out: str | Path,
    *,
    ema: bool = True,
    copy: bool = False,
    merge_lora: bool = False,
) -> ExportResult:
    """Check run, teacher and OUT (nothing is written on any problem), then build and install."""
    finished = read_run(Path(run), ema=ema)
    refuse_non_finite(finished)
    check_teacher(teacher, finished)
    if merge_lora and finished.lora is None:
        raise UsageError(
            f"--merge-lora: {finished.label} is a full student, it has no LoRA to merge",
            fix="leave --merge-lora out",
        )
    if finished.lora is not None:
        check_lora_base(teacher, finished)
    lora_file = finished.lora is not None and not merge_lora
    last = INDEX
    if lora_file:
        check_lora_boundary(teacher, finished)
        last = experts.LOW if finished.boundary_ratio is not None else LORA_FILE
    inputs = {"--run": run, "--teacher": teacher.path}
    with outputs.claim(out, "export", inputs=inputs) as claimed:
        tmp = make_temp_dir(claimed.path, "export")
        try:
            scheduler = _scheduler(finished.schedule, teacher)  # the K-step one
            scheduler.save_pretrained(tmp / "scheduler")
            name = type(scheduler).__name__
            usage = _build_lora(tmp, finished, teacher, name) if lora_file else ""
            if not lora_file:
                _build(tmp, finished, teacher, name, copy=copy)
            fsync_tree(tmp)
            _install(tmp, claimed.path, last=last)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    k = finished.num_inference_steps
    return ExportResult(Path(out), k, not copy, finished.weights, lora=lora_file, usage=usage)


# --------------------------------------------------------------------------- checks


def refuse_non_finite(run: FinishedStudent) -> None:
    """A student whose weights hold NaN or inf samples garbage: refuse it by name (its tensors
    read one at a time)."""
    bad = []
    for f in sorted(run.weights.rglob("*.safetensors")):
        with safe_open(f, framework="pt") as sf:
            for key in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                if not is_finite(sf.get_tensor(key)):
                    bad.append(key)
    if bad:
        raise UsageError(
            f"{run.label}: the {run.weights.name} weights hold NaN or inf "
            f"({', '.join(bad[:3])}); such a student samples garbage",
            fix="resume from an earlier checkpoint with a lower optim.lr, or export the other "
            "weights (--ema / --no-ema)",
        )


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


def check_lora_base(folder: TeacherFolder, run: FinishedStudent) -> None:
    """The --teacher's base component (transformer, or transformer_2 for a Wan 2.2 expert; a
    per-expert run: both) is the one the run's cache was made with: a LoRA only means something
    on its base."""
    assert run.lora is not None
    for name, recorded in run.lora.bases(run.boundary_ratio is not None).items():
        mine = folder.fingerprint["components"].get(name)
        if mine is None:
            raise UsageError(
                f"--teacher {str(folder.path)!r} has no {name}/ for the LoRA of {run.label}",
                fix="pass the teacher folder the run was distilled from",
            )
        if recorded is not None and mine != recorded:
            raise UsageError(
                f"--teacher {str(folder.path)!r}: its {name} is not the one the LoRA of "
                f"{run.label} was trained on",
                fix="pass the teacher the run was distilled from "
                f"({run.sampling.teacher.path if run.sampling else '?'})",
            )


def check_lora_boundary(folder: TeacherFolder, run: FinishedStudent) -> None:
    """Per-expert LoRA files run inside the teacher's own pipeline, which switches experts at
    the teacher's boundary_ratio: it must be the one the run split its K steps at."""
    if run.boundary_ratio is None:
        return
    theirs = folder.index.boundary_ratio if folder.index.present(experts.LOW) else None
    if theirs is None or abs(float(theirs) - run.boundary_ratio) > 1e-9:
        raise UsageError(
            f"--teacher {str(folder.path)!r} switches experts at boundary_ratio {theirs}, but the "
            f"per-expert LoRAs of {run.label} were trained split at {run.boundary_ratio:g}",
            fix="pass the Wan 2.2 teacher the run was distilled from, or export with "
            "--merge-lora (a pipeline that carries the run's boundary_ratio)",
        )


# --------------------------------------------------------------------------- build


def lora_usage(teacher: Path, out: Path, run: FinishedStudent, scheduler: str, wan22: bool) -> str:
    """Stock diffusers code that samples a LoRA export as the project's sampler does: the
    teacher's pipeline with the adapter loaded and the K-step scheduler. A Wan 2.2 teacher's
    pipeline is loaded without its second expert and boundary (the student runs every step),
    with the adapted expert as `transformer`; per-expert LoRAs go one into each expert of the
    teacher's own pipeline."""
    assert run.lora is not None
    kw, loads = "", [f"pipe.load_lora_weights({str(out)!r})"]
    if run.boundary_ratio is not None:
        loads = [
            f"pipe.load_lora_weights({str(out / experts.HIGH)!r})",
            f"pipe.load_lora_weights({str(out / experts.LOW)!r}, load_into_transformer_2=True)",
        ]
    elif run.lora.component != "transformer":
        kw += (
            f", transformer=WanTransformer3DModel.from_pretrained({str(teacher)!r}, "
            f"subfolder={run.lora.component!r})"
        )
    if wan22 and run.boundary_ratio is None:
        kw += ", transformer_2=None, boundary_ratio=None"
    return "\n".join(
        [
            f"pipe = WanPipeline.from_pretrained({str(teacher)!r}{kw})",
            *loads,
            f"pipe.scheduler = diffusers.{scheduler}.from_pretrained({str(out)!r}, "
            "subfolder='scheduler')",
            f"pipe(prompt, num_inference_steps={run.num_inference_steps}, guidance_scale=1.0)",
        ]
    )


def _build_lora(tmp: Path, run: FinishedStudent, teacher: TeacherFolder, scheduler: str) -> str:
    """The adapter file as train wrote it (per expert: `transformer/`, `transformer_2/`) and
    the marker; returns the usage lines (`scheduler`: the K-step scheduler's class)."""
    if run.boundary_ratio is None:
        shutil.copyfile(run.weights / LORA_FILE, tmp / LORA_FILE)
    else:
        for name, folder in run.expert_folders.items():
            (tmp / name).mkdir()
            shutil.copyfile(folder / LORA_FILE, tmp / name / LORA_FILE)
    assert run.lora is not None
    wan22 = bool(teacher.index.present("transformer_2"))
    out = tmp.parent.resolve()  # the claimed OUT the entries move into
    usage = lora_usage(teacher.path.resolve(), out, run, scheduler, wan22)
    own = {"lora": run.lora.model_dump(), "scheduler_class": scheduler, "wan22_teacher": wan22}
    atomic_write_json(tmp / EXPORT_MARKER, _marker("lora", run, teacher, **own, usage=usage))
    return usage


def _merged_transformers(run: FinishedStudent, teacher: TeacherFolder, tmp: Path) -> None:
    """The teacher's base with the adapter merged in (peft's merge, through diffusers'
    fuse_lora), the adapter layers removed: a plain WanTransformer3DModel folder, `transformer/`
    (per-expert: and `transformer_2/`, each expert's own adapter merged into it)."""
    model = run.load(teacher.path)
    for name, expert in experts.pipeline_parts(model).items():
        if not isinstance(expert, torch.nn.Module):
            continue  # boundary_ratio, or no transformer_2
        expert.fuse_lora()  # type: ignore[operator]
        expert.unload_lora()  # type: ignore[operator]
        expert.save_pretrained(tmp / name, safe_serialization=True)  # type: ignore[operator]


def _build(
    tmp: Path, run: FinishedStudent, teacher: TeacherFolder, scheduler: str, *, copy: bool
) -> None:
    if run.lora is not None:
        _merged_transformers(run, teacher, tmp)
    else:
        for name, folder in run.expert_folders.items():
            (tmp / name).mkdir()
            for f in sorted(folder.iterdir()):
                if f.is_file():
                    shutil.copyfile(f, tmp / name / f.name)  # copyfile: umask, not 0600
    for name in LINKED:
        source = (teacher.path / name).resolve()
        if copy:
            copy_tree(source, tmp / name)  # a failure is that file's one error
        else:
            os.symlink(source, tmp / name, target_is_directory=True)
    atomic_write_json(tmp / INDEX, _model_index(teacher, scheduler, run.boundary_ratio))
    components = "copied" if copy else "symlinked"
    atomic_write_json(tmp / EXPORT_MARKER, _marker("export", run, teacher, components=components))


def _marker(kind: str, run: FinishedStudent, teacher: TeacherFolder, **own: Any) -> dict:
    """The marker's fields both export kinds write, around `own` (the kind's, in order)."""
    return {
        "format": f"wandistill-{kind}",
        "wandistill_version": __version__,
        "num_inference_steps": run.num_inference_steps,
        "guidance_scale": 1.0,
        "run": str(run.path.resolve()),
        "weights": run.weights.name,
        "teacher": str(teacher.path.resolve()),
        **own,
        "student_schedule": run.schedule.to_json(),
        "sampler": run.sizes.model_dump() if run.sizes is not None else None,
        "boundary_ratio": run.boundary_ratio,
    }


def _scheduler(schedule: StudentSchedule, teacher: TeacherFolder) -> Any:
    """The run's scheduler; a step-imitation run on a cache that predates scheduler recording
    samples with the teacher folder's own (what it imitated)."""
    if schedule.scheduler is not None:
        return schedule.make_scheduler()
    return build_scheduler(dict(teacher.raw_scheduler_config or {}))


def _model_index(
    teacher: TeacherFolder, scheduler_class: str, boundary_ratio: float | None
) -> dict[str, Any]:
    """WanPipeline with the student for every step (no transformer_2, no boundary_ratio), or
    with both per-expert students and the boundary WanPipeline switches them at."""
    import diffusers

    t = teacher.index
    wan = ["diffusers", "WanTransformer3DModel"]
    index = {
        "_class_name": "WanPipeline",
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", scheduler_class],
        "text_encoder": list(t.text_encoder),
        "tokenizer": list(t.tokenizer),
        "transformer": wan,
        "transformer_2": [None, None] if boundary_ratio is None else wan,
        "vae": list(t.vae),
        "expand_timesteps": t.expand_timesteps,
    }
    if boundary_ratio is not None:
        index["boundary_ratio"] = boundary_ratio
    return index


def _install(tmp: Path, out: Path, *, last: str = INDEX) -> None:
    """Move the built entries into OUT, `last` (model_index.json, or a LoRA export's LoRA
    file) last. What an earlier export left (the claim made sure OUT holds nothing else of
    anyone's) is parked in a temp folder, which the claim of a later run removes if this
    process dies before it does."""
    old = make_temp_dir(out, "export.old")
    try:
        _park(out / INDEX, old)  # from here until the end, OUT is no loadable pipeline
        _park(out / LORA_FILE, old)  # nor a loadable LoRA
        _park(out / last, old)  # nor the (per-expert) entry whose presence says complete
        fsync_dir(out)
        keep = outputs.BOOKKEEPING | {tmp.name, old.name}
        for entry in sorted(out.iterdir()):
            if entry.name not in keep:
                _park(entry, old)
        for entry in sorted(tmp.iterdir()):
            if entry.name != last:
                os.replace(entry, out / entry.name)
        fsync_dir(out)
        os.replace(tmp / last, out / last)
        fsync_dir(out)
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _park(entry: Path, old: Path) -> None:
    if entry.exists() or entry.is_symlink():
        os.replace(entry, old / entry.name)
