"""One student per Wan 2.2 expert (`train.student.experts = "per-expert"`): routing and the split.

Wan 2.2 A14B denoises with two transformers: `transformer` (the high-noise expert) at every
timestep `t >= boundary_ratio * num_train_timesteps`, `transformer_2` (the low-noise expert) below
it. That is diffusers' own rule (`WanPipeline.__call__`: `if boundary_timestep is None or t >=
boundary_timestep: current_model = self.transformer`) and the recording sampler's
(`teacher.sampler.RecordingSampler.expert_for`), so it is the one rule used here, in `is_high`.

- **Training.** `ExpertPair` is one `nn.Module` holding both students; its `forward` has the
  signature of `WanTransformer3DModel.forward` and sends each sample to the expert its timestep
  belongs to (the recorded teacher timestep, i.e. the expert that produced the point). So one
  optimizer, one loop, DDP / FSDP, EMA and checkpoints see one module
  whose state dict is `transformer.*` + `transformer_2.*`. A micro-batch whose samples all fall
  on one side still runs the other expert once, on its first sample, with its output multiplied
  by 0: every parameter gets a (zero) gradient in every backward, which DDP's reducer and FSDP's
  reduce-scatter need on every rank, and the optimizer steps both experts alike whatever the
  world size (an expert without a gradient would skip AdamW's step on one rank count and not on
  another).
- **Sampling.** The K-step schedule is split at the same boundary, by the student's own
  timesteps (those `WanPipeline` compares): step i goes to `transformer` iff `timesteps[i] >=
  boundary`. `split_schedule` refuses a K that leaves one side without a step and names the
  smallest K that gives both sides one; each student step must also land on a recorded point
  of the expert that samples it (the cache says which expert produced each point: manifest
  `dims.recorded_experts`, or derived from the recorded timesteps for caches before it).
- **Export.** `transformer/`, `transformer_2/` and `boundary_ratio` in model_index.json: stock
  `WanPipeline.from_pretrained(export)` applies the rule above, and so does the project's
  sampler (`student.sampler.student_pipeline` passes the pair's parts to the same WanPipeline).
- **LoRA / FSDP.** `transformers(student)` lists the `WanTransformer3DModel`s of a student (one,
  or the two experts): `lora.add_lora(pair, cfg)` gives each its own adapter on its own base (the
  teacher's transformer / transformer_2, every block), the run's weights folders hold one LoRA
  file per expert, and export writes the two files stock `WanPipeline.load_lora_weights` applies
  to the teacher folder (the second with `load_into_transformer_2=True`). FSDP shards each one's
  blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import torch
from pydantic import ConfigDict, Field
from torch import nn

from wandistill.cache.files import DimsBlock, SettingsBlock
from wandistill.checks.validate import Schema, load_json_file
from wandistill.errors import UsageError
from wandistill.io.fsutil import atomic_write_json

if TYPE_CHECKING:
    from wandistill.config import LossConfig, StudentConfig, TeacherInitConfig
    from wandistill.student.schedule import ObjectivePlan, TeacherSchedule

HIGH, LOW = "transformer", "transformer_2"
EXPERTS = (HIGH, LOW)
"""The WanPipeline component names: high-noise expert first."""
ONE, PER_EXPERT = "one", "per-expert"
MARKER = "experts.json"
"""In a per-expert weights folder (<run>/student/): the boundary beside transformer/ and
transformer_2/."""


def is_high(timestep: torch.Tensor | float, boundary_timestep: float) -> Any:
    """WanPipeline's rule: the high-noise expert (`transformer`) takes t >= boundary."""
    return timestep >= boundary_timestep


# --------------------------------------------------------------------------- the module


