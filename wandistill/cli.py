"""The `wandistill` command line: parse, build a config, call the room that does the work.

`main()` is the only place that turns exceptions into exit codes: a `WandistillError` prints one
line (and its fix) and exits 2 for usage errors or 1 for runtime failures; any other exception is
a bug: one line naming a crash log (in the temp folder) that holds the traceback, exit 1.
`--debug` (or WANDISTILL_DEBUG=1) shows the traceback instead.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from wandistill import __version__
from wandistill.errors import ConfigError, UsageError, WandistillError

if TYPE_CHECKING:
    from wandistill.config import Recipe

app = typer.Typer(
    name="wandistill",
    help="Distil Wan 2.1/2.2 video diffusion teachers into small students through a cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
teacher_app = typer.Typer(
    help="Teacher folders: build the tiny offline teachers.", no_args_is_help=True
)
cache_app = typer.Typer(help="Inspect and check caches.", no_args_is_help=True)
recipes_app = typer.Typer(
    help="List the recipes that ship with wandistill (any RECIPE takes their NAME); "
    "`recipes copy NAME` writes one out to edit."
)
app.add_typer(teacher_app, name="teacher")
app.add_typer(cache_app, name="cache")
app.add_typer(recipes_app, name="recipes")

out = Console()
err = Console(stderr=True)
_debug = bool(os.environ.get("WANDISTILL_DEBUG"))


def _version(value: bool) -> None:
    if value:
        out.print(f"wandistill {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    global _debug
    _debug = _debug or debug


# --------------------------------------------------------------------------- teacher


@teacher_app.command("make-tiny")
def teacher_make_tiny(
    path: Annotated[Path, typer.Argument(help="Folder to create (diffusers layout).")],
    wan22: Annotated[
        bool, typer.Option("--wan22", help="Wan 2.2 A14B layout: two experts + boundary_ratio.")
    ] = False,
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing teacher at PATH.")] = False,
) -> None:
    """Write a tiny random-weight Wan teacher that WanPipeline loads and runs on CPU."""
    from wandistill.bounds import SEED, flag_problem
    from wandistill.teacher.tiny import make_tiny_teacher

    if (problem := flag_problem("--seed", seed, SEED)) is not None:
        raise UsageError(problem)

    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UsageError(
            f"cannot create teacher folder {str(path)!r}: {str(blocker)!r} is a file",
            fix="choose another PATH",
        )
    try:
        made = make_tiny_teacher(path, wan22=wan22, seed=seed, overwrite=overwrite)
    except FileExistsError as e:
        raise UsageError(str(e), fix="pass --overwrite, or choose another PATH") from None
    out.print(f"wrote tiny {'Wan 2.2 A14B' if wan22 else 'Wan 2.1'} teacher to {made}")


# --------------------------------------------------------------------------- cache


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


@cache_app.command("info")
def cache_info(
    path: Annotated[str, typer.Argument(help="Cache directory or fsspec URL (s3://...).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False,
) -> None:
    """Records, bytes, fields, sampler settings and shards of a cache."""
    from wandistill.cache.manifest import load_committed

    m = load_committed(path)
    if as_json:
        out.print_json(json.dumps(m.to_json()))
        return
    head = Table(title=f"cache {path}", show_header=False)
    head.add_row("backend", m.backend)
    head.add_row("complete", str(m.complete))
    head.add_row("records", str(m.num_records))
    head.add_row("shards", str(len(m.shards)))
    head.add_row("bytes", _human(m.num_bytes))
    head.add_row("teacher", str(m.teacher.get("fingerprint", "?"))[:16])
    head.add_row("schema", f"v{m.schema_version} (wandistill {m.wandistill_version})")
    out.print(head)
    fields = Table(title="fields")
    for col in ("name", "dtype", "shape"):
        fields.add_column(col)
    for f in m.fields:
        fields.add_row(f["name"], f["dtype"], f["shape"])
    out.print(fields)
    settings = Table(title="sampler settings", show_header=False)
    for k, v in m.settings.items():
        settings.add_row(k, json.dumps(v) if not isinstance(v, str) else v)
    out.print(settings)
    shards = Table(title="shards")
    for col in ("name", "records", "bytes", "sha256"):
        shards.add_column(col)
    for s in m.shards:
        sha = s["sha256"] if isinstance(s["sha256"], str) else f"{len(s['sha256'])} files"
        shards.add_row(s["name"], str(s["records"]), _human(s["bytes"]), sha[:16])
    out.print(shards)


@cache_app.command("verify")
def cache_verify(
    path: Annotated[str, typer.Argument(help="Cache directory or fsspec URL (s3://...).")],
) -> None:
    """Check every shard's checksum and decode every record; exit 1 if anything is wrong."""
    from wandistill.cache.reader import open_cache

    with open_cache(path, check_entries=False) as store:  # verify reports edited entries itself
        problems = store.verify()
        n, shards = len(store), len(store.entries)
    if problems:
        for p in problems:
            err.print(f"[red]BAD[/red] {escape(p)}", highlight=False, soft_wrap=True)
        err.print(f"{len(problems)} problem(s) in cache {path}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    out.print(f"OK: {n} records in {shards} shards of {path} verified", highlight=False)


# --------------------------------------------------------------------------- recipes


@recipes_app.callback(invoke_without_command=True)
def recipes_list(ctx: typer.Context) -> None:
    """List the shipped recipes; pass a NAME wherever a command takes a RECIPE."""
    if ctx.invoked_subcommand is not None:
        return
    from wandistill.config import load_recipe, shipped_recipe_names

    table = Table(title="shipped recipes (`wandistill recipes copy NAME` to edit one)")
    table.add_column("name", no_wrap=True)  # whole, to copy into a command
    for col in ("description", "teacher", "placement"):
        table.add_column(col, overflow="fold")
    for name in shipped_recipe_names():
        r = load_recipe(name)
        t = r.precompute.teacher
        table.add_row(name, r.description, t.path, str(t.placement))
    out.print(table)


@recipes_app.command("copy")
def recipes_copy(
    name: Annotated[str, typer.Argument(help="Shipped recipe name (see `wandistill recipes`).")],
    dest: Annotated[
        Path | None, typer.Argument(help="File or folder to write (default: ./NAME.toml).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing DEST file.")] = False,
) -> None:
    """Copy a shipped recipe out for editing; commands take the copy's path as their RECIPE."""
    from wandistill.config import shipped_recipe
    from wandistill.fsutil import atomic_write_bytes

    source = shipped_recipe(name)
    target = Path(f"{name}.toml") if dest is None else dest
    if target.is_dir():
        target = target / f"{name}.toml"
    if target.exists() and not force:
        raise UsageError(
            f"{str(target)!r} already exists; not overwritten",
            fix="pass --force to replace it, or choose another DEST",
        )
    _out_dir(target.parent, "DEST")
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(target, source.read_bytes())
    out.print(f"wrote {target} (recipe {name!r}); run it with: wandistill precompute {target}")


# --------------------------------------------------------------------------- precompute

RecipeArg = Annotated[
    str | None,
    typer.Argument(
        help="TOML recipe file or shipped recipe name (`wandistill recipes`); flags override it."
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a recipe key: section.key=value (repeatable)."),
]


@app.command("precompute")
def precompute_cmd(
    recipe: RecipeArg = None,
    teacher: Annotated[str | None, typer.Option(help="Local diffusers Wan folder.")] = None,
    prompts: Annotated[str | None, typer.Option(help="Prompt file (.txt or .jsonl).")] = None,
    out_dir: Annotated[str | None, typer.Option("--out", help="Cache directory to write.")] = None,
    backend: Annotated[str | None, typer.Option(help="webdataset or zarr.")] = None,
    placement: Annotated[str | None, typer.Option(help="Where the teacher runs.")] = None,
    dtype: Annotated[str | None, typer.Option(help="fp32, fp16 or bf16.")] = None,
    overrides: SetOpt = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the resolved config and stop.")
    ] = False,
) -> None:
    """Run the teacher once over a prompt list and write a reusable cache."""
    from wandistill.config import load_recipe, to_dict

    flags = {
        "teacher.path": teacher,
        "prompts": prompts,
        "cache.path": out_dir,
        "cache.backend": backend,
        "teacher.placement": placement,
        "teacher.dtype": dtype,
    }
    sets = [
        *(overrides or []),
        *(f"{k}={json.dumps(v)}" for k, v in flags.items() if v is not None),
    ]
    full = load_recipe(recipe, sets, stage="precompute")
    cfg = full.precompute
    if dry_run:
        out.print_json(json.dumps(to_dict(cfg)))
        _show_recording(full)
        return
    from wandistill.precompute import run
    from wandistill.precompute.run import REPORT_NAME

    s = run(cfg)
    from wandistill.storage import open_storage

    cache = open_storage(s.cache)
    if cache.exists(REPORT_NAME):  # rank 0 wrote it: what in the prompt file was skipped or cut
        from wandistill.precompute.prompts import PromptReport

        text = cache.read(REPORT_NAME, max_bytes=1 << 26, what="report", fix="", error=UsageError)
        for line in PromptReport(**json.loads(text)).summary():
            out.print(line, highlight=False)
    out.print(
        f"cache {s.cache}: {s.records_written} records written, {s.records_skipped} already "
        f"there, {s.prompts_encoded} prompts encoded, {_human(s.bytes_written)} in "
        f"{s.seconds:.1f} s",
        highlight=False,
    )


# --------------------------------------------------------------------------- train


@app.command("train")
def train_cmd(
    recipe: RecipeArg = None,
    cache: Annotated[str | None, typer.Option(help="Cache directory (precompute --out).")] = None,
    out_dir: Annotated[str | None, typer.Option("--out", help="Run directory to write.")] = None,
    steps: Annotated[int | None, typer.Option(help="Optimizer steps (train.steps).")] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the newest checkpoint in --out.")
    ] = False,
    follow: Annotated[
        bool, typer.Option("--follow", help="Train on a cache still being written.")
    ] = False,
    skip_corrupt: Annotated[
        bool, typer.Option("--skip-corrupt", help="Skip (and count) unreadable records.")
    ] = False,
    overrides: SetOpt = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the resolved config and stop.")
    ] = False,
) -> None:
    """Distil the cached teacher into a small student (alone or under torchrun)."""
    from wandistill.config import load_recipe, to_dict

    flags = {"cache": cache, "out": out_dir, "steps": steps}
    sets = [
        *(overrides or []),
        *(f"{k}={json.dumps(v)}" for k, v in flags.items() if v is not None),
    ]
    cfg = load_recipe(recipe, sets, stage="train").train
    if cfg.out:
        _out_dir(cfg.out)
    if dry_run:
        out.print_json(json.dumps(to_dict(cfg)))
        if not cfg.cache:
            out.print("(pass --cache to see which recorded steps each objective trains at)")
            return
        from wandistill.train.loop import objective_plan

        for line in objective_plan(cfg).describe():
            out.print(line, highlight=False, soft_wrap=True)
        return
    from wandistill.train import run

    r = run(cfg, resume=resume, follow=follow, skip_corrupt=skip_corrupt)
    if not r.is_main:
        return
    if r.corrupt:
        shards = sum(1 for line in r.corrupt if line.startswith("unusable shard"))
        err.print(
            f"--skip-corrupt: skipped {len(r.corrupt) - shards} corrupt sample read(s) and "
            f"{shards} unusable shard(s):",
            highlight=False,
        )
        for line in r.corrupt[:20]:
            err.print(f"  {line}", highlight=False)
    out.print(
        f"trained {r.steps} steps in {r.seconds:.1f} s; student: {r.student}, EMA: {r.student_ema}",
        highlight=False,
    )


