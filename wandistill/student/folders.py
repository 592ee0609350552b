"""Finished students on disk, each read once into one typed object (`FinishedStudent`).

A student reaches eval, sample and export in one of three forms, and each has its own reader:

- a run folder (`--run RUN`): `RUN/sampling.json`, written last by `wandistill train` (so it also
  marks a finished run), and the weights `RUN/student_ema/` (or `RUN/student/`);
- a run's weights folder (`--student RUN/student`): the same, `sampling.json` read from RUN;
- an export (`--export DIR`): the WanPipeline folder `wandistill export` writes, with its
  `wandistill_export.json`.

`sampling.json` and `wandistill_export.json` are parsed through `wandistill.validate` into the
pydantic models below: a damaged file is one line naming the file and the field, never a
KeyError. Whatever form it came in, a student carries its K-step schedule
(`schedule.StudentSchedule`) and the sampler sizes of the cache it was distilled from, so sample
and eval default to what the student was trained for.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator
from torch import nn

from wandistill.errors import UsageError
from wandistill.student.schedule import StudentSchedule
from wandistill.validate import Schema, load_json_file

SAMPLING = "sampling.json"
"""Written by train at the end (wandistill.train.export); marks a finished run."""
EXPORT_MARKER = "wandistill_export.json"
PIPELINE_PIECES = (
    "model_index.json",
    "transformer",
    "scheduler",
    "tokenizer",
    "text_encoder",
    "vae",
)
"""What an export folder holds besides its marker (WanPipeline's components, no transformer_2)."""
WEIGHTS = ("student_ema", "student")
_RESUME_FIX = "re-run the last `wandistill train ... --resume` to rewrite it"
_EXPORT_FIX = "re-run `wandistill export` into that folder to rewrite it"


class _Strict(Schema):
    """Strict types (no "4" for 4), finite floats; keys a later version may add are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class ScheduleFile(_Strict):
    """`StudentSchedule.to_json()`: the K steps the student samples at, and with what."""

    num_inference_steps: PositiveInt
    teacher_steps: list[int]
    sigmas: list[float]
    timesteps: list[float]
    scheduler: dict[str, Any] | None
    first_order: bool

    @model_validator(mode="after")
    def _k_steps(self) -> ScheduleFile:
        k = self.num_inference_steps
        if len(self.teacher_steps) != k or len(self.timesteps) != k:
            raise ValueError(f"teacher_steps and timesteps must hold K = {k} values each")
        if self.sigmas and len(self.sigmas) != k + 1:
            raise ValueError(f"sigmas must hold K + 1 = {k + 1} values")
        if self.scheduler is not None and not str(self.scheduler.get("_class_name", "")):
            raise ValueError("scheduler has no _class_name")
        return self

    def schedule(self) -> StudentSchedule:
        return StudentSchedule.from_json(self.model_dump())


class SamplerSizes(_Strict):
    """The cache's sampler settings a student samples with by default."""

    height: PositiveInt
    width: PositiveInt
    num_frames: PositiveInt
    max_sequence_length: PositiveInt
    teacher_guidance_scale: float
    """The CFG scale of the teacher the student learned from (the student itself uses 1.0)."""


class TeacherRef(_Strict):
    """The teacher a run was distilled from, as its cache recorded it."""

    fingerprint: str | None = None
    path: str | None = None
    num_inference_steps: PositiveInt | None = None
    boundary_ratio: float | None = None
    expand_timesteps: bool = False
    components: dict[str, dict[str, str] | None] = Field(default_factory=dict)
    """tokenizer / text_encoder / vae -> {file: digest} (the cache fingerprint's)."""


class SamplingFile(_Strict):
    """`RUN/sampling.json` (written by `wandistill.train.loop.sampling_record`)."""

    format: Literal["wandistill-student"]
    num_inference_steps: PositiveInt
    guidance_scale: float
    student_schedule: ScheduleFile
    objectives: dict[str, list[int]] = Field(default_factory=dict)
    train_steps: NonNegativeInt
    teacher: TeacherRef = Field(default_factory=TeacherRef)
    cache: str | None = None
    sampler: SamplerSizes | None = None
    """Absent in runs of earlier versions: the cache's manifest has the same values."""

    @model_validator(mode="after")
    def _one_k(self) -> SamplingFile:
        if self.num_inference_steps != self.student_schedule.num_inference_steps:
            raise ValueError("num_inference_steps differs from student_schedule's")
        return self


class ExportMarker(_Strict):
    """`EXPORT/wandistill_export.json` (written by `wandistill.student.export`)."""

    format: Literal["wandistill-export"]
    num_inference_steps: PositiveInt
    guidance_scale: float
    run: str
    weights: str
    teacher: str
    components: Literal["copied", "symlinked"]
    student_schedule: ScheduleFile
    sampler: SamplerSizes | None = None


@dataclass(frozen=True, slots=True)
class FinishedStudent:
    """A trained student ready to sample: weights, K-step schedule, default sampler sizes."""

    kind: Literal["run", "export"]
    path: Path
    """The folder the flag named: the run, the run's weights folder, or the export."""
    weights: Path
    """The WanTransformer3DModel folder (config.json + safetensors)."""
    schedule: StudentSchedule
    sizes: SamplerSizes | None
    sampling: SamplingFile | None = None
    """The run's sampling.json (runs only)."""
    label: str = ""
    """How messages name it: `--run '/x/run'`."""
    flag: str = "--run"
    """The flag that named it (for the output-overlap check)."""

    @property
    def num_inference_steps(self) -> int:
        return self.schedule.num_inference_steps

    def load(self) -> nn.Module:
        """The student as a WanTransformer3DModel (fp32, eval mode, no grad)."""
        from diffusers import WanTransformer3DModel

        from wandistill.modelfolder import load_pretrained

        try:
            model = load_pretrained(WanTransformer3DModel, self.weights)
        except (OSError, ValueError, KeyError, TypeError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UsageError(
                f"{self.label}: {str(self.weights)!r} does not load as a WanTransformer3DModel "
                f"({first})",
                fix="pass a folder written by `wandistill train` or `wandistill export`",
            ) from None
        return model.eval().requires_grad_(False)

    def check_steps(self, steps: int | None, flag: str = "--steps") -> int:
        """The steps to sample with: K by default; more than K is refused (the student never
        saw those timesteps, and a first-order K-step scheduler turns its corrector back on
        beyond K)."""
        k = self.num_inference_steps
        if steps is None:
            return k
        if steps > k:
            raise UsageError(
                f"{flag} {steps} is beyond the {k} steps {self.label} was trained to sample with",
                fix=f"pass {flag} {k} or fewer (or omit it: K = {k})",
            )
        return steps


# --------------------------------------------------------------------------- readers


def read_run(run: str | Path, *, ema: bool = True, flag: str = "--run") -> FinishedStudent:
    """A finished run: sampling.json (typed) and the weights folder it names."""
    run = Path(run)
    label = f"{flag} {str(run)!r}"
    name = WEIGHTS[0] if ema else WEIGHTS[1]
    weights = run / name
    if not run.is_dir():
        raise UsageError(
            f"{label} does not exist", fix="pass the --out folder of `wandistill train`"
        )
    if not (run / SAMPLING).is_file() or not weights.is_dir():
        raise UsageError(
            f"{label} holds no finished student ({SAMPLING} and {name}/ are written when "
            "`wandistill train` ends)",
            fix="pass the --out folder of a finished `wandistill train`, or finish it with "
            "--resume",
        )
    _check_weights(weights, f"{label}: {name}/", "re-run `wandistill train ... --resume`")
    sampling = _read(run / SAMPLING, SamplingFile, "run file", _RESUME_FIX)
    return FinishedStudent(
        kind="run",
        path=run,
        weights=weights,
        schedule=sampling.student_schedule.schedule(),
        sizes=sampling.sampler or _cache_sizes(sampling.cache),
        sampling=sampling,
        label=label,
        flag=flag,
    )


def read_student(weights: str | Path, *, flag: str = "--student") -> FinishedStudent:
    """A run's student/ or student_ema/ folder: its schedule comes from the run's sampling.json."""
    weights = Path(weights)
    label = f"{flag} {str(weights)!r}"
    _check_weights(
        weights, label, "pass <run>/student_ema or <run>/student of a finished `wandistill train`"
    )
    if not (weights.parent / SAMPLING).is_file():
        raise UsageError(
            f"{label}: the run around it has no {SAMPLING}, so the student's K-step schedule is "
            "unknown (train writes it when it finishes)",
            fix="finish the run with `wandistill train --resume`, or pass --export DIR",
        )
    run = read_run(weights.parent, flag=flag)
    return FinishedStudent(
        kind="run",
        path=weights,
        weights=weights,
        schedule=run.schedule,
        sizes=run.sizes,
        sampling=run.sampling,
        label=label,
        flag=flag,
    )


def read_export(folder: str | Path, *, flag: str = "--export") -> FinishedStudent:
    """An export folder: every WanPipeline piece present, the marker typed."""
    folder = Path(folder)
    label = f"{flag} {str(folder)!r}"
    fix = "pass a folder written by `wandistill export` (re-run it to complete this one)"
    if not folder.is_dir():
        raise UsageError(f"{label} does not exist", fix=fix)
    if not (folder / EXPORT_MARKER).is_file():
        raise UsageError(f"{label} is not a wandistill export (no {EXPORT_MARKER})", fix=fix)
    missing = [p for p in PIPELINE_PIECES if not (folder / p).exists()]
    if missing:
        raise UsageError(f"{label} is incomplete: {', '.join(missing)} missing", fix=fix)
    _check_weights(folder / "transformer", f"{label}: transformer/", fix)
    marker = _read(folder / EXPORT_MARKER, ExportMarker, "export file", _EXPORT_FIX)
    return FinishedStudent(
        kind="export",
        path=folder,
        weights=folder / "transformer",
        schedule=marker.student_schedule.schedule(),
        sizes=marker.sampler,
        label=label,
        flag=flag,
    )


def _read(path: Path, model: type[Any], what: str, fix: str) -> Any:
    parsed, _ = load_json_file(path, model, what=what, fix=fix)
    return parsed


def _has_weights(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _check_weights(folder: Path, label: str, fix: str) -> None:
    """The one check of a student weights folder: present, no custom code, no pickle-only
    weights (named with the conversion), config.json + safetensors, config.json typed and of a
    sane size (before diffusers reads it)."""
    from wandistill.modelfolder import (
        Reader,
        read_weights,
        refuse_custom_code,
        require_safetensors,
    )
    from wandistill.student.config import check_saved_config

    if not folder.is_dir():
        raise UsageError(f"{label} does not exist", fix=fix)
    refuse_custom_code(folder, "student")
    require_safetensors(folder, "student")
    if not _has_weights(folder):
        raise UsageError(f"{label} is not a student folder (config.json + safetensors)", fix=fix)
    check_saved_config(folder)
    # Every weight file's header, size and offsets, as `from_pretrained` will read them: a
    # truncated or damaged file is one line naming it (the same check teacher folders get).
    read_weights(
        folder,
        "diffusion_pytorch_model",
        library="diffusers",
        class_name="WanTransformer3DModel",
        reader=Reader("student weight file"),
    )


def _cache_sizes(cache: str | None) -> SamplerSizes | None:
    """Runs of earlier versions: the sampler sizes from the cache they were trained on (if it is
    still there)."""
    if not cache or not (Path(cache) / "manifest.json").is_file():
        return None
    from wandistill.cache.manifest import load_committed
    from wandistill.errors import WandistillError

    try:
        settings = load_committed(cache).settings
    except WandistillError:
        return None
    return sizes_from_settings(settings)


def sizes_from_settings(settings: dict[str, Any]) -> SamplerSizes | None:
    """The sampler sizes of a cache manifest's settings (None if it lacks them)."""
    try:
        return SamplerSizes(
            height=int(settings["height"]),
            width=int(settings["width"]),
            num_frames=int(settings["num_frames"]),
            max_sequence_length=int(settings["max_sequence_length"]),
            teacher_guidance_scale=float(settings["guidance_scale"]),
        )
    except (KeyError, TypeError, ValueError):
        return None


def open_student(
    *,
    run: str | Path | None = None,
    export: str | Path | None = None,
    student: str | Path | None = None,
    ema: bool = True,
    required: bool = True,
) -> FinishedStudent | None:
    """The one student named by `--run`, `--export` or `--student` (the CLI's flags)."""
    given = {"--run": run, "--export": export, "--student": student}
    named = [flag for flag, v in given.items() if v is not None]
    if len(named) > 1:
        raise UsageError(f"{' and '.join(named)} both name a student", fix="pass one of them")
    if not named:
        if required:
            raise UsageError(
                "no student given",
                fix="pass --run RUN (a finished train), --export DIR or --student RUN/student",
            )
        return None
    if run is not None:
        return read_run(run, ema=ema)
    if export is not None:
        return read_export(export)
    return read_student(student)  # type: ignore[arg-type]