class ExpertPair(nn.Module):
    """Two students, called like one `WanTransformer3DModel`: each sample goes to its expert."""

    def __init__(
        self,
        transformer: nn.Module,
        transformer_2: nn.Module,
        boundary_ratio: float,
        num_train_timesteps: int = 1000,
    ) -> None:
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary_ratio = float(boundary_ratio)
        self.num_train_timesteps = int(num_train_timesteps)

    @property
    def boundary_timestep(self) -> float:
        return self.boundary_ratio * float(self.num_train_timesteps)

    @property
    def config(self) -> Any:
        """Both experts share one config (checked at build); callers read sizes off it."""
        return self.transformer.config

    def enable_gradient_checkpointing(self) -> None:
        for expert in (self.transformer, self.transformer_2):
            expert.enable_gradient_checkpointing()  # type: ignore[operator]

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor]:
        batch = hidden_states.shape[0]
        t_B = timestep.reshape(batch, -1).amax(dim=1)  # expand_timesteps: the step's t
        high_B = is_high(t_B, self.boundary_timestep)
        out: torch.Tensor | None = None
        zero = hidden_states.new_zeros(())
        for expert, rows_B in ((self.transformer, high_B), (self.transformer_2, ~high_B)):
            rows = rows_B.nonzero().flatten()
            idle = rows.numel() == 0
            if idle and not torch.is_grad_enabled() and not is_sharded(expert):
                continue  # sampling / eval: nothing to route, no gradient to keep alive
            if idle:
                rows = torch.zeros(1, dtype=torch.long, device=hidden_states.device)
            (pred,) = expert(
                hidden_states=hidden_states[rows],
                timestep=timestep[rows],
                encoder_hidden_states=encoder_hidden_states[rows],
                return_dict=False,
                **kwargs,
            )
            if out is None:
                out = pred.new_zeros((batch, *pred.shape[1:]))
            if idle:  # its dummy row is not a prediction (sharded, no gradient: discarded)
                if torch.is_grad_enabled():
                    zero = zero + pred.sum() * 0.0  # see the module docstring
            else:
                out = out.index_copy(0, rows, pred.to(out.dtype))
        assert out is not None
        return (out + zero.to(out.dtype),)

    def save_pretrained(self, folder: str | Path, **kwargs: Any) -> None:
        """<folder>/transformer/, <folder>/transformer_2/ (diffusers folders) and experts.json."""
        folder = Path(folder)
        for name in EXPERTS:
            getattr(self, name).save_pretrained(folder / name, **kwargs)
        write_marker(folder, self.boundary_ratio, self.num_train_timesteps)


def is_sharded(module: nn.Module) -> bool:
    """FSDP2's `fully_shard` has wrapped `module` or a part of it (its blocks): its forward
    all-gathers, a collective, so every rank must run it even with no sample of its own (an idle
    expert), else the ranks deadlock. (Asked of
    the modules, not the parameters: inside the root's forward its own are unsharded tensors.)"""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def transformers(student: nn.Module) -> list[nn.Module]:
    """The WanTransformer3DModels of a student: itself, or its two experts (high first). What
    LoRA (one adapter each) and FSDP (each one's blocks) iterate over."""
    if isinstance(student, ExpertPair):
        return [student.transformer, student.transformer_2]
    return [student]


def pipeline_parts(student: nn.Module) -> dict[str, Any]:
    """WanPipeline's transformer / transformer_2 / boundary_ratio for this student."""
    if isinstance(student, ExpertPair):
        return {
            "transformer": student.transformer,
            "transformer_2": student.transformer_2,
            "boundary_ratio": student.boundary_ratio,
        }
    return {"transformer": student, "transformer_2": None, "boundary_ratio": None}


# --------------------------------------------------------------------------- folders


def write_marker(folder: Path, boundary_ratio: float, num_train_timesteps: int) -> None:
    """experts.json: what makes <folder> a per-expert student (read back as ExpertsMarker)."""
    data = {
        "format": "wandistill-experts",
        "experts": list(EXPERTS),
        "boundary_ratio": boundary_ratio,
        "num_train_timesteps": num_train_timesteps,
    }
    atomic_write_json(folder / MARKER, data)


# --------------------------------------------------------------------------- the cache side


def recorded_experts(
    timesteps: list[float] | tuple[float, ...],
    recorded: list[int] | tuple[int, ...],
    boundary: float | None,
) -> list[str] | None:
    """Which expert produced each recorded slot (None for one-expert teachers)."""
    if boundary is None:
        return None
    return [HIGH if is_high(timesteps[s], boundary) else LOW for s in recorded]


