"""Initialise a student from chosen teacher blocks, reading only those tensors, lazily.

Teacher block `blocks[i]` is copied into student block i; the non-block tensors (patch and
condition embedders, output norm and projection, modulation table) are copied too. Tensors are
opened one at a time with `safetensors.safe_open` (memory-mapped, per-tensor reads), copied into
the student's parameter and dropped, so peak memory is the student plus one teacher tensor, never
the teacher. Shapes are checked from the file headers before anything is copied. This is the only
path by which the student room reads teacher weights; no teacher module is imported.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from wandistill.config import TeacherInitConfig
from wandistill.errors import UsageError
from wandistill.weights import require_safetensors

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = WEIGHTS + ".index.json"
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


def weight_map(path: str | Path, component: str = "transformer") -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single file or sharded with an index)."""
    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        files = [p]
    else:
        folder = p / component if (p / component).is_dir() else p
        require_safetensors(folder, "student.init_from_teacher.path")
        if (folder / INDEX).is_file():
            index = json.loads((folder / INDEX).read_text(encoding="utf-8"))
            return {k: folder / v for k, v in index["weight_map"].items()}
        files = [folder / WEIGHTS] if (folder / WEIGHTS).is_file() else []
    if not files:
        raise UsageError(
            f"student.init_from_teacher.path {str(path)!r} holds no {WEIGHTS} (or its index) "
            f"under {component}/",
            fix="point it at a diffusers Wan teacher folder, its transformer folder, or a "
            ".safetensors file",
        )
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(f, framework="pt") as sf:
            out.update(dict.fromkeys(sf.keys(), f))
    return out


def plan_copy(student: nn.Module, blocks: list[int]) -> dict[str, str]:
    """Student tensor name -> teacher tensor name, for every tensor the init touches."""
    plan: dict[str, str] = {}
    for name in student.state_dict():
        m = _BLOCK.match(name)
        if m is None:
            plan[name] = name
        elif int(m.group(1)) < len(blocks):
            plan[name] = f"blocks.{blocks[int(m.group(1))]}.{m.group(2)}"
    return plan


def init_from_teacher(student: nn.Module, cfg: TeacherInitConfig) -> int:
    """Copy teacher tensors into `student` in place; returns how many were copied."""
    where = weight_map(cfg.path, cfg.component)
    plan = plan_copy(student, cfg.blocks)
    params = student.state_dict()
    problems: list[str] = []
    for mine, theirs in plan.items():
        if theirs not in where:
            problems.append(f"{theirs} is not in the teacher (for student {mine})")
            continue
        with safe_open(where[theirs], framework="pt") as sf:
            shape = list(sf.get_slice(theirs).get_shape())
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
            with safe_open(where[theirs], framework="pt") as sf:
                params[mine].copy_(sf.get_tensor(theirs))
    return len(plan)
