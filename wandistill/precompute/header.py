"""What a cache records of its teacher and sampler: the settings that key every record, the
steps recorded, the manifest header (fields, numerics, teacher fingerprint), the sampler spec
and the dims block. Precompute writes them; `plan` and `precompute --dry-run` show the steps."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

from wandistill.cache import manifest as mf
from wandistill.cache.contract import dtype_name, field_specs
from wandistill.config import PrecomputeConfig
from wandistill.placement.estimate import dtype_from_name
from wandistill.precompute.numerics import record_numerics
from wandistill.runtime import dist
from wandistill.teacher.folder import TeacherFolder
from wandistill.teacher.sampler import CFG_FORMULA, RecordingSampler, SamplerSpec

if TYPE_CHECKING:
    from wandistill.precompute.run import Work


def sampler_settings(teacher: TeacherFolder, cfg: PrecomputeConfig) -> dict[str, Any]:
    """Everything that changes the teacher's output for a prompt and seed (the cache key)."""
    s = cfg.sampler
    g2 = s.guidance_scale_2 if s.guidance_scale_2 is not None else s.guidance_scale
    return {
        "scheduler": type(teacher.scheduler).__name__,
        "scheduler_config": json.loads(json.dumps(dict(teacher.scheduler.config), default=str)),
        "num_inference_steps": s.num_inference_steps,
        "flow_shift": teacher.scheduler.config.get("flow_shift"),
        "guidance_scale": s.guidance_scale,
        "guidance_scale_2": g2 if teacher.boundary_ratio is not None else None,
        "boundary_ratio": teacher.boundary_ratio,
        "cfg_formula": CFG_FORMULA if s.guidance_scale > 1.0 else "cond (guidance_scale <= 1)",
        "negative_prompt": s.negative_prompt,
        "height": s.height,
        "width": s.width,
        "num_frames": s.num_frames,
        "dtype": cfg.teacher.dtype,
        "max_sequence_length": s.max_sequence_length,
        "record_steps": recorded_steps(teacher, cfg),
        "features": list(s.features),
        "holdout_fraction": cfg.cache.holdout_fraction,
        "expand_timesteps": teacher.expand_timesteps,
    }


def recorded_steps(teacher: TeacherFolder, cfg: PrecomputeConfig) -> list[int]:
    """The steps to record; `sampler.record_for_student_steps` is placed by the teacher's own
    scheduler (wandistill.student.schedule), so it names what the student will sample at."""
    from wandistill.student.schedule import student_steps_for

    s = cfg.sampler
    if not s.record_for_student_steps:
        return s.recorded_steps()
    return s.recorded_steps(student_steps_for(teacher.scheduler, s.num_inference_steps))


def _header(
    cfg: PrecomputeConfig, teacher: TeacherFolder, info: dist.DistInfo, settings: dict[str, Any]
) -> mf.Manifest:
    """The manifest this run writes under (or must be compatible with)."""
    dtype = dtype_from_name(cfg.teacher.dtype)
    return mf.new_manifest(
        backend=cfg.cache.backend,
        teacher={**teacher.fingerprint, "transformer_config": teacher.transformer_config},
        settings=settings,
        numerics=record_numerics(batch_size=cfg.sampler.batch_size, device=info.device),
        fields=cfg.cache.encoding().apply(
            field_specs(
                latent_dtype=torch.float32,
                model_dtype=dtype,
                embed_dtype=dtype,
                features=list(cfg.sampler.features),
            )
        ),
    )


def _spec(w: Work) -> SamplerSpec:
    s, ratio = w.cfg.sampler, w.teacher.boundary_ratio
    train_steps = w.teacher.scheduler.config.num_train_timesteps
    return SamplerSpec(
        num_inference_steps=s.num_inference_steps,
        guidance_scale=s.guidance_scale,
        guidance_scale_2=s.guidance_scale_2 if s.guidance_scale_2 is not None else s.guidance_scale,
        boundary_timestep=None if ratio is None else ratio * train_steps,
        expand_timesteps=w.teacher.expand_timesteps,
        record_steps=tuple(w.settings["record_steps"]),
        features=tuple(s.features),
        latent_shape=w.shape,
        max_sequence_length=s.max_sequence_length,
    )


def _dims(
    teacher: TeacherFolder, shape: tuple[int, ...], settings: dict[str, Any]
) -> dict[str, Any]:
    return {
        "text_dim": int(teacher.transformer_config["text_dim"]),
        "latent_channels": int(shape[0]),
        "latent_shape": list(shape),
        "num_recorded_steps": len(settings["record_steps"]),
        "teacher_dtype": dtype_name(dtype_from_name(settings["dtype"])),
    }


def _recorded_experts(sampler: RecordingSampler, timesteps: torch.Tensor) -> dict[str, Any]:
    """Wan 2.2: which expert produces each recorded slot (`dims.recorded_experts`, read by
    per-expert training), by the very rule the sampler switches experts with."""
    if sampler.spec.boundary_timestep is None:
        return {}
    steps = sampler.spec.record_steps
    return {"recorded_experts": [sampler.expert_for(timesteps[s]) for s in steps]}