@dataclass(frozen=True, slots=True)
class ExpertSplit:
    """The K student steps each expert samples (indices into the K-step schedule); as
    `dataclasses.asdict`, sampling.json's `experts`."""

    boundary_ratio: float
    boundary_timestep: float
    transformer_steps: tuple[int, ...]
    transformer_2_steps: tuple[int, ...]


def split_steps(timesteps: tuple[float, ...], boundary: float) -> tuple[tuple[int, ...], ...]:
    """(high, low) indices of a schedule's timesteps, by WanPipeline's rule."""
    high = tuple(i for i, t in enumerate(timesteps) if is_high(t, boundary))
    low = tuple(i for i, t in enumerate(timesteps) if not is_high(t, boundary))
    return high, low


# --------------------------------------------------------------------------- validation


def check(
    student: StudentConfig,
    loss: LossConfig,
    settings: SettingsBlock,
    dims: DimsBlock,
    objectives: ObjectivePlan | None,
    cache: str,
) -> list[str]:
    """Every reason a per-expert run cannot train on this cache, each with its fix ([] for
    `experts = "one"`). Needs only the recipe and the manifest: nothing is built or written."""
    if student.experts != PER_EXPERT:
        return []
    if settings.boundary_ratio is None:
        return [
            f"train.student.experts = 'per-expert' needs a cache of a Wan 2.2 A14B teacher (two "
            f"experts and a boundary_ratio), but cache {cache!r} was made by a one-expert "
            "teacher; set train.student.experts = 'one', or precompute with a Wan 2.2 A14B "
            "teacher"
        ]
    problems = _init_problems(student.init_from_teacher)
    if loss.feature > 0:
        problems.append(
            "loss.feature is not supported with train.student.experts = 'per-expert' (each "
            "expert sees only its side's samples); set loss.feature = 0"
        )
    if objectives is not None:
        try:
            split_for(objectives, dims, student.num_inference_steps)
        except UsageError as e:
            problems.append(e.message + (f"; {e.fix}" if e.fix else ""))
    return problems


def _init_problems(init: TeacherInitConfig) -> list[str]:
    if not init.path:
        return []
    if init.component != HIGH:
        return [
            f"student.init_from_teacher.component = {init.component!r} with per-expert "
            "students: each expert starts from its own teacher expert (transformer, "
            "transformer_2); remove component"
        ]
    missing = [n for n in EXPERTS if not (Path(init.path) / n).is_dir()]
    if missing:
        return [
            f"student.init_from_teacher.path {init.path!r} has no {', '.join(missing)}/ "
            "folder, which per-expert students start from; point it at the Wan 2.2 A14B "
            "teacher folder (the one holding transformer/ and transformer_2/)"
        ]
    return []