def _show_recording(recipe: Recipe) -> None:
    """precompute --dry-run and plan: the steps the recipe records and, against them, the steps
    each of its train objectives would use (problems shown, not raised: nothing runs here)."""
    from wandistill.precompute.run import inspect_teacher, recorded_steps
    from wandistill.student.schedule import TeacherSchedule, plan_objectives

    cfg = recipe.precompute
    if not cfg.teacher.path or not Path(cfg.teacher.path).is_dir():
        out.print("(pass --teacher to place the recorded steps on the teacher's schedule)")
        return
    teacher = inspect_teacher(cfg.teacher.path, cfg.sampler.flow_shift)
    steps = recorded_steps(teacher, cfg)
    n = cfg.sampler.num_inference_steps
    out.print(
        f"precompute records {len(steps)} of {n} steps: {steps}", highlight=False, soft_wrap=True
    )
    schedule = TeacherSchedule.from_scheduler(teacher.scheduler, n, steps, teacher.boundary_ratio)
    try:
        k = recipe.train.student.num_inference_steps
        plan = plan_objectives(recipe.train.loss, k, schedule)
    except UsageError as e:
        err.print(
            f"[yellow]train on this cache:[/yellow] {escape(e.message)}",
            highlight=False,
            soft_wrap=True,
        )
        return
    for line in plan.describe():
        out.print(line, highlight=False, soft_wrap=True)


