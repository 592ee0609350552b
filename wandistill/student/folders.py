"""Finished students on disk, each read once into one typed object (`FinishedStudent`).

A student reaches eval, sample and export in one of three forms, and each has its own reader:

- a run folder (`--run RUN`): `RUN/sampling.json`, written last by `wandistill train` (so it also
  marks a finished run), and the weights `RUN/student_ema/` (or `RUN/student/`);
- a run's weights folder (`--student RUN/student`): the same, `sampling.json` read from RUN;
- an export (`--export DIR`): the WanPipeline folder `wandistill export` writes, with its
  `wandistill_export.json`.

A LoRA run's weights folders hold only `pytorch_lora_weights.safetensors` (diffusers' LoRA
format); its sampling.json's `lora` (`LoraRecord`) names the adapter's config and its base, the
teacher's transformer, which `FinishedStudent.load` reads and adapts. A per-expert LoRA run's
hold one such file in `transformer/` and one in `transformer_2/` (plus `experts.json`), each
expert's adapter on its own teacher expert.

`sampling.json` and `wandistill_export.json` are parsed through `checks.validate` into the
pydantic models below: a damaged file is one line naming the file and the field, never a
KeyError. Whatever form it came in, a student carries its K-step schedule
(`schedule.StudentSchedule`) and the sampler sizes of the cache it was distilled from, so sample
and eval default to what the student was trained for.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator
from torch import nn

from wandistill.cache.files import SettingsBlock
from wandistill.checks.validate import Schema, load_json_file
from wandistill.errors import UsageError
from wandistill.student import experts
from wandistill.student.schedule import StudentSchedule

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
"""What an export folder holds besides its marker (WanPipeline's components; per-expert students
add transformer_2)."""
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


class LoraRecord(_Strict):
    """sampling.json's `lora` (`wandistill.student.lora.record`): the adapter and its base."""

    rank: PositiveInt
    alpha: float
    target_modules: list[str] = Field(min_length=1)
    dropout: float = 0.0
    component: str = "transformer"
    """The teacher folder's component the adapter applies to (transformer / transformer_2)."""
    base: str | None = None
    """student.init_from_teacher.path of the run: the teacher folder (or its component)."""
    base_files: dict[str, str] | None = None
    """{file: digest} of the cache teacher's `component` (export checks its --teacher)."""
    expert_base_files: dict[str, dict[str, str] | None] | None = None
    """Per-expert students: transformer / transformer_2 -> {file: digest} of each expert's base
    (each adapter applies to its own expert)."""

    def bases(self, per_expert: bool) -> dict[str, dict[str, str] | None]:
        """The teacher components the adapters apply to -> their recorded digests."""
        if per_expert:
            return dict(self.expert_base_files or dict.fromkeys(experts.EXPERTS))
        return {self.component: self.base_files}

    def base_folder(self, teacher: Path | None = None, component: str | None = None) -> Path:
        """The base transformer folder: `teacher`'s component when given, else the run's
        (`component`: a per-expert student's expert; default: the recorded one)."""
        name = component or self.component
        root = teacher if teacher is not None else Path(self.base or "")
        return root / name if (root / name).is_dir() else root


