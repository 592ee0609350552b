"""Placements as typed objects: parsed once at the edge, one memory model for plan and load.

No GPU here: device-map loads are checked by capturing what the loader hands the library
(`load_pretrained` mocked), on a described 4x80 GiB machine.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from wandistill.config import load_recipe, to_dict
from wandistill.errors import ConfigError, UsageError
from wandistill.placement import load as pl
from wandistill.placement.devices import CUDA_OVERHEAD, GiB, parse_size
from wandistill.placement.estimate import SamplerSizes
from wandistill.placement.inventory import Inventory
from wandistill.placement.parse import Auto, parse_device, parse_placement
from wandistill.placement.plan import make_plan
from wandistill.placement.render import render_plan
from wandistill.placement.strategies import (
    Balanced,
    Cpu,
    Cuda,
    DiskOffload,
    GroupOffload,
    ModelOffload,
)
from wandistill.teacher.folder import TeacherFolder

from clirun import run_cli as _run

ROOT = Path(__file__).parents[2]
BF16 = torch.bfloat16
RECIPE_4X80 = ROOT / "pipelines" / "wan2.1-14b_4x80gb.toml"
WHAT_IF_4X80 = ["--gpus", "4", "--gpu-mem", "80GiB", "--cpu-mem", "512GiB"]


class _Captured(Exception):
    """Raised by the mocked library loader once it has seen its arguments."""


def _capture_load(monkeypatch: pytest.MonkeyPatch, gpus: int) -> dict[str, object]:
    seen: dict[str, object] = {}

    def fake(cls: type, path: Path, **kwargs: object) -> None:
        seen.update(kwargs, cls=cls)
        raise _Captured

    monkeypatch.setattr(pl, "load_pretrained", fake)
    monkeypatch.setattr(pl, "_visible_gpus", lambda: gpus)
    return seen


# --------------------------------------------------------------------------- plan == load


@pytest.mark.parametrize("strategy", ["balanced", "sequential"])
def test_a_device_map_load_passes_the_max_memory_the_plan_printed(
    strategy: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["plan", str(RECIPE_4X80), "--config", "wan2.1-14b", *WHAT_IF_4X80]
    code, out, err = _run(capsys, *args, "--placement", strategy, "--json")
    assert code == 0, err
    row = next(s for s in json.loads(out)["strategies"] if s["strategy"] == strategy)
    printed = row["max_memory"]

    cfg = load_recipe(RECIPE_4X80, [f"teacher.placement={strategy!r}"], stage="precompute")
    inventory = Inventory.described(gpus=4, gpu_mem="80GiB", cpu_mem="512GiB", disk=None)
    folder = TeacherFolder.published("wan2.1-14b")
    sizes = SamplerSizes.from_config(cfg.precompute)
    placement = pl.resolve_placement(
        cfg.precompute.teacher.placement,
        folder=folder,
        dtype=BF16,
        sizes=sizes,
        inventory=inventory,
    )
    seen = _capture_load(monkeypatch, gpus=4)
    for component in ("text_encoder", "transformer"):
        with pytest.raises(_Captured):
            pl.load_component(folder, component, dtype=BF16, placement=placement)
        assert seen["device_map"] == strategy
        passed = {str(k): v for k, v in seen["max_memory"].items()}  # type: ignore[union-attr]
        assert passed == printed[component]
    # and the headroom is in it: free memory - that phase's activations - the CUDA allowance
    plan = make_plan(folder, dtype=BF16, sizes=sizes, inventory=inventory, placement=placement)
    free = inventory.gpus[0].free_bytes
    act = plan.activation("transformer")
    assert act > 0 and set(printed["transformer"].values()) == {free - act - CUDA_OVERHEAD}
    console = Console(record=True, width=200)
    for r in render_plan(plan):
        console.print(r)
    budget_row = next(
        line
        for line in console.export_text().splitlines()
        if line.count(strategy) and "transformer" in line and "max_memory" not in line
    )
    assert f"{printed['transformer']['0'] / GiB:.1f}" in budget_row


def test_a_vae_under_balanced_loads_whole_on_one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    folder = TeacherFolder.published("wan2.1-1.3b")
    inventory = Inventory.fake(2, 80)
    placement = pl.resolve_placement(
        Balanced(), folder=folder, dtype=BF16, sizes=SamplerSizes(), inventory=inventory
    )
    seen = _capture_load(monkeypatch, gpus=2)
    with pytest.raises(_Captured):
        pl.load_component(folder, "vae", dtype=BF16, placement=placement)
    assert seen["device_map"] == "cuda:0" and "max_memory" not in seen


def test_resolve_binds_cuda_and_the_offloads_to_a_gpu() -> None:
    four = Inventory.fake(4, 80)
    kw = {"folder": "wan2.1-1.3b", "dtype": BF16, "inventory": four}
    assert pl.resolve_placement(parse_placement("cuda"), **kw) == Cuda(0)
    assert pl.resolve_placement(ModelOffload(), **kw) == ModelOffload(device="cuda:0")
    assert pl.resolve_placement(DiskOffload(), **kw) == DiskOffload(device="cuda:0")
    assert pl.resolve_placement(DiskOffload(), **{**kw, "inventory": Inventory.cpu_only()}) == (
        DiskOffload(device="cpu")
    )


# --------------------------------------------------------------------------- parsed once


def test_the_placement_text_is_parsed_in_one_place() -> None:
    """Only the recipe loader turns --placement text into an object (plus the parser itself)."""
    callers = set()
    for f in (ROOT / "wandistill").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "parse_placement":
                callers.add(f.relative_to(ROOT).as_posix())
    assert callers <= {"wandistill/config/precompute.py", "wandistill/placement/parse.py"}, callers


def test_the_recipe_holds_typed_placements_with_their_options() -> None:
    sets = ["teacher.placement='group-offload'", "teacher.group_offload_level='leaf_level'"]
    teacher = load_recipe(None, sets, stage="precompute").precompute.teacher
    assert teacher.placement == GroupOffload(level="leaf_level")
    assert "group_offload_level=leaf_level" in teacher.placement.flags()
    caps = ['teacher.placement="balanced"', 'teacher.max_memory={"0" = "70GiB", "cpu" = "1TB"}']
    cfg = load_recipe(None, caps, stage="precompute").precompute
    assert cfg.teacher.placement == Balanced(caps=((0, 70 * GiB), ("cpu", 10**12)))
    assert to_dict(cfg)["teacher"]["placement"] == "balanced"
    auto = load_recipe(None, ["teacher.placement='auto'"], stage="precompute").precompute
    assert auto.teacher.placement == Auto()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("balance", "did you mean balanced"),
        ("cuda:x", "not a GPU index"),
    ],
)
def test_a_bad_placement_in_a_recipe_names_the_key_and_the_nearest(text: str, match: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_recipe(None, [f"teacher.placement={text!r}"], stage="precompute")
    assert "teacher.placement" in info.value.message
    assert match in f"{info.value.message} {info.value.fix}"


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("80GiB", 80 * GiB),
        ("80 GiB", 80 * GiB),
        ("80gib", 80 * GiB),
        ("80GB", 80 * 10**9),
        ("512MiB", 512 << 20),
        ("2TiB", 2048 * GiB),
        ("1.5TB", 1_500 * 10**9),
        (".5TiB", 512 * GiB),
        ("1e1TB", 10_000 * 10**9),
        (10**9, 10**9),
    ],
)
def test_memory_sizes_take_the_forms_accelerate_takes(text: object, size: int) -> None:
    assert parse_size(text, "--gpu-mem") == size


@pytest.mark.parametrize(
    ("text", "nearest"),
    [
        ("eighty", "80GiB"),
        ("80", "80GiB"),
        ("80G", "80GiB"),
        ("80 gigs", "80GiB"),
        ("512M", "512MiB"),
        ("-5GiB", "5GiB"),
        ("0GiB", "GiB"),
        ("infGiB", "80GiB"),
        ("nanGiB", "80GiB"),
        ("1,5TB", "2TiB"),
        ("twoTiB", "2TiB"),
    ],
)
def test_bad_memory_sizes_are_refused_with_the_nearest_spelling(text: str, nearest: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_size(text, "--gpu-mem")
    assert f"--gpu-mem {text!r} is not a memory size" == info.value.message
    assert nearest in (info.value.fix or "")


def test_a_bad_max_memory_in_a_recipe_is_a_config_error() -> None:
    for bad, match in [
        ('{"gpu1" = "70GiB"}', "is not a device"),
        ('{"0" = "lots"}', "memory size"),
    ]:
        sets = ["teacher.placement='balanced'", f"teacher.max_memory={bad}"]
        with pytest.raises(ConfigError, match=match):
            load_recipe(None, sets, stage="precompute")


# --------------------------------------------------------------------------- what-if plans


def test_what_if_plans_a_machine_this_one_is_not(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--config", "wan2.1-14b", "--dtype", "bf16", *WHAT_IF_4X80, "--json"]
    code, out, err = _run(capsys, *args, "--disk", "2TiB")
    assert code == 0, err
    data = json.loads(out)
    assert len(data["inventory"]["gpus"]) == 4
    assert data["inventory"]["gpus"][0][1] == 80 * GiB
    assert data["inventory"]["cpu_bytes"] == 512 * GiB
    assert data["inventory"]["disk_bytes"] == 2048 * GiB
    assert data["auto"]["strategy"] == "cuda:0"
    assert {"balanced", "sequential", "balanced_low_0"} <= {
        s["strategy"] for s in data["strategies"]
    }


@pytest.mark.parametrize(
    ("extra", "message", "fix"),
    [
        (["--placement", "cuda:3"], "'cuda:3' names a GPU this machine does not have", "cuda:1"),
        (["--gpu-mem", "eighty"], "--gpu-mem 'eighty' is not a memory size", "80GiB"),
        (["--gpu-mem", "80G"], "--gpu-mem '80G' is not a memory size", "80GiB"),
    ],
)
def test_what_if_bad_input_is_one_line_with_the_nearest_choice(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str, fix: str
) -> None:
    base = {"--gpus": "2", "--gpu-mem": "24GiB", "--cpu-mem": "64GiB"}
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        base[flag] = value
    args = ["plan", "--config", "wan2.1-1.3b", *[x for kv in base.items() for x in kv]]
    code, _, err = _run(capsys, *args)
    assert code == 2 and message in err and fix in err and "Traceback" not in err


def test_a_what_if_machine_too_small_for_anything_says_what_the_closest_needs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["--gpus", "1", "--gpu-mem", "2GiB", "--cpu-mem", "4GiB", "--disk", "8GiB"]
    code, _, err = _run(capsys, "plan", "--config", "wan2.1-14b", "--dtype", "bf16", *args)
    assert code == 2, err
    assert "too small for teacher wan2.1-14b with any placement; the closest," in err
    assert "disk-offload, needs" in err and "cuda:0 8.9 GiB" in err
    assert "fix: describe a bigger machine: --gpu-mem 10GiB --disk 27GiB" in err


def test_what_if_flags_must_describe_a_whole_machine(capsys: pytest.CaptureFixture[str]) -> None:
    for args, match in [
        (["--gpus", "2", "--cpu-mem", "64GiB"], "--gpus 2 needs the memory of each GPU"),
        (["--gpu-mem", "80GiB", "--cpu-mem", "64GiB"], "--gpus is 0"),
        (["--gpus", "1", "--gpu-mem", "80GiB"], "needs its RAM (--cpu-mem)"),
    ]:
        code, _, err = _run(capsys, "plan", "--config", "wan2.1-1.3b", *args)
        assert code == 2 and match in err, err


# --------------------------------------------------------------------------- device maps


def test_a_device_map_naming_a_missing_module_suggests_the_closest(
    tiny_teacher: Path, tmp_path: Path
) -> None:
    path = tmp_path / "map.json"
    modules = {"blockz.0": "cpu", "": "cpu"}
    path.write_text(json.dumps({"text_encoder": "cpu", "transformer": modules, "vae": "cpu"}))
    with pytest.raises(UsageError) as info:
        pl.resolve_placement(
            parse_placement(str(path)),
            folder=tiny_teacher,
            dtype=torch.float32,
            sizes=SamplerSizes(),
        )
    assert "module 'blockz.0' does not exist" in info.value.message
    assert "did you mean 'blocks.0'" in (info.value.fix or "")


def test_a_device_map_gpu_beyond_the_machine_names_the_highest(tmp_path: Path) -> None:
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"transformer": {"blocks": 3, "": 0}}))
    with pytest.raises(UsageError) as info:
        parse_placement(str(path)).check(gpus=2)
    assert "GPU 3 but 2 GPU(s)" in info.value.message and "GPU 1 at most" in (info.value.fix or "")


# --------------------------------------------------------------------------- eval / sample


def test_device_flags_parse_into_the_same_placement_objects() -> None:
    assert parse_device("cpu") == Cpu()
    assert parse_device("cuda:1") == Cuda(1)
    assert parse_device("auto") == Auto()
    with pytest.raises(UsageError) as info:
        parse_device("gpu")
    assert "--device 'gpu'" in info.value.message and "cuda" in (info.value.fix or "")


def test_sample_with_device_auto_runs_the_tiny_teacher_here(
    tiny_teacher: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cube\n")
    args = ["--steps", "1", "--height", "16", "--width", "16", "--max-sequence-length", "16"]
    code, out, err = _run(
        capsys,
        "sample",
        "--teacher",
        str(tiny_teacher),
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "out"),
        "--device",
        "auto",
        *args,
    )
    assert code == 0, err
    assert (tmp_path / "out" / "0000.png").is_file() and (tmp_path / "out" / "grid.png").is_file()