# --------------------------------------------------------------------------- eval / sample


def _positive(**values: int | None) -> None:
    """Usage error for a numeric flag that must be positive (None: not given)."""
    for name, v in values.items():
        if v is not None and v <= 0:
            raise UsageError(f"--{name.replace('_', '-')} {v} must be positive")


def _out_dir(path: str | Path, flag: str = "--out") -> None:
    """An output directory that is (or is under) a file is a usage error, named as such."""
    from wandistill.storage import is_url

    if is_url(path):
        return  # an object-store prefix: `outputs.claim_remote` checks it
    blocker = next(
        (p for p in (Path(path), *Path(path).parents) if p.exists() and not p.is_dir()), None
    )
    if blocker is not None:
        raise UsageError(
            f"{flag} {str(path)!r} cannot be a directory: {str(blocker)!r} is a file",
            fix=f"choose another {flag} directory",
        )


DeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        help="auto (a GPU if the models fit one, else the CPU), cpu, cuda or cuda:N; loads the "
        "teacher's text encoder / VAE with the same placement machinery as precompute.",
    ),
]


@app.command("eval")
def eval_cmd(
    cache: Annotated[
        str, typer.Option(help="Cache with held-out records (a folder or an fsspec URL).")
    ],
    student: Annotated[Path, typer.Option(help="Student folder (<train out>/student).")],
    out_dir: Annotated[Path, typer.Option("--out", help="Where eval.md/json and grid.png go.")],
    teacher: Annotated[
        Path | None, typer.Option(help="Teacher folder: adds VAE-decoded PSNR and images.")
    ] = None,
    steps: Annotated[
        int | None, typer.Option(help="Student sampler steps (default: teacher's).")
    ] = None,
    split: Annotated[str, typer.Option(help="holdout (default) or all.")] = "holdout",
    max_records: Annotated[int | None, typer.Option(help="Evaluate at most N records.")] = None,
    device: DeviceOpt = "cpu",
) -> None:
    """Compare the student's samples with the teacher's cached final latents."""
    from wandistill.eval.run import evaluate
    from wandistill.placements import parse_device

    if split not in ("holdout", "all"):
        raise UsageError(f"--split {split!r} must be holdout or all")
    _positive(steps=steps, max_records=max_records)
    from wandistill.bounds import flag_problem, range_of
    from wandistill.config import SamplerConfig

    steps_range = range_of(SamplerConfig, "num_inference_steps")
    if steps is not None and steps_range and (p := flag_problem("--steps", steps, steps_range)):
        raise UsageError(p)
    where = parse_device(device)
    _out_dir(out_dir)
    result = evaluate(
        cache,
        student,
        out_dir,
        teacher=teacher,
        steps=steps,
        split=split,
        max_records=max_records,
        device=where,
    )
    out.print(result.table(), highlight=False)
    out.print(f"wrote {out_dir / 'eval.md'}, {out_dir / 'eval.json'}, {result.grid}")


