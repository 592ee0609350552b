"""What a run trains on, checked before anything is built: the cache waited for (--follow) and
read, the student config resolved and checked against it, the objectives placed on the recorded
steps. `validate` returns the `Plan` that `loop.setup` builds from; every refusal is one line.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from wandistill.cache.contract import SHARED_NAME
from wandistill.cache.manifest import Manifest, has_manifest, manifest_name, read_manifest
from wandistill.cache.multi import check_caches
from wandistill.cache.reader import CacheReader
from wandistill.cache.training import DEFAULT_FIELDS
from wandistill.config import TrainConfig
from wandistill.errors import CacheError, UsageError
from wandistill.io.storage import Storage, storage_at
from wandistill.student import experts, lora
from wandistill.student.config import (
    check_against_cache,
    resolve_student_config,
    width,
)
from wandistill.student.init import init_problems
from wandistill.student.schedule import ObjectivePlan, TeacherSchedule, plan_objectives
from wandistill.train import checkpoint as ckpt_io
from wandistill.train import checkpoint_read as ckpt_read

if TYPE_CHECKING:
    import torch

    from wandistill.cache.files import SettingsBlock

console = Console(stderr=True, highlight=False, soft_wrap=True)
"""train's progress lines (loop and resume print with it too)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What validation resolved from the recipe and the cache manifest."""

    caches: tuple[CacheReader, ...]
    """Each --cache opened once for the whole process, the primary first (`validate`): its
    `Storage` and committed manifest, which the objective plan, the training reader and the
    run's records all take (`url` where text is needed). `close` ends them."""
    out: Path
    manifest: Manifest
    student_config: dict[str, Any]
    teacher_width: int
    fields: list[str]
    objectives: ObjectivePlan
    """K, the student's sampler, and the recorded steps each objective trains at."""
    shared: dict[str, torch.Tensor]
    """The primary cache's shared tensors (the teacher's sigmas and timesteps), read once: the
    objective plan and the loop's sigma table both take them."""

    @property
    def primary(self) -> CacheReader:
        """The first cache: the manifest every other one agrees with (cache/multi.py)."""
        return self.caches[0]

    def close(self) -> None:
        for c in self.caches:
            c.close()


def run_inputs(cfg: TrainConfig) -> dict[str, str]:
    """What train reads: its --out may be none of these, nor inside or around one."""
    return {
        **{"--cache" + (f" #{i + 1}" if i else ""): c for i, c in enumerate(cfg.caches)},
        "student.init_from_teacher.path": cfg.student.init_from_teacher.path,
        "student.config_file": cfg.student.config_file,
    }


def wait_for_manifest(cfg: TrainConfig) -> list[Storage]:
    """--follow may start before precompute has created the cache: wait for its manifest (each
    cache's, with several). Returns the storages it polled, for `validate` to read on."""
    opened = [storage_at(cache) for cache in cfg.caches]
    for st in opened:
        path = manifest_name(st)
        start = time.monotonic()
        told = os.environ.get("RANK", "0") != "0"  # rank 0 says it once
        # The manifest and the shared schedule it lists (the writer creates the manifest
        # first, then shared.safetensors: the steps plan needs both)
        while not has_manifest(st) or (read_manifest(st).shared and not st.exists(SHARED_NAME)):
            if not told:
                console.print(f"train: waiting for {path} (has precompute started?)")
                told = True
            if cfg.follow_timeout and time.monotonic() - start > cfg.follow_timeout:
                raise CacheError(
                    f"--follow: {str(path)!r} did not appear within {cfg.follow_timeout:.0f} s",
                    fix="start `wandistill precompute` with --out pointing at this cache",
                )
            time.sleep(cfg.follow_poll_interval)
    return opened


def validate(cfg: TrainConfig, *, resume: bool, follow: bool = False) -> Plan:
    """Every check that needs only the recipe and the manifest, all problems in one error.
    Each --cache is opened here, once (with `follow`, the storages `wait_for_manifest` polled),
    its committed manifest loaded once and several checked to agree (cache/multi.py); the
    `Plan` holds them and the caller closes it (`Plan.close`), or they close on a refusal."""
    opened = wait_for_manifest(cfg) if follow else None
    if not cfg.caches:
        raise UsageError("train needs a cache", fix="pass --cache DIR (or set train.cache)")
    if not cfg.out:
        raise UsageError("train needs an output directory", fix="pass --out DIR (or train.out)")
    readers: list[CacheReader] = []
    try:
        for st in opened if opened is not None else [storage_at(c) for c in cfg.caches]:
            readers.append(CacheReader(st))
        if len(readers) > 1:
            check_caches(readers)
        return _resolve(cfg, tuple(readers), resume=resume)
    except BaseException:
        for r in readers:
            r.close()
        raise


