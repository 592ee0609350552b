"""Initialise a student from chosen teacher blocks, reading only those tensors, lazily.

Teacher block `blocks[i]` is copied into student block i; the non-block tensors (patch and
condition embedders, output norm and projection, modulation table) are copied too. Tensors are
opened one at a time with `safetensors.safe_open` (memory-mapped, per-tensor reads), copied into
the student's parameter and dropped, so peak memory is the student plus one teacher tensor, never
the teacher. Headers (and a sharded checkpoint's index) are validated and shapes checked from
them before anything is copied (`wandistill.io.modelfolder`, the checks the teacher folder uses).
This is the only path by which the student room reads teacher weights; no teacher module is
imported.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from wandistill.config import StudentConfig, TeacherInitConfig
from wandistill.errors import UsageError
from wandistill.io.modelfolder import Reader, TensorInfo, read_safetensors, read_weights

WEIGHTS = "diffusion_pytorch_model.safetensors"
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


def _teacher_tensors(
    path: str | Path, component: str
) -> tuple[dict[str, tuple[Path, TensorInfo]], dict[str, Any]]:
    """(tensor name -> (file, header entry), the teacher's config.json or {}): every header and
    index validated before use; a bare .safetensors file has no config."""
    what = "student.init_from_teacher.path file"
    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        f = read_safetensors(p, what=what)
        return {k: (p, info) for k, info in f.tensors.items()}, {}
    folder = p / component if (p / component).is_dir() else p
    reader = Reader(what)
    weights = read_weights(
        folder,
        WEIGHTS.removesuffix(".safetensors"),
        library="diffusers",
        class_name="WanTransformer3DModel",
        required=False,
        reader=reader,
    )
    if weights is None:
        raise UsageError(
            f"student.init_from_teacher.path {str(path)!r} holds no {WEIGHTS} (or its index) "
            f"under {component}/",
            fix="point it at a diffusers Wan teacher folder, its transformer folder, or a "
            ".safetensors file",
        )
    config = reader.json(folder / "config.json") if (folder / "config.json").is_file() else {}
    tensors = {k: (f.path, info) for f in weights.files for k, info in f.tensors.items()}
    return tensors, config if isinstance(config, dict) else {}


def init_from_teacher(student: nn.Module, cfg: TeacherInitConfig) -> int:
    """Copy teacher tensors into `student` in place; returns how many were copied. Refused
    before anything is copied: block init the teacher's config rules out (`block_problems`,
    the rule train's validate checks against the cache's record of that config), then any
    tensor the teacher lacks or holds at another shape (a bare .safetensors file has no
    config: its tensors are all there is to check)."""
    where, teacher_config = _teacher_tensors(cfg.path, cfg.component)
    student_config = dict(getattr(student, "config", None) or {})
    problems = block_problems(cfg.blocks, student_config, teacher_config)
    if problems:
        raise UsageError(f"cannot initialise the student from {cfg.path!r}: {'; '.join(problems)}")
    params = student.state_dict()
    plan: dict[str, str] = {}  # student tensor -> teacher tensor, every one the init touches
    for name in params:
        m = _BLOCK.match(name)
        if m is None:
            plan[name] = name
        elif int(m.group(1)) < len(cfg.blocks):
            plan[name] = f"blocks.{cfg.blocks[int(m.group(1))]}.{m.group(2)}"
    for mine, theirs in plan.items():
        if theirs not in where:
            problems.append(f"{theirs} is not in the teacher (for student {mine})")
            continue
        shape = where[theirs][1].shape
        if shape != list(params[mine].shape):
            problems.append(f"{theirs} {shape} vs student {mine} {list(params[mine].shape)}")
    if problems:
        more = f"; ... {len(problems) - 6} more" if len(problems) > 6 else ""
        shown = "; ".join(problems[:6]) + more
        raise UsageError(
            f"cannot initialise the student from {cfg.path!r}: {shown}",
            fix="block init needs the teacher's width and ffn_dim (keep num_attention_heads, "
            "attention_head_dim, ffn_dim; shrink num_layers) and block indices below the "
            "teacher's num_layers",
        )
    with torch.no_grad():
        for mine, theirs in plan.items():
            with safe_open(where[theirs][0], framework="pt") as sf:
                params[mine].copy_(sf.get_tensor(theirs))
    return len(plan)


def base_init(student: StudentConfig, student_config: dict[str, Any]) -> TeacherInitConfig:
    """What `init_from_teacher` copies: as the recipe says; a LoRA student's base is every
    teacher block."""
    init = student.init_from_teacher
    if not student.lora.enabled:
        return init
    return dataclasses.replace(init, blocks=list(range(int(student_config["num_layers"]))))


WIDTH_KEYS = ("num_attention_heads", "attention_head_dim", "ffn_dim")
"""What a copied teacher block fixes in the student: block init changes only num_layers."""


def init_problems(
    init: TeacherInitConfig, student_config: dict[str, Any], teacher_config: dict[str, Any]
) -> list[str]:
    """Block init the teacher cannot give, found from the recipe and the cache's record of the
    teacher's config, before anything is built or written (`block_problems`)."""
    return block_problems(init.blocks, student_config, teacher_config) if init.path else []


def block_problems(
    blocks: list[int], student_config: dict[str, Any], teacher_config: dict[str, Any]
) -> list[str]:
    """The rule of block init, stated once: a copied teacher block fixes the student's width,
    so only num_layers may differ, and every block index is below the teacher's depth. Checked
    early from the cache's record of the teacher's config (`init_problems`) and again from the
    teacher folder's own config when the blocks are copied (`init_from_teacher`)."""
    if not blocks or not teacher_config.get("num_layers"):
        return []
    n = int(teacher_config["num_layers"])
    problems = []
    beyond = [b for b in blocks if b >= n]
    if beyond:
        problems.append(
            f"student.init_from_teacher.blocks={blocks} names teacher block(s) {beyond}, but "
            f"the teacher has {n} (0..{n - 1}); list indices below {n}, e.g. blocks = "
            f"{list(range(min(len(blocks), n)))}"
        )
    differ = [
        k for k in WIDTH_KEYS if k in teacher_config and student_config.get(k) != teacher_config[k]
    ]
    if differ:
        mine = ", ".join(f"{k}={student_config.get(k)}" for k in differ)
        theirs = ", ".join(f"{k}={teacher_config[k]}" for k in differ)
        problems.append(
            f"student.init_from_teacher.blocks copies whole teacher blocks, but the student has "
            f"{mine} where the teacher has {theirs}; keep the teacher's width (change only "
            "num_layers) or drop init_from_teacher.blocks"
        )
    return problems