@app.command("sample")
def sample_cmd(
    teacher: Annotated[Path, typer.Option(help="Teacher folder (text encoder, VAE, scheduler).")],
    prompts: Annotated[Path, typer.Option(help="Prompt file (.txt or .jsonl).")],
    out_dir: Annotated[Path, typer.Option("--out", help="Where the PNGs and grid.png go.")],
    student: Annotated[
        Path | None, typer.Option(help="Student folder; omit to sample the teacher.")
    ] = None,
    steps: Annotated[int, typer.Option(help="Sampler steps.")] = 8,
    height: Annotated[int, typer.Option()] = 32,
    width: Annotated[int, typer.Option()] = 32,
    num_frames: Annotated[int, typer.Option()] = 1,
    guidance_scale: Annotated[float, typer.Option(help="Teacher only.")] = 5.0,
    seed: Annotated[int, typer.Option()] = 0,
    max_sequence_length: Annotated[
        int, typer.Option(help="Text padding length; use the cache's (512 for real Wan).")
    ] = 512,
    limit: Annotated[int, typer.Option(help="At most N prompts.")] = 16,
    device: DeviceOpt = "cpu",
) -> None:
    """Generate images from prompts with the student (or the teacher, for comparison)."""
    from wandistill.config import SamplerConfig
    from wandistill.eval.sample import sample
    from wandistill.placements import parse_device
    from wandistill.precompute.prompts import read_prompts

    where = parse_device(device)

    try:  # the flags get the recipe's ranges (finite, in range) through the same config class
        SamplerConfig(
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=steps,
            max_sequence_length=max_sequence_length,
            guidance_scale=guidance_scale,
            seed=seed,
        )
    except ConfigError as e:  # name the flags, not the recipe keys
        flags = {"num_inference_steps": "steps"}
        raise UsageError(
            re.sub(
                r"sampler\.(\w+)",
                lambda m: "--" + flags.get(m[1], m[1]).replace("_", "-"),
                e.message,
            )
        ) from None
    _positive(limit=limit)
    _out_dir(out_dir)
    items, _ = read_prompts(prompts)
    paths = sample(
        teacher,
        [p.text for p in items[:limit]],
        out_dir,
        student=student,
        steps=steps,
        guidance_scale=guidance_scale,
        max_sequence_length=max_sequence_length,
        height=height,
        width=width,
        num_frames=num_frames,
        seed=seed,
        device=where,
    )
    out.print(f"wrote {len(paths)} images and {out_dir / 'grid.png'}")


