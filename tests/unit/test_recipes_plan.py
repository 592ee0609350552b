"""Every real-teacher recipe in pipelines/ fits the machine its name says, per `wandistill plan`.

The recipes are named `<model>_<N>x<GB>gb.toml`; each is planned with the what-if flags for that
machine (`plan RECIPE --config MODEL --gpus N --gpu-mem <GB>GiB --cpu-mem ...`), from the
committed configs on the meta device (no weights). A placement that runs one process per GPU
under torchrun (`cuda`) is the single-GPU row of that plan. docs/placement.md shows these tables.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from wandistill.cli import main
from wandistill.config import load_recipe, shipped_recipe_names

PIPELINES = Path(__file__).parents[2] / "pipelines"
REAL = sorted(p for p in PIPELINES.glob("*.toml") if re.fullmatch(r".+_\d+x\d+gb\.toml", p.name))
#: RAM assumed for each machine: a 24 GB workstation, an 80 GB server, a 4x80 GB node.
RAM = {"1x24gb": "64GiB", "1x80gb": "256GiB", "4x80gb": "512GiB"}


def machine_flags(recipe: Path) -> list[str]:
    """The what-if flags for the machine a recipe's name says."""
    hw = recipe.stem.split("_")[1]
    gpus, gb = re.fullmatch(r"(\d+)x(\d+)gb", hw).groups()  # type: ignore[union-attr]
    return ["--gpus", gpus, "--gpu-mem", f"{gb}GiB", "--cpu-mem", RAM[hw], "--disk", "2TiB"]


def test_recipes_cover_three_models_on_three_machines() -> None:
    names = {p.stem for p in REAL}
    for model in ("wan2.1-1.3b", "wan2.1-14b", "wan2.2-a14b"):
        for hw in ("1x24gb", "1x80gb", "4x80gb"):
            assert f"{model}_{hw}" in names
    assert set(shipped_recipe_names()) == {"tiny", "tiny-fewstep", *names}  # the rest: a machine


@pytest.mark.parametrize("recipe", REAL, ids=lambda p: p.stem)
def test_the_recipe_placement_fits_the_machine_its_name_says(
    recipe: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = recipe.stem.split("_")[0]
    try:
        main(["plan", str(recipe), "--config", model, *machine_flags(recipe), "--json"])
    except SystemExit as e:
        pytest.fail(f"plan exited {e.code}: {capsys.readouterr().err}")
    data = json.loads(capsys.readouterr().out)
    requested = load_recipe(recipe).precompute.teacher.placement
    assert data["requested"] == str(requested)
    row = next(
        s
        for s in data["strategies"]
        if s["strategy"] == str(requested)
        or (str(requested) in ("cuda", "gpu0") and s["strategy"].startswith("cuda:"))
    )
    assert row["fits"], f"{recipe.name}: {requested} does not fit: {row['note']}"
    assert data["auto"]["strategy"] is not None
