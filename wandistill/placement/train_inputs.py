"""What a train plan is computed from, read once at the edge: the student config, the batch
shape, and the machine (the one this process sees, one described with flags, or the one a
recipe's name describes).

The student config is resolved the way `train` resolves it (`student.config`): the teacher's
transformer config (from the cache manifest, a teacher folder or a published config name), then
`student.config_file`, then the recipe's sizes. The batch shape comes from the cache manifest
(`dims.latent_shape`, the recorded `max_sequence_length`) when the cache exists, else from the
recipe's `precompute.sampler` (the cache it would write).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wandistill.placement.devices import GiB
from wandistill.placement.inventory import GPU, Inventory
from wandistill.placement.train_size import TrainShape

if TYPE_CHECKING:
    from wandistill.cache.manifest import Manifest
    from wandistill.config import Recipe, TrainConfig

__all__ = ["TrainInputs", "machine_for", "recipe_machine", "train_inputs"]

_MACHINE = re.compile(r".+_(\d+)x(\d+)gb")


def _stem(name: str) -> str:
    """A recipe's name from a shipped name or a path ("wan2.1-14b_1x24gb" has dots: no stem)."""
    return Path(name).name.removesuffix(".toml")


def recipe_machine(name: str, like: Inventory) -> Inventory | None:
    """The machine a recipe's name describes (`<model>_<N>x<GB>gb`: N GPUs of GB GiB), with the
    RAM and disk of `like` (this machine); None when the name describes none."""
    stem = _stem(name)
    m = _MACHINE.fullmatch(stem)
    if not m:
        return None
    gpus, gb = int(m.group(1)), int(m.group(2))
    gpu = GPU(f"{gb} GiB GPU", gb * GiB, gb * GiB - GiB // 2)
    source = (
        f"described by recipe {stem}: {gpus}x{gb} GiB GPU, this machine's "
        f"{like.cpu_bytes / GiB:.0f} GiB RAM"
    )
    return Inventory((gpu,) * gpus, like.cpu_bytes, like.disk_bytes, source)


@dataclass(frozen=True, slots=True)
class TrainInputs:
    student_config: dict[str, Any]
    shape: TrainShape
    label: str
    """Where the student's base config came from."""


def _manifest(cache: str) -> Manifest | None:
    """The cache's committed manifest, or None where there is no cache there yet."""
    if not cache:
        return None
    from wandistill.cache.manifest import load_committed
    from wandistill.errors import WandistillError

    try:
        return load_committed(cache)
    except (WandistillError, OSError):
        return None


def _shape(cfg: TrainConfig, recipe: Recipe, manifest: Manifest | None) -> TrainShape:
    shape_dims = (manifest.dims.latent_shape if manifest else None) or []
    if manifest is not None and len(shape_dims) == 4:
        _, f, h, w = (int(v) for v in shape_dims)
        text = manifest.settings.max_sequence_length or 512
        return TrainShape(f, h, w, text, cfg.batch_size, "cache manifest")
    s = recipe.precompute.sampler
    return TrainShape.from_video(
        num_frames=s.num_frames,
        height=s.height,
        width=s.width,
        text_tokens=s.max_sequence_length,
        batch_size=cfg.batch_size,
        source="recipe (precompute.sampler)",
    )


def train_inputs(
    recipe: Recipe, teacher_config: Mapping[str, Any] | None, label: str
) -> TrainInputs:
    """The student config and batch shape of `recipe.train`. `teacher_config`: the teacher's
    transformer config when the caller has one (a folder or `--config`); else the cache's."""
    from wandistill.cache.files import DimsBlock
    from wandistill.student.config import resolve_student_config

    cfg = recipe.train
    manifest = _manifest(cfg.caches[0] if cfg.caches else "")
    tconf = dict(teacher_config or {})
    if not tconf and manifest is not None:
        tconf = dict(manifest.teacher.transformer_config or {})
        label = f"cache {cfg.caches[0] if cfg.caches else ''}"
    dims = manifest.dims if manifest is not None else DimsBlock()
    student = resolve_student_config(cfg.student, tconf, dims)
    return TrainInputs(student, _shape(cfg, recipe, manifest), label)


def machine_for(
    recipe: Recipe, recipe_arg: str | None, here: Inventory, *, gpus_needed: bool
) -> tuple[Inventory, str | None]:
    """This machine, unless it has no GPU where the plan needs one and the recipe's name
    describes a machine: then that one, with the one line that says so (else None)."""
    if here.gpus or not gpus_needed or recipe_arg is None:
        return here, None
    described = recipe_machine(recipe.name or str(recipe_arg), here)
    if described is None:
        return here, None
    line = (
        f"this machine has no GPU: planned for the machine recipe {_stem(str(recipe_arg))} "
        f"describes ({len(described.gpus)}x{described.gpus[0].total_bytes / GiB:.0f} GiB GPU); "
        "describe another with --gpus N --gpu-mem SIZE --cpu-mem SIZE"
    )
    return described, line