@app.command("demo")
def demo_cmd(
    root: Annotated[
        Path, typer.Option(help="Folder for everything the demo makes (relative: to the cwd).")
    ] = Path("cache/demo"),
    recipe: Annotated[
        str, typer.Option(help="Recipe file or shipped recipe name (`wandistill recipes`).")
    ] = "tiny",
    overrides: SetOpt = None,
) -> None:
    """Tiny offline teacher -> precompute -> train -> eval; prints a table, writes PNGs."""
    from wandistill.demo import run_demo

    result = run_demo(root, recipe, overrides)
    out.print()
    out.print(result.eval.table(), highlight=False)
    out.print(
        f"\nteacher | student grid: {result.grid}\nloss curve: {result.loss_plot}\n"
        f"student: {result.root / 'run' / 'student'} (loads with "
        "WanTransformer3DModel.from_pretrained)",
        highlight=False,
    )


@app.command("export")
def export_cmd(
    run: Annotated[Path, typer.Option("--run", help="Run folder of a finished `train`.")],
    teacher: Annotated[
        Path, typer.Option(help="The teacher folder (its tokenizer, text encoder and VAE).")
    ],
    out_dir: Annotated[Path, typer.Option("--out", help="Pipeline folder to write.")],
    ema: Annotated[
        bool, typer.Option("--ema/--no-ema", help="Export the EMA weights (default) or the raw.")
    ] = True,
    copy: Annotated[
        bool, typer.Option("--copy", help="Copy the teacher's components instead of linking.")
    ] = False,
) -> None:
    """Write a complete WanPipeline folder: the student, its K-step scheduler, the teacher's
    tokenizer, text encoder and VAE."""
    from wandistill.student.export import export
    from wandistill.teacher.folder import TeacherFolder

    _out_dir(out_dir)
    r = export(run, TeacherFolder.open(teacher), out_dir, ema=ema, copy=copy)
    how = "linked" if r.linked else "copied"
    out.print(
        f"exported {r.weights} to {r.out} (tokenizer, text encoder, VAE {how}); use it as\n"
        f"  WanPipeline.from_pretrained({str(r.out)!r})(prompt, "
        f"num_inference_steps={r.num_inference_steps}, guidance_scale=1.0)",
        highlight=False,
        soft_wrap=True,
    )