class SamplingFile(_Strict):
    """`RUN/sampling.json` (written by `wandistill.train.records.sampling_record`)."""

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
    lora: LoraRecord | None = None
    """A LoRA student's adapter and base; None: a full student."""

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
    boundary_ratio: Annotated[float, Field(gt=0.0, lt=1.0)] | None = None
    """Per-expert students: transformer/ samples t >= boundary_ratio * num_train_timesteps,
    transformer_2/ the rest. None: one student for every step."""


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
    boundary_ratio: float | None = None
    """Per-expert students (`weights` holds transformer/ and transformer_2/); None: one."""

    lora: LoraRecord | None = None
    """A LoRA student: `weights` holds the adapter, its base is the teacher's transformer."""

    @property
    def expert_folders(self) -> dict[str, Path]:
        """WanPipeline component name -> its WanTransformer3DModel (or LoRA) folder."""
        if self.boundary_ratio is None:
            return {experts.HIGH: self.weights}
        return {name: self.weights / name for name in experts.EXPERTS}

    @property
    def num_inference_steps(self) -> int:
        return self.schedule.num_inference_steps

    def load(self, base: Path | None = None) -> nn.Module:
        """The student as a WanTransformer3DModel, or an `experts.ExpertPair` of two for a
        per-expert student (fp32, eval mode, no grad). A LoRA student is its base (`base`, a
        teacher folder, else the run's) with the adapter loaded, unmerged: the computation
        `WanPipeline.load_lora_weights` sets up."""
        models = {
            name: self._load(folder, base, name) for name, folder in self.expert_folders.items()
        }
        if self.boundary_ratio is None:
            return models[experts.HIGH]
        steps = int((self.schedule.scheduler or {}).get("num_train_timesteps", 1000))
        pair = experts.ExpertPair(
            models[experts.HIGH], models[experts.LOW], self.boundary_ratio, steps
        )
        return pair.eval().requires_grad_(False)

    def _load(self, folder: Path, base: Path | None, name: str) -> nn.Module:
        from diffusers import WanTransformer3DModel

        from wandistill.io.modelfolder import load_pretrained

        path = folder
        if self.lora is not None:  # one student: its recorded component; a pair: each its own
            path = self.lora.base_folder(base, name if self.boundary_ratio is not None else None)
        try:
            model = load_pretrained(WanTransformer3DModel, path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UsageError(
                f"{self.label}: {str(path)!r} does not load as a WanTransformer3DModel ({first})",
                fix="pass a folder written by `wandistill train` or `wandistill export`"
                if self.lora is None
                else "the LoRA's base (the teacher's transformer) must be where the run found it",
            ) from None
        if self.lora is not None:
            from wandistill.student import lora

            lora.add_lora(model, lora.config_from_record(self.lora.model_dump()))
            lora.load_lora_file(model, folder / lora.LORA_FILE)
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
    sampling, _ = load_json_file(run / SAMPLING, SamplingFile, what="run file", fix=_RESUME_FIX)
    ratio = _check_student(
        weights,
        f"{label}: {name}/",
        "re-run `wandistill train ... --resume`",
        lora=sampling.lora is not None,
    )
    return FinishedStudent(
        kind="run",
        path=run,
        weights=weights,
        schedule=sampling.student_schedule.schedule(),
        sizes=sampling.sampler or _cache_sizes(sampling.cache),
        sampling=sampling,
        label=label,
        flag=flag,
        boundary_ratio=ratio,
        lora=sampling.lora,
    )


def read_student(weights: str | Path, *, flag: str = "--student") -> FinishedStudent:
    """A run's student/ or student_ema/ folder: its schedule comes from the run's sampling.json."""
    weights = Path(weights)
    label = f"{flag} {str(weights)!r}"
    ratio = _check_student(
        weights,
        label,
        "pass <run>/student_ema or <run>/student of a finished `wandistill train`",
        lora=_is_lora_folder(weights),
    )
    if not (weights.parent / SAMPLING).is_file():
        raise UsageError(
            f"{label}: the run around it has no {SAMPLING}, so the student's K-step schedule is "
            "unknown (train writes it when it finishes)",
            fix="finish the run with `wandistill train --resume`, or pass --export DIR",
        )
    run = read_run(weights.parent, flag=flag)  # its schedule, sizes, sampling.json and LoRA
    return replace(run, path=weights, weights=weights, label=label, boundary_ratio=ratio)


def read_export(folder: str | Path, *, flag: str = "--export") -> FinishedStudent:
    """An export folder: every WanPipeline piece present, the marker typed."""
    folder = Path(folder)
    label = f"{flag} {str(folder)!r}"
    fix = "pass a folder written by `wandistill export` (re-run it to complete this one)"
    if not folder.is_dir():
        raise UsageError(f"{label} does not exist", fix=fix)
    if not (folder / EXPORT_MARKER).is_file():
        raise UsageError(f"{label} is not a wandistill export (no {EXPORT_MARKER})", fix=fix)
    if _is_lora_folder(folder):
        raise UsageError(
            f"{label} is a LoRA export (a LoRA file for the teacher, not a pipeline)",
            fix="pass the run it came from (--run RUN with --teacher), or export it with "
            "--merge-lora",
        )
    missing = [p for p in PIPELINE_PIECES if not (folder / p).exists()]
    if missing:
        raise UsageError(f"{label} is incomplete: {', '.join(missing)} missing", fix=fix)
    marker, _ = load_json_file(
        folder / EXPORT_MARKER, ExportMarker, what="export file", fix=_EXPORT_FIX
    )
    names = experts.EXPERTS if marker.boundary_ratio is not None else (experts.HIGH,)
    for name in names:
        _check_weights(folder / name, f"{label}: {name}/", fix)
    return FinishedStudent(
        kind="export",
        path=folder,
        weights=folder if marker.boundary_ratio is not None else folder / "transformer",
        schedule=marker.student_schedule.schedule(),
        sizes=marker.sampler,
        label=label,
        flag=flag,
        boundary_ratio=marker.boundary_ratio,
    )


def _check_student(folder: Path, label: str, fix: str, *, lora: bool = False) -> float | None:
    """A run's weights folder: one student (None), or a per-expert pair (its boundary_ratio)."""
    if not (folder / experts.MARKER).is_file():
        _check_weights(folder, label, fix, lora=lora)
        return None
    for name in experts.EXPERTS:
        _check_weights(folder / name, f"{label}{name}/", fix, lora=lora)
    return experts.read_marker(folder, fix).boundary_ratio


def _is_lora_folder(folder: Path) -> bool:
    """A LoRA student's weights or export: the LoRA file and no model config, in `folder` or,
    per expert, in its `transformer/`."""
    from wandistill.student.lora import LORA_FILE

    return any(
        (f / LORA_FILE).is_file() and not (f / "config.json").exists()
        for f in (folder, folder / experts.HIGH)
    )


def _check_weights(folder: Path, label: str, fix: str, *, lora: bool = False) -> None:
    """The one check of a student weights folder: present, no custom code, no pickle-only
    weights (named with the conversion), config.json + safetensors, config.json typed and of a
    sane size (before diffusers reads it); a LoRA student's: its LoRA file."""
    from wandistill.io.modelfolder import (
        Reader,
        read_weights,
        refuse_custom_code,
        require_safetensors,
    )
    from wandistill.student.config import check_saved_config

    if not folder.is_dir():
        raise UsageError(f"{label} does not exist", fix=fix)
    refuse_custom_code(folder, "student")
    if lora:
        from wandistill.io.modelfolder import read_safetensors
        from wandistill.student.lora import LORA_FILE

        if not (folder / LORA_FILE).is_file():
            raise UsageError(f"{label} holds no {LORA_FILE} (a LoRA run's adapter)", fix=fix)
        read_safetensors(folder / LORA_FILE, what="student LoRA file")  # a valid header
        return
    require_safetensors(folder, "student")
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
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


def sizes_from_settings(settings: SettingsBlock) -> SamplerSizes | None:
    """The sampler sizes of a cache manifest's settings (None if it lacks them)."""
    s = settings
    if None in (s.height, s.width, s.num_frames, s.max_sequence_length, s.guidance_scale):
        return None
    return SamplerSizes(
        height=s.height,  # type: ignore[arg-type]
        width=s.width,  # type: ignore[arg-type]
        num_frames=s.num_frames,  # type: ignore[arg-type]
        max_sequence_length=s.max_sequence_length,  # type: ignore[arg-type]
        teacher_guidance_scale=s.guidance_scale,  # type: ignore[arg-type]
    )


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
