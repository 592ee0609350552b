"""`wandistill plan`: memory each teacher placement needs (or, --train, training's) and
what fits, on this machine or a described one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from wandistill.cli.common import (
    DTYPES,
    PLACEMENT_HELP,
    RecipeArg,
    SetOpt,
    _flag_sets,
    app,
    choice,
    err,
    option,
    out,
)
from wandistill.cli.precompute import _show_recording
from wandistill.errors import UsageError

if TYPE_CHECKING:
    from wandistill.config import PrecomputeConfig, Recipe
    from wandistill.placement.inventory import Inventory
    from wandistill.placement.plan import Plan


TEACHER_CONFIGS = ("wan2.1-1.3b", "wan2.1-14b", "wan2.2-a14b")
"""`wandistill.teacher.folder.CONFIG_NAMES`, spelled out: that module imports torch, too slow for
building --help. tests/unit/test_cli_help.py checks the two agree."""


MAX_GPUS = 4096
"""plan --gpus: a what-if machine's GPUs (the plan has a row per GPU)."""
MAX_SIZES = {"--gpu-mem": "16TiB", "--cpu-mem": "1024TiB", "--disk": "1048576TiB"}
"""plan's what-if sizes: far above any machine, far below what overflows a plan's arithmetic."""


def _machine_bounds(gpus: int | None, sizes: dict[str, str | None]) -> None:
    """plan's what-if numbers, bounded before anything is planned (a bound named in --help)."""
    from wandistill.placement.devices import parse_size

    if gpus is not None and not 0 <= gpus <= MAX_GPUS:
        raise UsageError(f"--gpus {gpus} must lie in 0..{MAX_GPUS}", fix="e.g. --gpus 8")
    for flag, text in sizes.items():
        if text is not None and parse_size(text, flag) > parse_size(MAX_SIZES[flag], flag):
            raise UsageError(
                f"{flag} {text!r} is larger than the {MAX_SIZES[flag]} a machine can have here",
                fix=f"pass a real size, e.g. {flag} 80GiB",
            )