# --------------------------------------------------------------------------- plan


@app.command("plan")
def plan_cmd(
    recipe: RecipeArg = None,
    teacher: Annotated[
        str | None, typer.Option(help="Local diffusers Wan folder (sizes from its headers).")
    ] = None,
    config: Annotated[
        str | None,
        typer.Option(
            "--config", help="Published teacher, no weights: wan2.1-1.3b, wan2.1-14b, wan2.2-a14b."
        ),
    ] = None,
    placement: Annotated[str | None, typer.Option(help="Placement to check.")] = None,
    dtype: Annotated[str | None, typer.Option(help="fp32, fp16 or bf16.")] = None,
    overrides: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    gpus: Annotated[
        int | None, typer.Option("--gpus", help="What-if: plan for a machine with N GPUs...")
    ] = None,
    gpu_mem: Annotated[
        str | None, typer.Option("--gpu-mem", help="...of this memory each (80GiB, 80GB)...")
    ] = None,
    cpu_mem: Annotated[
        str | None, typer.Option("--cpu-mem", help="...this much RAM (512GiB)...")
    ] = None,
    disk: Annotated[
        str | None, typer.Option("--disk", help="...and this much offload disk (default 1TiB).")
    ] = None,
) -> None:
    """Memory each placement needs per phase and device, what fits, and auto's pick: on this
    machine, or on one described with --gpus/--gpu-mem/--cpu-mem/--disk."""
    from wandistill.config import load_recipe
    from wandistill.teacher.folder import TeacherFolder
    from wandistill.teacher.plan import (
        Inventory,
        SamplerSizes,
        dtype_from_name,
        make_plan,
        render_plan,
        too_small,
    )

    if teacher and config:
        raise UsageError("--teacher and --config both given", fix="pass one of them")
    flags = {"teacher.path": teacher, "teacher.placement": placement, "teacher.dtype": dtype}
    sets = [
        *(overrides or []),
        *(f"{k}={json.dumps(v)}" for k, v in flags.items() if v is not None),
    ]
    cfg = load_recipe(recipe, sets, stage="precompute").precompute
    if config is None and not cfg.teacher.path:
        raise UsageError(
            "no teacher to plan",
            fix="pass --teacher PATH, --config wan2.1-14b, or a recipe with teacher.path",
        )
    what_if = any(v is not None for v in (gpus, gpu_mem, cpu_mem, disk))
    if what_if:
        inventory = Inventory.described(gpus=gpus, gpu_mem=gpu_mem, cpu_mem=cpu_mem, disk=disk)
        cfg.teacher.placement.check(len(inventory.gpus))  # cuda:3 on --gpus 2 is an error
    else:
        inventory = Inventory.detect(cfg.teacher.offload_folder or cfg.cache.path)
    # Validated as precompute would (custom code, pickles, bad configs); weights may be absent.
    source = (
        TeacherFolder.published(config)
        if config
        else TeacherFolder.open(cfg.teacher.path, complete=False)
    )
    plan = make_plan(
        source,
        dtype=dtype_from_name(cfg.teacher.dtype),
        sizes=SamplerSizes.from_config(cfg),
        inventory=inventory,
        placement=cfg.teacher.placement,
    )
    if as_json:
        out.print_json(json.dumps(plan.to_json()))
    else:
        for renderable in render_plan(plan):
            out.print(renderable)
        if recipe is not None and not config:
            _show_recording(load_recipe(recipe, sets, stage="precompute"))
    if what_if and plan.auto.placement is None:
        raise too_small(plan)
    if not what_if:
        try:
            cfg.teacher.placement.check(len(inventory.gpus))
        except UsageError as e:
            err.print(f"[yellow]requested placement:[/yellow] {e.message}", highlight=False)