def _resolve(cfg: TrainConfig, caches: tuple[CacheReader, ...], *, resume: bool) -> Plan:
    """`validate` over the opened caches."""
    manifest = caches[0].manifest  # several caches agree with it (cache/multi.py)
    primary = caches[0].path
    tconf = manifest.teacher.transformer_config or {}
    student_config = resolve_student_config(cfg.student, tconf, manifest.dims)
    problems = check_against_cache(student_config, manifest.dims, primary)
    problems += init_problems(cfg.student.init_from_teacher, student_config, tconf)
    if cfg.student.lora.enabled:
        problems += lora.plan_problems(cfg.student, student_config, tconf)
    cached = {f.name for f in manifest.fields}
    objectives = None
    shared = caches[0].read_shared()
    try:
        objectives = objective_plan(cfg, manifest.settings, shared)
    except UsageError as e:
        problems.append(e.message + (f" ({e.fix})" if e.fix else ""))
    problems += experts.check(
        cfg.student, cfg.loss, manifest.settings, manifest.dims, objectives, primary
    )
    fields = list(DEFAULT_FIELDS)
    if cfg.loss.x0_terms:
        fields.append("final_latent")
    if cfg.loss.unroll > 0:
        fields.append("noise")
    if cfg.loss.unroll > 0 and objectives is not None:
        problems += unroll_problems(cfg, manifest, student_config, objectives)
    if cfg.loss.feature > 0:
        recorded = sorted(n.removeprefix("feature.") for n in cached if n.startswith("feature."))
        for name in cfg.loss.feature_map:
            if f"feature.{name}" not in cached:
                problems.append(
                    f"loss.feature_map names teacher feature {name!r}, but the cache recorded "
                    f"{recorded or 'no features'}; add it to precompute.sampler.features or "
                    "drop it from feature_map"
                )
            fields.append(f"feature.{name}")
    out = Path(cfg.out)
    latest = ckpt_io.resolve_latest(out / "checkpoints")
    if resume and latest is not None:
        _, saved, _ = ckpt_read.check_state(latest)  # a bad one fails here, before any build
        meta = saved.get("meta", {})
        problems.append(experts.resume_problem(cfg.student, meta, latest))
        parallel_was = meta.get("parallel", "ddp")
        if parallel_was != cfg.parallel:
            problems.append(
                f"--resume: {str(latest)!r} was written with train.parallel={parallel_was!r}, this "
                f"run has {cfg.parallel!r}; resume with --parallel {parallel_was}, or choose a new "
                "--out"
            )
        changed = lora.resume_problem(meta.get("lora"), lora.run_record(cfg.student))
        if changed:
            raise UsageError(
                f"--resume: checkpoint {str(latest)!r} cannot continue under this recipe: "
                f"{changed}",
                fix="resume with the [train.student.lora] it was trained with, or choose a new "
                "--out",
            )
    if not resume and latest is not None:
        problems.append(
            f"--out {cfg.out!r} holds checkpoints of an earlier run; pass --resume to continue "
            "it, or choose a new --out"
        )
    problems = [p for p in problems if p]
    if problems or objectives is None:
        raise UsageError("; ".join(problems))
    teacher_width = width(tconf) if tconf else width(student_config)
    return Plan(caches, out, manifest, student_config, teacher_width, fields, objectives, shared)


def unroll_problems(
    cfg: TrainConfig, manifest: Manifest, student_config: dict[str, Any], plan: ObjectivePlan
) -> list[str]:
    """loss.unroll: one process only (K forwards per backward are not put through DDP/FSDP
    yet), and K steps' activations must fit the device (`unroll.unroll_memory_problem`)."""
    from wandistill.placement.train_size import StudentSize, TrainShape
    from wandistill.student.unroll import device_memory, unroll_memory_problem

    problems = []
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        problems.append(
            "loss.unroll runs K student forwards per backward, which this trainer does not put "
            "through DDP/FSDP yet; train it on one process (no torchrun), or set loss.unroll = 0"
        )
    dims = manifest.dims.latent_shape or []
    if len(dims) == 4:
        _, f, h, w = (int(v) for v in dims)
        text = manifest.settings.max_sequence_length or 512
        shape = TrainShape(f, h, w, text, cfg.batch_size)
        problem = unroll_memory_problem(
            plan.student.num_inference_steps,
            StudentSize.from_config(student_config),
            shape,
            device_memory(cfg.device),
            checkpointed=cfg.loss.unroll_checkpoint,
            blocks=cfg.gradient_checkpointing,
            bf16=cfg.mixed_precision == "bf16",
        )
        problems += [problem] if problem else []
    return problems


def objective_plan(
    cfg: TrainConfig, settings: SettingsBlock, shared: dict[str, torch.Tensor]
) -> ObjectivePlan:
    """K, the student's scheduler and the recorded steps of each objective, from the primary
    cache's settings and shared schedule (`validate`'s, or `train --dry-run`'s, which prints
    it)."""
    teacher = TeacherSchedule.from_cache(settings, shared)
    return plan_objectives(cfg.loss, cfg.student.num_inference_steps, teacher)
