"""What a run writes about itself: its settings (run.json: recipe, student config, teacher and
cache identity) and sampling.json (the K-step sampler the student was distilled for, and its
experts), which eval, sample and export read back."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wandistill.config import TrainConfig
from wandistill.io import folderkind
from wandistill.io.fsutil import atomic_write_json
from wandistill.runtime import dist
from wandistill.student import experts, lora
from wandistill.student.export import LINKED
from wandistill.student.folders import sizes_from_settings

if TYPE_CHECKING:
    from wandistill.train.inputs import Plan
    from wandistill.train.loop import Trainer


def run_meta(cfg: TrainConfig, plan: Plan, info: dist.DistInfo) -> dict[str, Any]:
    """What identifies the run: stored in every checkpoint and run.json, and compared on
    --resume (a resume that changes any of it is refused or handled explicitly)."""
    return {
        "student_config": plan.student_config,
        "teacher_fingerprint": plan.manifest.teacher.fingerprint,
        "world_size": info.world_size,
        "batch_size": cfg.batch_size,
        "grad_accum": cfg.grad_accum,
        "student_schedule": plan.objectives.student.to_json(),
        "experts": cfg.student.experts,
        "lora": lora.run_record(cfg.student),
        "parallel": cfg.parallel,
    }


def write_run_settings(out: Path, settings: dict[str, Any]) -> None:
    """run.json; a legacy run's config.json (same content, older name) goes once it is written,
    so `from_pretrained(out)` never mistakes the run folder for a model folder."""
    atomic_write_json(out / folderkind.RUN_SETTINGS, settings)
    legacy = out / folderkind.LEGACY_RUN_SETTINGS
    if folderkind.is_run_settings(legacy):
        legacy.unlink()


def sampling_record(t: Trainer, steps: int) -> dict[str, Any]:
    """What `wandistill export` needs besides the weights: K, the student's scheduler, the
    teacher it was distilled from. Written as <out>/sampling.json next to student/."""
    m = t.plan.manifest
    return {
        "format": "wandistill-student",
        "num_inference_steps": t.plan.objectives.student.num_inference_steps,
        "guidance_scale": 1.0,
        "student_schedule": t.plan.objectives.student.to_json(),
        "objectives": {k: list(v) for k, v in t.plan.objectives.steps.items()},
        "train_steps": steps,
        "teacher": {
            "fingerprint": m.teacher.fingerprint,
            "path": m.teacher.path,
            "num_inference_steps": m.settings.num_inference_steps,
            "boundary_ratio": m.settings.boundary_ratio,
            "expand_timesteps": m.settings.expand_timesteps,
            "components": {n: m.teacher.components.get(n) for n in LINKED},
        },
        "cache": t.plan.primary.storage.url,
        "sampler": sizes.model_dump() if (sizes := sizes_from_settings(m.settings)) else None,
        "experts": experts_record(t),
        "lora": lora.sampling_entry(t.cfg.student, m.teacher.components),
    }


def experts_record(t: Trainer) -> dict[str, Any] | None:
    """sampling.json's per-expert record: the split of the K steps (None: one student)."""
    if t.cfg.student.experts != experts.PER_EXPERT:
        return None
    o = t.plan.objectives
    return asdict(experts.split_for(o, t.plan.manifest.dims, t.cfg.student.num_inference_steps))