# --------------------------------------------------------------------------- entry point


_PATH_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.EEXIST)
"""OSErrors that mean a path given on the command line is wrong: usage errors (exit 2)."""


def _fail(message: str, code: int, fix: str | None = None) -> None:
    err.print(f"[bold red]error:[/bold red] {escape(message)}", highlight=False, soft_wrap=True)
    if fix:
        err.print(f"  [bold]fix:[/bold] {escape(fix)}", highlight=False, soft_wrap=True)
    sys.exit(code)


@functools.cache
def _command() -> Any:
    """The click command tree, built once: typer rebuilds it on every `app()` call (~0.1 s of
    signature inspection), which in-process callers (tests, the demo) would pay each time."""
    return typer.main.get_command(app)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point; see the module docstring for the exit-code contract."""
    try:
        code = _command()(args=argv, standalone_mode=False)
    except WandistillError as e:
        if _debug:
            raise
        _fail(e.message, e.exit_code, e.fix)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        _fail("interrupted", 130)
    except typer.TyperException as e:  # click usage errors: unknown command, bad option
        show = getattr(e, "show", None)
        if callable(show):
            show()
        else:
            err.print(f"error: {e}", highlight=False, soft_wrap=True)
        sys.exit(int(getattr(e, "exit_code", 2)))
    except KeyboardInterrupt:
        _fail("interrupted; re-run the same command to resume", 130)
    except OSError as e:
        if _debug:
            raise
        if e.errno == errno.ENOSPC:
            _fail(
                f"disk full while writing {e.filename or ''}".strip(),
                1,
                "free space or choose another output directory; re-run to resume",
            )
        if e.errno in _PATH_ERRNOS:  # a path the user gave: unreadable, read-only, not a dir
            _fail(
                f"{e.strerror or e}: {e.filename}" if e.filename else str(e),
                2,
                "check the path and its permissions, or choose another one",
            )
        _fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e), 1)
    except Exception as e:  # a bug: one line and a crash log, not a traceback
        if _debug:
            raise
        _crash(e)
    if isinstance(code, int) and code:
        sys.exit(code)


def _crash(e: Exception) -> None:
    """Write the traceback of an unexpected error to a crash log and say where, in one line."""
    import tempfile
    import traceback

    text = "".join(traceback.format_exception(e))
    first = (str(e).strip().splitlines() or [""])[0][:200]
    what = f"{type(e).__name__}: {first}" if first else type(e).__name__
    rank = os.environ.get("RANK")
    try:
        fd, log = tempfile.mkstemp(
            prefix=f"wandistill-crash-{'' if rank is None else f'rank{rank}-'}", suffix=".log"
        )
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"wandistill {__version__}\nargv: {sys.argv}\n\n{text}")
    except OSError:  # nowhere to write it: show it rather than lose it
        err.print(text, highlight=False, markup=False)
        log = "(shown above)"
    _fail(
        f"internal error ({what}); the traceback is in {log}",
        1,
        "this is a bug in wandistill: please report it with that log (--debug or "
        "WANDISTILL_DEBUG=1 shows the traceback here)",
    )
