"""The `wandistill` command line: parse, build a config, call the room that does the work.

`main()` is the only place that turns exceptions into exit codes: a `WandistillError` prints one
line (and its fix) and exits 2 for usage errors or 1 for runtime failures; `--debug` (or
WANDISTILL_DEBUG=1) shows the traceback instead.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from wandistill import __version__
from wandistill.errors import ConfigError, UsageError, WandistillError

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
app.add_typer(teacher_app, name="teacher")
app.add_typer(cache_app, name="cache")

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
    from wandistill.teacher.tiny import make_tiny_teacher

    with _teacher_target(path):
        made = make_tiny_teacher(path, wan22=wan22, seed=seed, overwrite=overwrite)
    out.print(f"wrote tiny {'Wan 2.2 A14B' if wan22 else 'Wan 2.1'} teacher to {made}")


@teacher_app.command("make-trained")
def teacher_make_trained(
    path: Annotated[Path, typer.Argument(help="Folder to create (diffusers layout).")],
    seed: Annotated[int, typer.Option(help="Seed of the weights, the data and the training.")] = 0,
    steps: Annotated[
        int | None,
        typer.Option(
            help="Optimiser steps (default: the recipe's 800, about 70 s of one core); "
            "fewer for tests."
        ),
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing teacher at PATH.")] = False,
) -> None:
    """Train a tiny Wan teacher on coloured shapes ("a red circle at the top"), ~70 s on a CPU."""
    from wandistill.teacher.trained import make_trained_teacher

    _positive(steps=steps)
    with _teacher_target(path):
        made = make_trained_teacher(path, seed=seed, steps=steps, overwrite=overwrite)
    out.print(f"wrote trained tiny Wan 2.1 teacher to {made}")


@contextlib.contextmanager
def _teacher_target(path: Path) -> Iterator[None]:
    """One line for a PATH under a file or an existing folder, for every teacher builder."""
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UsageError(
            f"cannot create teacher folder {str(path)!r}: {str(blocker)!r} is a file",
            fix="choose another PATH",
        )
    from wandistill.teacher.tiny import NotATeacherError

    try:
        yield
    except NotATeacherError as e:
        raise UsageError(str(e), fix="choose another PATH") from None
    except FileExistsError as e:
        raise UsageError(str(e), fix="pass --overwrite, or choose another PATH") from None


# --------------------------------------------------------------------------- cache


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


@cache_app.command("info")
def cache_info(
    path: Annotated[Path, typer.Argument(help="Cache directory.")],
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
def cache_verify(path: Annotated[Path, typer.Argument(help="Cache directory.")]) -> None:
    """Check every shard's checksum and decode every record; exit 1 if anything is wrong."""
    from wandistill.cache.reader import open_cache

    with open_cache(path) as store:
        problems = store.verify()
        n, shards = len(store), len(store.entries)
    if problems:
        for p in problems:
            err.print(f"[red]BAD[/red] {escape(p)}", highlight=False, soft_wrap=True)
        err.print(f"{len(problems)} problem(s) in cache {path}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    out.print(f"OK: {n} records in {shards} shards of {path} verified", highlight=False)


# --------------------------------------------------------------------------- precompute

RecipeArg = Annotated[
    Path | None, typer.Argument(help="TOML recipe (e.g. pipelines/tiny.toml); flags override it.")
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
    cfg = load_recipe(recipe, sets, stage="precompute").precompute
    if dry_run:
        out.print_json(json.dumps(to_dict(cfg)))
        return
    from wandistill.precompute import run

    s = run(cfg)
    report = Path(s.cache) / "prompts_report.json"
    if report.is_file():  # rank 0 wrote it: what in the prompt file was skipped or truncated
        from wandistill.precompute.prompts import PromptReport

        for line in PromptReport(**json.loads(report.read_text())).summary():
            out.print(line, highlight=False)
    out.print(
        f"cache {s.cache}: {s.records_written} records written, {s.records_skipped} already "
        f"there, {_human(s.bytes_written)} in {s.seconds:.1f} s",
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


# --------------------------------------------------------------------------- eval / sample


def _positive(**values: int | None) -> None:
    """Usage error for a numeric flag that must be positive (None: not given)."""
    for name, v in values.items():
        if v is not None and v <= 0:
            raise UsageError(f"--{name.replace('_', '-')} {v} must be positive")


def _out_dir(path: str | Path, flag: str = "--out") -> None:
    """An output directory that is (or is under) a file is a usage error, named as such."""
    blocker = next(
        (p for p in (Path(path), *Path(path).parents) if p.exists() and not p.is_dir()), None
    )
    if blocker is not None:
        raise UsageError(
            f"{flag} {str(path)!r} cannot be a directory: {str(blocker)!r} is a file",
            fix=f"choose another {flag} directory",
        )


@app.command("eval")
def eval_cmd(
    cache: Annotated[Path, typer.Option(help="Cache with held-out records (or a separate one).")],
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
) -> None:
    """Compare the student's samples with the teacher's cached final latents."""
    from wandistill.eval.run import evaluate

    if split not in ("holdout", "all"):
        raise UsageError(f"--split {split!r} must be holdout or all")
    _positive(steps=steps, max_records=max_records)
    _out_dir(out_dir)
    result = evaluate(
        cache, student, out_dir, teacher=teacher, steps=steps, split=split, max_records=max_records
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
) -> None:
    """Generate images from prompts with the student (or the teacher, for comparison)."""
    from wandistill.config import SamplerConfig
    from wandistill.eval.sample import sample
    from wandistill.precompute.prompts import read_prompts

    try:
        SamplerConfig(
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=steps,
            max_sequence_length=max_sequence_length,
        )
    except ConfigError as e:  # name the flags, not the recipe keys
        raise UsageError(
            e.message.replace("sampler.num_inference_steps", "--steps")
            .replace("sampler.max_sequence_length", "--max-sequence-length")
            .replace("sampler.num_frames", "--num-frames")
            .replace("sampler.", "--")
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
    )
    out.print(f"wrote {len(paths)} images and {out_dir / 'grid.png'}")


@app.command("demo")
def demo_cmd(
    root: Annotated[Path, typer.Option(help="Folder for everything the demo makes.")] = Path(
        "cache/demo"
    ),
    recipe: Annotated[Path, typer.Option(help="Recipe to run.")] = Path("pipelines/tiny.toml"),
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
) -> None:
    """Memory each placement needs per phase and device here, what fits, and auto's pick."""
    from wandistill.config import load_recipe, refuse_custom_code
    from wandistill.teacher.placement import check_placement
    from wandistill.teacher.plan import (
        Inventory,
        SamplerSizes,
        config_folder,
        dtype_from_name,
        make_plan,
        render_plan,
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
    source = config_folder(config) if config else Path(cfg.teacher.path)
    refuse_custom_code(source)  # plan runs no model code, but precompute would refuse it
    inventory = Inventory.detect(cfg.teacher.offload_folder or cfg.cache.path)
    plan = make_plan(
        config or source,
        dtype=dtype_from_name(cfg.teacher.dtype),
        sizes=SamplerSizes.from_config(cfg),
        inventory=inventory,
        placement=cfg.teacher.placement,
        group_offload_level=cfg.teacher.group_offload_level,
        max_memory=cfg.teacher.max_memory or None,
    )
    if as_json:
        out.print_json(json.dumps(plan.to_json()))
        return
    for renderable in render_plan(plan):
        out.print(renderable)
    try:
        check_placement(cfg.teacher.placement, gpus=len(inventory.gpus))
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


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point; see the module docstring for the exit-code contract."""
    try:
        code = app(args=argv, standalone_mode=False)
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
    if isinstance(code, int) and code:
        sys.exit(code)