def split_for(objectives: ObjectivePlan, dims: DimsBlock, k: int | None) -> ExpertSplit:
    """The K-step schedule split at the boundary, checked against what the cache recorded."""
    teacher, student = objectives.teacher, objectives.student
    b = teacher.boundary_timestep
    assert b is not None, "check() refuses caches without a boundary first"
    key = "train.student.num_inference_steps"
    said = dims.recorded_experts
    derived = recorded_experts(teacher.timesteps, teacher.recorded, b)
    if said is not None and list(said) != derived:
        raise UsageError(
            f"the cache's dims.recorded_experts {said} disagree with its recorded timesteps and "
            f"boundary t = {b:g} ({derived})",
            fix="re-run `wandistill precompute` into a new cache",
        )
    high, low = split_steps(student.timesteps, b)
    if not high or not low:
        k_now = student.num_inference_steps
        side, other = ("transformer", "transformer_2") if high else ("transformer_2", "transformer")
        smallest = smallest_k(teacher)
        how = (
            f"set {key} = {smallest} (the smallest K with a step on each side)"
            if smallest is not None
            else "precompute with more teacher steps (sampler.num_inference_steps)"
        )
        raise UsageError(
            f"{key}={k if k is not None else k_now}: every one of the {k_now} student steps "
            f"(t = {[round(t) for t in student.timesteps]}) falls to {side} (boundary t = "
            f"{b:g}), leaving {other} without a step",
            fix=how,
        )
    for i, step in enumerate(student.steps):
        mine = HIGH if i in high else LOW
        theirs = HIGH if is_high(teacher.timesteps[step], b) else LOW
        if mine != theirs:
            raise UsageError(
                f"{key}={student.num_inference_steps}: student step {i} (t = "
                f"{student.timesteps[i]:g}) is sampled by {mine}, but the teacher point it "
                f"trains on (t = {teacher.timesteps[step]:g}) was made by {theirs}",
                fix="choose another K",
            )
    sides = {derived[s] for s in objectives.slots}
    if sides != set(EXPERTS):
        lacking = sorted(set(EXPERTS) - sides)
        raise UsageError(
            f"the weighted objectives train at no recorded point of {', '.join(lacking)}, so "
            "that student would never learn",
            fix="record steps on both sides of the boundary (sampler.record_every / "
            "record_for_student_steps)",
        )
    ratio = b / float((teacher.scheduler or {}).get("num_train_timesteps", 1000))
    return ExpertSplit(ratio, b, high, low)


def smallest_k(teacher: TeacherSchedule) -> int | None:
    """The smallest K whose first-order schedule lands on the teacher's and has a step on each
    side of the boundary; None if no K <= N does."""
    from wandistill.student.schedule import student_schedule

    assert teacher.boundary_timestep is not None
    for k in range(2, teacher.num_inference_steps + 1):
        try:
            s = student_schedule(teacher, k, few_step=True, key="K")
        except UsageError:
            continue
        if all(split_steps(s.timesteps, teacher.boundary_timestep)):
            return k
    return None


def resume_problem(student: StudentConfig, saved_meta: dict[str, Any], checkpoint: Path) -> str:
    """A --resume whose checkpoint was trained with the other `experts` setting ('' if none)."""
    saved = saved_meta.get("experts", ONE)
    if saved == student.experts:
        return ""
    return (
        f"--resume: checkpoint {str(checkpoint)!r} holds a student trained with "
        f"train.student.experts = {saved!r}, this recipe sets {student.experts!r}; resume with "
        f"experts = {saved!r}, or choose a new --out"
    )


# --------------------------------------------------------------------------- build


def build(
    student: StudentConfig,
    config: dict[str, Any],
    settings: SettingsBlock,
    *,
    seed: int,
) -> nn.Module:
    """The student `train` optimises: one WanTransformer3DModel, or an ExpertPair whose experts
    start from the teacher's transformer / transformer_2 (same seed for their random init; a
    LoRA student's: every block of its expert, the base its adapter goes on)."""
    from wandistill.student.init import base_init, init_from_teacher
    from wandistill.student.model import build_student

    init = base_init(student, config)
    made = []
    for name in EXPERTS if student.experts == PER_EXPERT else (None,):
        made.append(build_student(config, seed=seed))
        if init.path:
            init_from_teacher(made[-1], replace(init, component=name) if name else init)
    if len(made) == 1:
        return made[0]
    steps = int((settings.scheduler_config or {}).get("num_train_timesteps", 1000))  # type: ignore[arg-type]
    assert settings.boundary_ratio is not None, "check() refuses caches without a boundary"
    return ExpertPair(made[0], made[1], settings.boundary_ratio, steps)


class ExpertsMarker(Schema):
    """`experts.json` of a per-expert weights folder (written by `ExpertPair.save_pretrained`)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    format: Literal["wandistill-experts"]
    boundary_ratio: Annotated[float, Field(gt=0.0, lt=1.0)]
    num_train_timesteps: Annotated[int, Field(ge=1, le=1_000_000)] = 1000


def read_marker(folder: Path, fix: str) -> ExpertsMarker:
    marker, _ = load_json_file(folder / MARKER, ExpertsMarker, what="experts file", fix=fix)
    return marker
