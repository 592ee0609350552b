"""Every real-teacher recipe in pipelines/ fits the hardware its name says, per `plan`.

The recipes are named `<model>_<N>x<GB>gb.toml`; the model's configs live in
wandistill/teacher/configs/ and are built on the meta device (no weights). Under torchrun every
rank plans for its own GPU, so a 4x80gb recipe with placement `cuda` is checked on one 80 GB GPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from wandistill.config import load_recipe
from wandistill.teacher.plan import Inventory, SamplerSizes, make_plan

PIPELINES = Path(__file__).parents[2] / "pipelines"
REAL = sorted(p for p in PIPELINES.glob("*.toml") if re.fullmatch(r".+_\d+x\d+gb\.toml", p.name))
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PER_RANK = ("cuda", "gpu0", "model-offload", "group-offload")


def test_recipes_cover_three_models_on_three_machines() -> None:
    names = {p.stem for p in REAL}
    for model in ("wan2.1-1.3b", "wan2.1-14b", "wan2.2-a14b"):
        for hw in ("1x24gb", "1x80gb", "4x80gb"):
            assert f"{model}_{hw}" in names


@pytest.mark.parametrize("recipe", REAL, ids=lambda p: p.stem)
def test_the_recipe_placement_fits_its_machine(recipe: Path) -> None:
    model, hw = recipe.stem.split("_")
    gpus, gib = (int(x) for x in re.fullmatch(r"(\d+)x(\d+)gb", hw).groups())  # type: ignore[union-attr]
    cfg = load_recipe(recipe).precompute
    placement = cfg.teacher.placement
    visible = 1 if placement in PER_RANK else gpus  # torchrun: one GPU per rank
    plan = make_plan(
        model,
        dtype=DTYPES[cfg.teacher.dtype],
        sizes=SamplerSizes.from_config(cfg),
        inventory=Inventory.fake(visible, float(gib), cpu_gib=256.0, disk_gib=2000.0),
        placement=placement,
    )
    chosen = plan.strategy(placement)
    assert chosen.fits, f"{recipe.name}: {placement} does not fit: {chosen}"