TeacherOpt = Annotated[
    str | None,
    option(
        help="Local diffusers Wan folder; sizes come from its safetensors headers, so its "
        "weights need not be downloaded yet.",
        path="--teacher",
        recipe="teacher.path",
    ),
]
ConfigOpt = Annotated[
    str | None,
    typer.Option(
        "--config",
        metavar="NAME",  # checked, with its fix, by the loader
        help="A published teacher's shipped configs, no folder at all: to size a machine "
        f"before downloading ({', '.join(TEACHER_CONFIGS)}). Not with --teacher.",
        show_default="none",
    ),
]
PlacementOpt = Annotated[
    str | None,
    option(
        help="Placement to check (the plan lists them all). " + PLACEMENT_HELP,
        recipe="teacher.placement",
        fallback="auto",
    ),
]
DtypeOpt = Annotated[
    str | None,
    option(
        help="Teacher compute dtype to size for: bf16 halves fp32's weight memory.",
        **choice("--dtype", DTYPES),
        recipe="teacher.dtype",
        fallback="fp32",
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json/--no-json", help="Print the plan as JSON (for scripts).")
]
TrainOpt = Annotated[
    bool,
    typer.Option(
        "--train/--no-train",
        help="Plan `train` instead: per-rank weights, gradients, AdamW, EMA and activations "
        "of the recipe's student for DDP / FSDP / checkpointing / LoRA / batch, and which fit.",
    ),
]

# What-if: a machine described by flags instead of this one.
GpusOpt = Annotated[
    int | None,
    typer.Option(
        "--gpus",
        help=f"What-if: plan for a machine with N GPUs, 0..{MAX_GPUS} (with --gpu-mem) "
        "instead of this one.",
        show_default="this machine's",
    ),
]
GpuMemOpt = Annotated[
    str | None,
    typer.Option(
        "--gpu-mem",
        help=f"What-if: memory of each GPU (80GiB, 80GB), at most {MAX_SIZES['--gpu-mem']}.",
        show_default="this machine's",
    ),
]
CpuMemOpt = Annotated[
    str | None,
    typer.Option(
        "--cpu-mem",
        help=f"What-if: RAM (512GiB), at most {MAX_SIZES['--cpu-mem']}.",
        show_default="this machine's",
    ),
]
DiskOpt = Annotated[
    str | None,
    typer.Option(
        "--disk",
        help=f"What-if: free disk for disk-offload, at most {MAX_SIZES['--disk']}.",
        show_default="1TiB in a what-if, else the free space of the offload folder",
    ),
]
Machine = tuple[int | None, str | None, str | None, str | None]
"""plan's what-if flags: --gpus, --gpu-mem, --cpu-mem, --disk (None: not given)."""


@app.command("plan")
def plan_cmd(
    recipe: RecipeArg = None,
    teacher: TeacherOpt = None,
    config: ConfigOpt = None,
    placement: PlacementOpt = None,
    dtype: DtypeOpt = None,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
    gpus: GpusOpt = None,
    gpu_mem: GpuMemOpt = None,
    cpu_mem: CpuMemOpt = None,
    disk: DiskOpt = None,
    train: TrainOpt = False,
) -> None:
    """Memory each placement needs, what fits, and which one auto picks (or, --train, training's).

    Per phase and device, on this machine or on one described with --gpus, --gpu-mem,
    --cpu-mem and --disk; nothing is loaded. A recipe named for a machine (`*_1x80gb`) is planned
    for that machine where this one has no GPU. --train: per-rank weights, gradients, AdamW, EMA
    and activations of the recipe's student for DDP / FSDP / checkpointing / LoRA / batch."""
    _machine_bounds(gpus, {"--gpu-mem": gpu_mem, "--cpu-mem": cpu_mem, "--disk": disk})
    from wandistill.config import load_recipe

    if teacher and config:
        raise UsageError("--teacher and --config both given", fix="pass one of them")
    machine = (gpus, gpu_mem, cpu_mem, disk)
    if train:
        _plan_train(recipe, teacher, config, overrides, as_json, machine)
        return
    flags = {"teacher.path": teacher, "teacher.placement": placement, "teacher.dtype": dtype}
    full = load_recipe(recipe, [*(overrides or []), *_flag_sets(flags)], stage="precompute")
    cfg = full.precompute
    if config is None and not cfg.teacher.path:
        raise UsageError(
            "no teacher to plan",
            fix="pass --teacher PATH, --config wan2.1-14b, or a recipe with teacher.path",
        )
    here = cfg.teacher.offload_folder or cfg.cache.path
    needs_cuda = cfg.teacher.placement.needs_cuda
    inventory, what_if = _machine(full, recipe, machine, here, gpus_needed=needs_cuda)
    if any(v is not None for v in machine):  # cuda:3 on --gpus 2 is an error
        cfg.teacher.placement.check(len(inventory.gpus))
    plan = _teacher_plan(cfg, config, inventory)
    if as_json:
        out.print_json(json.dumps(plan.to_json()))
    else:
        from wandistill.placement.render import render_plan

        for renderable in render_plan(plan):
            out.print(renderable)
        if recipe is not None and not config:
            _show_recording(full)
    if what_if and plan.auto.placement is None:
        from wandistill.placement.plan import too_small

        raise too_small(plan)
    if not what_if:
        try:
            cfg.teacher.placement.check(len(inventory.gpus))
        except UsageError as e:
            err.print(f"[yellow]requested placement:[/yellow] {e.message}", highlight=False)


def _machine(
    full: Recipe, recipe: str | None, machine: Machine, here: str, *, gpus_needed: bool
) -> tuple[Inventory, bool]:
    """The machine a plan is for, and whether it is a what-if (not this one): the one the
    flags describe, else this one (`here`: the folder whose free disk counts), or the machine
    a recipe is named for where this one has no GPU (said in a note)."""
    from wandistill.placement.inventory import Inventory
    from wandistill.placement.train_inputs import machine_for

    gpus, gpu_mem, cpu_mem, disk = machine
    if any(v is not None for v in machine):
        return Inventory.described(gpus=gpus, gpu_mem=gpu_mem, cpu_mem=cpu_mem, disk=disk), True
    inventory, line = machine_for(full, recipe, Inventory.detect(here), gpus_needed=gpus_needed)
    if line:
        err.print(f"[yellow]note:[/yellow] {escape(line)}", highlight=False)
    return inventory, bool(line)


def _teacher_plan(cfg: PrecomputeConfig, config: str | None, inventory: Inventory) -> Plan:
    """The placement plan of the recipe's teacher (or the published --config) on `inventory`."""
    from wandistill.placement.estimate import SamplerSizes, dtype_from_name
    from wandistill.placement.plan import make_plan
    from wandistill.teacher.folder import TeacherFolder

    # Validated as precompute would (custom code, pickles, bad configs); weights may be absent.
    source = (
        TeacherFolder.published(config)
        if config
        else TeacherFolder.open(cfg.teacher.path, complete=False)
    )
    return make_plan(
        source,
        dtype=dtype_from_name(cfg.teacher.dtype),
        sizes=SamplerSizes.from_config(cfg),
        inventory=inventory,
        placement=cfg.teacher.placement,
    )


def _plan_train(
    recipe: str | None,
    teacher: str | None,
    config: str | None,
    overrides: list[str] | None,
    as_json: bool,
    machine: Machine,
) -> None:
    """`plan --train`: the student's memory per rank for each way to train it."""
    from wandistill.config import load_recipe
    from wandistill.placement.train_inputs import train_inputs
    from wandistill.placement.train_plan import choice_of, make_train_plan, render_train_plan

    full = load_recipe(recipe, overrides or [], stage="train")
    wants_gpu = full.train.device != "cpu"
    inventory, _ = _machine(full, recipe, machine, full.train.out or ".", gpus_needed=wants_gpu)
    tconf, label = _teacher_transformer_config(teacher, config, full)
    inputs = train_inputs(full, tconf, label)
    plan = make_train_plan(
        inputs.student_config,
        choice_of(full.train),
        inputs.shape,
        inventory,
        lora_targets=tuple(full.train.student.lora.target_modules),
        student=f"{full.name or recipe or 'recipe defaults'} (base config: {inputs.label})",
    )
    if as_json:
        out.print_json(json.dumps(plan.to_json()))
        return
    for renderable in render_train_plan(plan):
        out.print(renderable, highlight=False)


def _teacher_transformer_config(
    teacher: str | None, config: str | None, recipe: Recipe
) -> tuple[dict[str, Any] | None, str]:
    """The teacher transformer config a train plan starts the student from: --config, --teacher,
    or the recipe's teacher.path where that folder exists (else None: the cache's, if any)."""
    from wandistill.teacher.folder import TeacherFolder

    if config:
        return TeacherFolder.published(config).raw_config("transformer"), f"published {config}"
    path = teacher or recipe.precompute.teacher.path
    if path and (teacher or Path(path).is_dir()):
        folder = TeacherFolder.open(path, complete=False)
        return folder.raw_config("transformer"), f"teacher {path}"
    return None, "the recipe's sizes"
