"""The `wandistill` command line: parse, build a config, call the room that does the work.

`main()` is the only place that turns exceptions into exit codes: a `WandistillError` prints one
line (and its fix) and exits 2 for usage errors or 1 for runtime failures; any other exception is
a bug: one line naming a crash log (in the temp folder) that holds the traceback, exit 1.
`--debug` (or WANDISTILL_DEBUG=1) shows the traceback instead.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from wandistill import __version__
from wandistill.errors import CacheError, ConfigError, UsageError, WandistillError
from wandistill.io.location import option as loc

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


def choice(flag: str, values: tuple[str, ...]) -> dict[str, Any]:
    """typer.Option arguments for a flag with a fixed set of values: --help shows them as
    [a|b], and a value outside them is one line naming the flag and the values (a wandistill
    UsageError), not click's usage box."""

    def parse(value: str) -> str:
        if value not in values:
            raise UsageError(
                f"{flag} {value!r} must be one of {', '.join(values)}",
                fix=f"pass {flag} {values[0]}",
            )
        return value

    return {"parser": parse, "metavar": f"[{'|'.join(values)}]"}


@app.callback()
def _root(
    debug: Annotated[
        bool, typer.Option("--debug/--no-debug", help="Show tracebacks for errors.")
    ] = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose/--no-verbose",
            "-v",
            help="Show the libraries' progress bars, log messages and warnings (diffusers, "
            "transformers, torch), hidden by default. One process only: refused under torchrun.",
        ),
    ] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    from wandistill.runtime.quiet import configure

    global _debug
    _debug = _debug or debug
    world = os.environ.get("WORLD_SIZE", "1")
    if verbose and world.isdigit() and int(world) > 1:
        raise UsageError(
            f"--verbose under torchrun ({world} ranks): every rank would print the libraries' "
            "progress bars and warnings, interleaved",
            fix="drop -v/--verbose; to see the libraries' output, run the same command as one "
            "process (without torchrun)",
        )
    configure(verbose)


# --------------------------------------------------------------------------- teacher


@teacher_app.command("make-tiny")
def teacher_make_tiny(
    path: Annotated[
        Path, typer.Argument(help="Folder to create (diffusers layout).", **loc("PATH", url=False))
    ],
    wan22: Annotated[
        bool,
        typer.Option(
            "--wan22/--no-wan22",
            help="Wan 2.2 A14B layout (two experts + boundary_ratio) to test the two-expert "
            "path; the default is the one-transformer Wan 2.1 layout.",
        ),
    ] = False,
    seed: Annotated[
        int, typer.Option(help="Seed of the random weights; same seed, same bytes.")
    ] = 0,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite/--no-overwrite", help="Replace an existing tiny teacher at PATH."
        ),
    ] = False,
) -> None:
    """Write a tiny random-weight Wan teacher that WanPipeline loads and runs on CPU."""
    from wandistill.checks.bounds import SEED, flag_problem
    from wandistill.teacher.tiny import make_tiny_teacher

    if (problem := flag_problem("--seed", seed, SEED)) is not None:
        raise UsageError(problem)
    with _teacher_target(path):
        made = make_tiny_teacher(path, wan22=wan22, seed=seed, overwrite=overwrite)
    out.print(f"wrote tiny {'Wan 2.2 A14B' if wan22 else 'Wan 2.1'} teacher to {made}")


@teacher_app.command("make-trained")
def teacher_make_trained(
    path: Annotated[
        Path, typer.Argument(help="Folder to create (diffusers layout).", **loc("PATH", url=False))
    ],
    seed: Annotated[
        int,
        typer.Option(
            help="Seed of the weights, the synthetic data and the training; same seed, same "
            "bytes (on the same torch build and CPU)."
        ),
    ] = 0,
    steps: Annotated[
        int | None,
        typer.Option(
            help="Optimiser steps (default: the recipe's 800, about 70 s of one core); "
            "fewer for tests."
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite/--no-overwrite", help="Replace an existing trained teacher at PATH."
        ),
    ] = False,
) -> None:
    """Train a tiny Wan teacher on coloured shapes, ~70 s on a CPU (the demo's teacher).

    Prompts like "a red circle at the top" give matching patterns: its samples have structure
    and few-step sampling visibly degrades."""
    from wandistill.checks.bounds import SEED, flag_problem
    from wandistill.teacher.trained import make_trained_teacher

    if (problem := flag_problem("--seed", seed, SEED)) is not None:
        raise UsageError(problem)
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
    from wandistill.runtime.progress import human_bytes

    return human_bytes(n)


@cache_app.command("info")
def cache_info(
    path: Annotated[
        str,
        typer.Argument(help="Cache directory or fsspec URL (s3://...).", **loc("PATH", url=True)),
    ],
    as_json: Annotated[
        bool,
        typer.Option(
            "--json/--no-json",
            help="Print the whole manifest as JSON (for scripts) instead of the tables.",
        ),
    ] = False,
    records: Annotated[
        list[int] | None,
        typer.Option(
            "--records",
            help="Project the footprint to N records (repeatable; default: 10,000 and 100,000).",
        ),
    ] = None,
) -> None:
    """Records, bytes, fields, footprint (here and at Wan 480p/720p), settings and shards."""
    from wandistill.cache.files import WdsEntry
    from wandistill.cache.manifest import load_committed, manifest_json

    _positive(records=min(records) if records else None)
    m = load_committed(path)
    if as_json:
        out.print_json(json.dumps(manifest_json(m)))
        return
    head = Table(title=f"cache {path}", show_header=False)
    head.add_row("backend", m.backend)
    head.add_row("complete", str(m.complete))
    head.add_row("records", str(m.num_records))
    head.add_row("shards", str(len(m.shards)))
    head.add_row("bytes", _human(m.num_bytes))
    head.add_row("teacher", m.teacher.fingerprint[:16])
    head.add_row("schema", f"v{m.schema_version} (wandistill {m.wandistill_version})")
    out.print(head)
    fields = Table(title="fields")
    for col in ("name", "dtype", "shape"):
        fields.add_column(col)
    for f in m.fields:
        fields.add_row(f.name, f.dtype, f.shape)
    out.print(fields)
    _print_footprint(path, tuple(records or (10_000, 100_000)))
    settings = Table(title="sampler settings", show_header=False)
    below: dict[str, Any] = {}  # long JSON (the scheduler's config) goes under the table
    for k, v in m.block_json("settings").items():
        text = v if isinstance(v, str) else json.dumps(v)
        if isinstance(v, dict) and len(text) > 40:
            below[k] = v
            settings.add_row(k, "(below)")
        else:
            settings.add_row(k, text)
    out.print(settings)
    for k, v in below.items():
        out.print(f"{k}:", highlight=False)
        out.print_json(json.dumps(v))
    shards = Table(title="shards")
    for col in ("name", "records", "bytes", "sha256"):
        shards.add_column(col)
    for s in m.shards:
        digest = s.frame_sha256 if isinstance(s, WdsEntry) else s.sha256  # type: ignore[attr-defined]
        sha = digest if isinstance(digest, str) else f"{len(digest)} files"
        shards.add_row(s.name, str(s.records), _human(s.bytes), sha[:16])
    out.print(shards)


def _print_footprint(path: Path, records: tuple[int, ...] = (10_000, 100_000)) -> None:
    """Bytes per record per field, here and at real Wan sizes, for this cache's settings."""
    from wandistill.cache.footprint import WAN_SIZES, footprint

    try:
        fp = footprint(path)
    except CacheError as e:  # info still shows the rest; verify names the damage
        err.print(f"footprint: not computed ({e.message})", highlight=False, soft_wrap=True)
        return
    if fp is None:
        return
    table = Table(title=f"footprint per record (projection: {fp.embed_len:.0f}-token prompts)")
    for col in ("field", "stored as", "here", *WAN_SIZES):
        table.add_column(col, justify="left" if col in ("field", "stored as") else "right")
    for name, n in fp.here.items():
        sizes = [_human(fp.projected[k].get(name, 0)) for k in WAN_SIZES]
        table.add_row(name, fp.fields.get(name, "(scale)"), _human(n), *sizes)
    totals = {k: sum(v.values()) for k, v in fp.projected.items()}
    table.add_row("total", "", _human(sum(fp.here.values())), *map(_human, totals.values()))
    for n in records:
        table.add_row(f"x {n:,} records", "", "", *(_human(t * n) for t in totals.values()))
    out.print(table)
    ratio = fp.on_disk / max(1, sum(fp.here.values()))
    out.print(
        f"on disk here: {_human(fp.on_disk)} per record ({ratio:.2f}x the stored tensors: "
        "compression and container overhead; projections are before compression)",
        highlight=False,
    )


@cache_app.command("merge")
def cache_merge(
    inputs: Annotated[
        list[str],
        typer.Argument(
            help="Input caches (2 or more): directories or object-store URLs.",
            **loc("INPUT", url=True),
        ),
    ],
    out_dir: Annotated[
        str,
        typer.Option(
            "--out",
            help="The merged cache (new or empty): a directory or URL.",
            **loc("--out", url=True),
        ),
    ],
    skip_corrupt: Annotated[
        bool,
        typer.Option(
            "--skip-corrupt/--no-skip-corrupt",
            help="Leave out (and count) an input shard that fails verification instead of "
            "refusing the merge.",
        ),
    ] = False,
) -> None:
    """Join finished caches of one teacher and settings into one.

    Every input shard is verified first (checksums of every record); shards are then
    hard-linked where the disk allows, copied by the object store itself where inputs and
    output share one (S3 CopyObject), streamed otherwise; see docs/cache-format.md and
    docs/distributed.md."""
    from wandistill.cache.merge import MergeConfig, merge

    _out_dir(out_dir)
    s = merge(MergeConfig(inputs=tuple(inputs), out=out_dir, skip_corrupt=skip_corrupt))
    if s.corrupt:
        err.print(
            f"--skip-corrupt: left out {len(s.corrupt)} corrupt input shard(s), "
            f"{s.corrupt_records} record(s):",
            highlight=False,
        )
        for line in s.corrupt[:20]:
            err.print(f"  {escape(line)}", highlight=False, soft_wrap=True)
    if s.unchanged:
        out.print(
            f"{out_dir} already is this merge ({s.records} records); nothing to do",
            highlight=False,
            soft_wrap=True,
        )
        return
    out.print(
        f"merged {s.records} records ({' + '.join(map(str, s.per_input))}) into {s.shards} "
        f"shards of {out_dir}: {s.linked} hard-linked, "
        + (f"{s.server_copied} copied by the object store, " if s.server_copied else "")
        + f"{s.copied} copied, {s.rewritten} re-written; {s.duplicates} duplicate record(s) "
        "dropped (first input kept)",
        highlight=False,
        soft_wrap=True,
    )


@cache_app.command("verify")
def cache_verify(
    path: Annotated[
        str,
        typer.Argument(help="Cache directory or fsspec URL (s3://...).", **loc("PATH", url=True)),
    ],
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
        Path | None,
        typer.Argument(
            help="File or folder to write (default: ./NAME.toml).", **loc("DEST", url=False)
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force/--no-force", help="Replace an existing DEST file.")
    ] = False,
) -> None:
    """Copy a shipped recipe out for editing; commands take the copy's path as their RECIPE."""
    from wandistill.config import shipped_recipe
    from wandistill.io.fsutil import atomic_write_bytes

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
        help="A recipe: a path has a slash or ends in .toml (./my.toml); a name has "
        "neither and is a shipped recipe (tiny; `wandistill recipes`). Flags override it."
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="Override any recipe key: section.key=value, value in TOML (repeatable; applied "
        "before the flags above).",
        show_default="none",
    ),
]
DryRunOpt = Annotated[
    bool,
    typer.Option(
        "--dry-run/--no-dry-run", help="Print the resolved config and stop; nothing is written."
    ),
]


def _flag_sets(flags: dict[str, Any]) -> list[str]:
    """The flags given, as `--set key=value` overrides (a parsed location as its text)."""
    return [
        f"{k}={json.dumps(str(v) if isinstance(v, Path) else v)}"
        for k, v in flags.items()
        if v is not None
    ]


def _recipe_key(key: str, fallback: str | None = None) -> str:
    """How --help shows the default of a flag that overrides a recipe key (and the value when
    the recipe leaves the key out)."""
    return f"recipe's {key}" + (f", else {fallback}" if fallback else "")


DTYPES = ("fp32", "fp16", "bf16")
PLACEMENT_HELP = (
    "Where the teacher's weights live: auto (the plan's pick: start here), cpu, cuda or cuda:N "
    "(fits one GPU: fastest), gpu0, balanced / balanced_low_0 / sequential (split over GPUs), "
    "model-offload / group-offload (GPU too small: weights in RAM), disk-offload (RAM too small "
    "too: slowest), or a device-map .json. `wandistill plan` shows what each needs; see "
    "docs/placement.md."
)


@app.command("precompute")
def precompute_cmd(
    recipe: RecipeArg = None,
    teacher: Annotated[
        str | None,
        typer.Option(
            help="Local diffusers Wan folder (model_index.json at its root).",
            **loc("--teacher", url=False),
            show_default=_recipe_key("teacher.path"),
        ),
    ] = None,
    prompts: Annotated[
        str | None,
        typer.Option(
            help='Prompt file: .txt (one per line) or .jsonl ({"prompt": ...} per line).',
            **loc("--prompts", url=False),
            show_default=_recipe_key("prompts"),
        ),
    ] = None,
    out_dir: Annotated[
        str | None,
        typer.Option(
            "--out",
            help="Cache directory or fsspec URL (s3://bucket/prefix) to write; re-running "
            "resumes it.",
            **loc("--out", url=True),
            show_default=_recipe_key("cache.path"),
        ),
    ] = None,
    backend: Annotated[
        str | None,
        typer.Option(
            **choice("--backend", ("webdataset", "zarr")),
            help="Cache format: webdataset (tar shards: stream from disk or object storage, "
            "copy with any tool) or zarr (v3 arrays: read one record or one field without "
            "its shard). Training reads both alike.",
            show_default=_recipe_key("cache.backend", "webdataset"),
        ),
    ] = None,
    placement: Annotated[
        str | None,
        typer.Option(
            help=PLACEMENT_HELP,
            show_default=_recipe_key("teacher.placement", "auto"),
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            **choice("--dtype", DTYPES),
            help="Teacher compute dtype: bf16 on recent GPUs (half the memory of fp32), fp16 "
            "on older ones, fp32 on CPU or to compare exactly.",
            show_default=_recipe_key("teacher.dtype", "fp32"),
        ),
    ] = None,
    part: Annotated[
        str | None,
        typer.Option(
            help="I/N: compute only part I (0-based) of N disjoint slices of the prompt list "
            "(batches I, I+N, ...) into OUT/part-IIIII-of-NNNNN, a cache of its own; re-run a "
            "part to resume it. Default: SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN of "
            "SLURM_ARRAY_TASK_COUNT when set; --part wins over them; --part all: the whole "
            "list (see docs/distributed.md).",
            show_default="the whole list",
        ),
    ] = None,
    overrides: SetOpt = None,
    dry_run: DryRunOpt = False,
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
        *_flag_sets(flags),
    ]
    full = load_recipe(recipe, sets, stage="precompute")
    cfg = full.precompute
    from wandistill.precompute import parts

    job_part = parts.resolve(part, os.environ)
    if dry_run:
        out.print_json(json.dumps(to_dict(cfg)))
        _show_recording(full)
        return
    from wandistill.precompute.entry import launch

    s = launch(cfg, part=job_part)
    from wandistill.io.storage import open_storage
    from wandistill.precompute.run import REPORT_NAME

    cache = open_storage(s.cache)
    if cache.exists(REPORT_NAME):  # rank 0 wrote it: what in the prompt file was skipped or cut
        from wandistill.precompute.prompts import PromptReport

        text = cache.read(REPORT_NAME, max_bytes=1 << 26, what="report", fix="", error=UsageError)
        for line in PromptReport(**json.loads(text)).summary():
            out.print(line, highlight=False)
    for line in s.lines() if s.is_main else ():  # one summary for the whole job
        out.print(line, highlight=False, soft_wrap=True)


# --------------------------------------------------------------------------- train


@app.command("train")
def train_cmd(
    recipe: RecipeArg = None,
    cache: Annotated[
        list[str] | None,
        typer.Option(
            help="Cache directory or fsspec URL (precompute --out). Repeat it to train on several "
            "caches of one teacher and settings as one dataset (weights: --set "
            "'train.cache_weights=[2, 1]').",
            show_default=_recipe_key("cache"),
            **loc("--cache", url=True),
        ),
    ] = None,
    out_dir: Annotated[
        str | None,
        typer.Option(
            "--out",
            help="Run directory to write (run.json, metrics.jsonl, loss.png, checkpoints/, "
            "student/); a local (or mounted) folder.",
            **loc("--out", url=False),
            show_default=_recipe_key("out"),
        ),
    ] = None,
    steps: Annotated[
        int | None,
        typer.Option(
            help="Total optimizer steps of the run: --resume trains up to it, not that many "
            "more (at 100 steps, --steps 150 --resume trains 50).",
            show_default=_recipe_key("steps"),
        ),
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume/--no-resume",
            help="Continue from the newest checkpoint in --out up to --steps in total (after "
            "a crash, a stop or to train longer: raise --steps); without it a run folder with "
            "checkpoints is refused.",
        ),
    ] = False,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow/--no-follow",
            help="Train on a cache precompute is still writing, waiting for new shards until "
            "it is complete (it stops, saying so, if nothing writes the cache any more); "
            "without it an incomplete cache is trained on as it stands, with a warning.",
        ),
    ] = False,
    skip_corrupt: Annotated[
        bool,
        typer.Option(
            "--skip-corrupt/--no-skip-corrupt",
            help="Skip (and count) unreadable records instead of stopping at the first one; "
            "use it to finish a run on a damaged cache, then `cache verify` it.",
        ),
    ] = False,
    parallel: Annotated[
        str | None,
        typer.Option(
            help="ddp (each rank holds the whole student) or fsdp (FSDP2: the student, its "
            "gradients, optimizer state and EMA sharded over the ranks; sharded checkpoints).",
            show_default=_recipe_key("parallel"),
        ),
    ] = None,
    overrides: SetOpt = None,
    dry_run: DryRunOpt = False,
) -> None:
    """Distil the cached teacher into a small student (alone or under torchrun)."""
    from wandistill.config import load_recipe, to_dict

    listed = [str(c) for c in cache] if cache else None
    one_or_many = listed[0] if listed and len(listed) == 1 else listed  # several: a list
    flags = {"cache": one_or_many, "out": out_dir, "steps": steps, "parallel": parallel}
    sets = [
        *(overrides or []),
        *_flag_sets(flags),
    ]
    cfg = load_recipe(recipe, sets, stage="train").train
    if cfg.out:
        _out_dir(cfg.out)
    if dry_run:
        out.print_json(json.dumps(to_dict(cfg)))
        try:
            _plan_train(recipe, None, None, sets, False, (None, None, None, None))
        except UsageError as e:  # the plan needs the student's sizes; the dry run goes on
            err.print(f"train memory plan: {e.message} ({e.fix})", highlight=False)
        if not cfg.cache:
            out.print("(pass --cache to see which recorded steps each objective trains at)")
            return
        from wandistill.train.loop import objective_plan

        for line in objective_plan(cfg).describe():
            out.print(line, highlight=False, soft_wrap=True)
        return
    from wandistill.train.entry import finished_at, launch

    if resume and cfg.out and (at := finished_at(cfg)) is not None:
        if os.environ.get("RANK", "0") == "0":
            out.print(
                f"train: already at {at} steps; pass --steps {at + max(cfg.steps, 1)} to "
                f"continue (--steps is the run's total, here {cfg.steps})",
                highlight=False,
            )
        return

    r = launch(cfg, resume=resume, follow=follow, skip_corrupt=skip_corrupt)
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
    for line in r.lines():
        out.print(line, highlight=False, soft_wrap=True)


@app.command(
    "launch",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    options_metavar="[TORCHRUN FLAGS] {precompute|train} [ARGS]...",
)
def launch_cmd(ctx: typer.Context) -> None:
    """Run precompute or train as a torchrun job, ending with a rank's own error, no traceback.

    `wandistill launch [TORCHRUN FLAGS] COMMAND ...` is `torchrun [TORCHRUN FLAGS] -m wandistill
    COMMAND ...` with the same flags (e.g. --standalone --nproc_per_node=2), except that a
    rank's refusal ends the job with that rank's one error line and exit code, without
    torchrun's ChildFailedError traceback."""
    from wandistill.runtime.launch import launch

    launch(ctx.args, verbose=bool(ctx.find_root().params.get("verbose")))


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
    out.print(f"precompute records {len(steps)} of {n} steps: {steps}", highlight=False)
    schedule = TeacherSchedule.from_scheduler(teacher.scheduler, n, steps, teacher.boundary_ratio)
    try:
        k = recipe.train.student.num_inference_steps
        plan = plan_objectives(recipe.train.loss, k, schedule)
    except UsageError as e:
        err.print(
            f"[yellow]train on this cache:[/yellow] {escape(e.message)}"
            + (f" (fix: {escape(e.fix)})" if e.fix else ""),
            highlight=False,
        )
        return
    for line in plan.describe():  # wrapped at the terminal's width, at word boundaries
        out.print(line, highlight=False)


# --------------------------------------------------------------------------- eval / sample


def _positive(**values: int | None) -> None:
    """Usage error for a numeric flag that must be positive (None: not given)."""
    for name, v in values.items():
        if v is not None and v <= 0:
            raise UsageError(f"--{name.replace('_', '-')} {v} must be positive")


def _out_dir(path: str | Path, flag: str = "--out") -> None:
    """An output directory that is (or is under) a file is a usage error, named as such."""
    from wandistill.io.storage import is_url

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


RunOpt = Annotated[
    Path | None,
    typer.Option(
        "--run",
        **loc("--run", url=False),
        help="The --out folder of a finished `wandistill train`: its student, K-step scheduler "
        "and the cache it learned from (for sizes). Pick it for a run you have not exported. "
        "One of --run, --export, --student (default: none; eval needs one, sample without "
        "one samples the teacher).",
    ),
]
ExportOpt = Annotated[
    Path | None,
    typer.Option(
        "--export",
        **loc("--export", url=False),
        help="A folder written by `wandistill export` (a complete WanPipeline): pick it to test "
        "exactly what users will load. One of --run, --export, --student (default: none).",
    ),
]
StudentOpt = Annotated[
    Path | None,
    typer.Option(
        "--student",
        **loc("--student", url=False),
        help="A finished run's student/ or student_ema/ folder (its run's sampling.json gives K): "
        "the same as --run with --no-ema / --ema, named by folder. One of --run, --export, "
        "--student (default: none).",
    ),
]
EmaOpt = Annotated[
    bool,
    typer.Option(
        "--ema/--no-ema",
        help="With --run: the EMA weights (smoother, usually better; what export ships) or the "
        "raw weights of the last step (to compare, or for very short runs).",
    ),
]
DeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        help="auto | cpu | cuda | cuda:N. auto: a GPU if the models fit one, else the CPU; cuda:N "
        "to pick a GPU. Loaded with the placement machinery precompute uses.",
    ),
]
_SAMPLE_DEFAULT = (
    "Default: a student's own (its cache's, recorded in sampling.json); the teacher alone: "
    "--cache's / --recipe's, else WanPipeline's"
)


@app.command("eval")
def eval_cmd(
    cache: Annotated[
        str,
        typer.Option(
            help="The cache the student was trained from (its held-out records are scored) or a "
            "separate cache of the same teacher (with --split all); a folder or an fsspec URL.",
            **loc("--cache", url=True),
        ),
    ],
    out_dir: Annotated[
        Path,
        typer.Option(
            "--out",
            help="New folder for eval.md, eval.json and grid.png.",
            **loc("--out", url=False),
        ),
    ],
    run: RunOpt = None,
    export: ExportOpt = None,
    student: StudentOpt = None,
    ema: EmaOpt = True,
    teacher: Annotated[
        Path | None,
        typer.Option(
            **loc("--teacher", url=False),
            help="The cache's teacher folder: adds teacher@K (the teacher itself at K steps, with "
            "its CFG), the column R_K compares with. Default: none (no R_K).",
        ),
    ] = None,
    baseline: Annotated[
        Path | None,
        typer.Option(
            **loc("--baseline", url=False),
            help="Run folder of a step-imitating student (train with loss.output only): adds "
            "baseline@K and baseline@N, to show what few-step training buys. Default: none.",
        ),
    ] = None,
    steps: Annotated[
        int | None,
        typer.Option(
            help="Sampler steps K, 1..the student's K. Default: the student's own K (fewer: to "
            "see how it degrades)."
        ),
    ] = None,
    split: Annotated[
        str,
        typer.Option(
            help="holdout: the records cache.holdout_fraction kept out of training (the "
            "student's own cache); all: every record (a separate eval cache)."
        ),
    ] = "holdout",
    max_records: Annotated[
        int | None,
        typer.Option(help="Score at most N records (>= 1) for a quick look. Default: all."),
    ] = None,
    batch_size: Annotated[
        int,
        typer.Option(help="Records per pipeline call (>= 1): lower it if memory runs out."),
    ] = 8,
    decode: Annotated[
        bool,
        typer.Option(
            "--decode/--no-decode",
            help="Grid of VAE-decoded frames and image PSNR (needs --teacher; slower), or of "
            "latents.",
        ),
    ] = False,
    device: DeviceOpt = "cpu",
) -> None:
    """Score the K-step student against the teacher on held-out records (R_K).

    The student at K steps vs the teacher's N-step result, beside the teacher itself at K steps
    and a step-imitating baseline: a table (R_K), JSON and a PNG grid."""
    from wandistill.eval.run import evaluate
    from wandistill.student.folders import open_student, read_run
    from wandistill.teacher.folder import TeacherFolder

    if split not in ("holdout", "all"):
        raise UsageError(f"--split {split!r} must be holdout or all")
    _positive(steps=steps, max_records=max_records, batch_size=batch_size)
    _check_sampler_flags(num_inference_steps=steps)
    where = _device(device)
    _out_dir(out_dir)
    folder = TeacherFolder.open(teacher) if teacher is not None else None
    chosen = open_student(run=run, export=export, student=student, ema=ema)
    assert chosen is not None  # required=True
    base = read_run(baseline, ema=ema, flag="--baseline") if baseline is not None else None
    result = evaluate(
        cache,
        chosen,
        out_dir,
        teacher=folder,
        baseline=base,
        steps=steps,
        split=split,
        max_records=max_records,
        batch_size=batch_size,
        decode=decode,
        device=where,
        warn=_warn,
    )
    out.print(result.console_table(), highlight=False)  # cells wrap to the terminal
    out.print(
        f"wrote {out_dir / 'eval.md'}, {out_dir / 'eval.json'}, {result.grid}",
        highlight=False,
        soft_wrap=True,
    )


def _device(text: str) -> Any:
    """eval / sample `--device`, parsed and checked against this machine here, so a refusal
    names --device (the placement's own check would name --placement, which these commands
    do not have)."""
    import torch

    from wandistill.placement.parse import parse_device

    where = parse_device(text)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        where.check(gpus)
    except UsageError as e:
        why = e.message.split(";")[0].replace("placement", "--device", 1)
        raise UsageError(
            f"{why} (this machine has {gpus} visible GPU(s))",
            fix="pass --device cpu, or --device auto (a GPU when one is visible)",
        ) from None
    return where


def _warn(message: str) -> None:
    err.print(f"[yellow]warning:[/yellow] {escape(message)}", highlight=False, soft_wrap=True)


def _check_sampler_flags(**given: float | None) -> None:
    """The sampler flags given, checked as a recipe's [precompute.sampler] is: the recipe's
    ranges (finite, in range) through the same config class, named as flags."""
    from wandistill.config import SamplerConfig

    values = {k: v for k, v in given.items() if v is not None}
    try:
        SamplerConfig(**values)
    except ConfigError as e:  # name the flags, not the recipe keys
        flags = {"num_inference_steps": "steps"}
        raise UsageError(
            re.sub(
                r"sampler\.(\w+)",
                lambda m: "--" + flags.get(m[1], m[1]).replace("_", "-"),
                e.message,
            )
        ) from None


@app.command("sample")
def sample_cmd(
    prompts: Annotated[
        Path,
        typer.Option(
            help="Prompt file: .txt (one per line) or .jsonl.", **loc("--prompts", url=False)
        ),
    ],
    out_dir: Annotated[
        Path,
        typer.Option(
            "--out",
            help="New folder for NNNN.png (frame 0) and grid.png.",
            **loc("--out", url=False),
        ),
    ],
    export: ExportOpt = None,
    run: RunOpt = None,
    student: StudentOpt = None,
    ema: EmaOpt = True,
    teacher: Annotated[
        Path | None,
        typer.Option(
            **loc("--teacher", url=False),
            help="Teacher folder. With --run/--student: its tokenizer, text encoder and VAE "
            "(the run's teacher). Alone: the teacher itself is sampled, to compare. Default: "
            "none (an --export brings its own).",
        ),
    ] = None,
    cache: Annotated[
        str | None,
        typer.Option(
            **loc("--cache", url=True),
            help="Teacher alone: take steps, sizes and CFG from this cache's settings (what the "
            "student learned from). Default: none.",
        ),
    ] = None,
    recipe: Annotated[
        str | None,
        typer.Option(
            help="Teacher alone: take them from this recipe's \\[precompute.sampler] (file or "
            "shipped name). Without --cache or --recipe: WanPipeline's own defaults."
        ),
    ] = None,
    steps: Annotated[
        int | None,
        typer.Option(
            help="Sampler steps >= 1. Default: a student's K (it takes at most K); the teacher "
            "alone: --cache's / --recipe's N, else WanPipeline's."
        ),
    ] = None,
    height: Annotated[
        int | None, typer.Option(help=f"Pixels, a multiple of 16. {_SAMPLE_DEFAULT}.")
    ] = None,
    width: Annotated[
        int | None, typer.Option(help=f"Pixels, a multiple of 16. {_SAMPLE_DEFAULT}.")
    ] = None,
    num_frames: Annotated[
        int | None, typer.Option(help=f"4k + 1 (1: an image). {_SAMPLE_DEFAULT}.")
    ] = None,
    guidance_scale: Annotated[
        float | None,
        typer.Option(
            help="Teacher only (> 1: CFG, two forwards per step; 1: none). Default: --cache's / "
            "--recipe's, else WanPipeline's. A student always samples with 1.0."
        ),
    ] = None,
    seed: Annotated[
        int, typer.Option(help="Prompt i draws its noise from SEED + i (0..2^63-1).")
    ] = 0,
    max_sequence_length: Annotated[
        int | None,
        typer.Option(help=f"Text padding length >= 1; keep it the cache's. {_SAMPLE_DEFAULT}."),
    ] = None,
    limit: Annotated[
        int, typer.Option(help="Sample the first N prompts of the file (>= 1); the rest are left.")
    ] = 16,
    device: DeviceOpt = "cpu",
) -> None:
    """Images from prompts through WanPipeline, from a student or the teacher.

    An exported student (--export), a run's student with its teacher's text encoder and VAE
    (--run + --teacher), or the teacher itself."""
    from wandistill.eval.sample import SampleOptions, sample
    from wandistill.precompute.prompts import read_prompts
    from wandistill.student.folders import open_student
    from wandistill.teacher.folder import TeacherFolder

    _positive(limit=limit)
    _check_sampler_flags(
        num_inference_steps=steps,
        height=height,
        width=width,
        num_frames=num_frames,
        max_sequence_length=max_sequence_length,
        guidance_scale=guidance_scale,
        seed=seed,
    )
    where = _device(device)
    _out_dir(out_dir)
    folder = TeacherFolder.open(teacher) if teacher is not None else None
    chosen = open_student(run=run, export=export, student=student, ema=ema, required=False)
    sizes, n = _teacher_defaults(cache, recipe, student=chosen is not None)
    options = SampleOptions(
        steps=steps,
        guidance_scale=guidance_scale,
        height=height,
        width=width,
        num_frames=num_frames,
        max_sequence_length=max_sequence_length,
        seed=seed,
    )
    items, _ = read_prompts(prompts)
    paths = sample(
        [p.text for p in items[:limit]],
        out_dir,
        student=chosen,
        teacher=folder,
        sizes=sizes,
        teacher_steps=n,
        options=options,
        device=where,
    )
    why = f" (--limit {limit}; pass --limit {len(items)} for all)" if len(items) > limit else ""
    out.print(
        f"wrote {len(paths)} images for {len(paths)} of {len(items)} prompts{why} and "
        f"{out_dir / 'grid.png'}",
        highlight=False,
    )


def _teacher_defaults(
    cache: str | Path | None, recipe: str | None, *, student: bool
) -> tuple[Any, int | None]:
    """sample's teacher-alone defaults: (sampler sizes, N) from --cache or --recipe."""
    from wandistill.student.folders import sizes_from_settings

    if cache is not None and recipe is not None:
        raise UsageError("--cache and --recipe both given", fix="pass one of them")
    if student and (cache is not None or recipe is not None):
        flag = "--cache" if cache is not None else "--recipe"
        raise UsageError(
            f"{flag} sets the teacher's defaults; a student samples with those it was "
            "distilled for",
            fix=f"leave {flag} out, or pass a flag (--height, ...) to change one",
        )
    if cache is not None:
        from wandistill.cache.manifest import load_committed

        settings = load_committed(cache).settings
        return sizes_from_settings(settings), settings.num_inference_steps
    if recipe is not None:
        from wandistill.cache.files import SettingsBlock
        from wandistill.config import load_recipe

        sampler = load_recipe(recipe, stage="precompute").precompute.sampler
        sizes = ("height", "width", "num_frames", "max_sequence_length", "guidance_scale")
        settings = SettingsBlock.model_validate({k: getattr(sampler, k) for k in sizes})
        return sizes_from_settings(settings), sampler.num_inference_steps
    return None, None


@app.command("demo")
def demo_cmd(
    root: Annotated[
        Path,
        typer.Option(
            **loc("--root", url=False),
            help="Folder for everything the demo makes (relative: to the cwd); a re-run reuses "
            "what is there.",
        ),
    ] = Path("cache/demo"),
    recipe: Annotated[
        str,
        typer.Option(
            help="Recipe: a path (a slash or .toml) or a shipped name (`wandistill recipes`); "
            "its paths are set under "
            "--root. tiny-fewstep: a 4-step student of the trained tiny teacher."
        ),
    ] = "tiny-fewstep",
    overrides: SetOpt = None,
    baseline: Annotated[
        bool,
        typer.Option(
            "--baseline/--no-baseline",
            help="Also train a step-imitating student for the baseline columns (--no-baseline: "
            "about half the training time).",
        ),
    ] = True,
    teacher: Annotated[
        Path | None,
        typer.Option(
            **loc("--teacher", url=False),
            help="A Wan teacher folder to distil instead. Default: the trained tiny teacher, "
            "built under --root on first use (about a minute).",
        ),
    ] = None,
) -> None:
    """The whole job on a tiny teacher, offline: cache, a 4-step student, its evaluation.

    Trained tiny teacher -> precompute (16 steps, CFG) -> a 4-step student -> eval against the
    teacher at 4 steps; prints the table, writes grid.png, loss.png and metrics.png."""
    from wandistill.demo import run_demo, short_path

    result = run_demo(root, recipe, overrides, baseline=baseline, teacher=teacher)
    out.print()
    out.print(result.eval.console_table(), highlight=False)
    from wandistill.runtime.progress import summary_lines

    total = sum(result.seconds.values())
    stages = [f"{k} {v:.0f} s" for k, v in result.seconds.items()]
    stages = [*(f"{x}," for x in stages[:-1]), *stages[-1:]]
    lines = [
        "",
        *summary_lines(["wall time:", *stages, f"({total:.0f} s in all)"]),
        f"grid ({' | '.join(c.name for c in result.eval.columns)}):",
        f"  {result.grid}",
        f"loss curve: {result.loss_plot}",
        f"metrics: {result.metrics_plot}",
        "export it:",
        f"  wandistill export --run {short_path(result.root / 'run')} \\",
        f"    --teacher {short_path(result.teacher)} \\",
        f"    --out {short_path(result.root / 'pipeline')}",
    ]
    for line in lines:
        out.print(line, highlight=False, soft_wrap=True)


@app.command("export")
def export_cmd(
    run: Annotated[
        Path,
        typer.Option(
            "--run",
            help="The --out folder of a finished `wandistill train`.",
            **loc("--run", url=False),
        ),
    ],
    teacher: Annotated[
        Path,
        typer.Option(
            **loc("--teacher", url=False),
            help="The run's teacher folder: its tokenizer, text encoder and VAE go into the "
            "pipeline (checked to be those the run's cache was made with).",
        ),
    ],
    out_dir: Annotated[
        Path,
        typer.Option(
            "--out",
            help="New (or empty, or an earlier export's) folder for the WanPipeline.",
            **loc("--out", url=False),
        ),
    ],
    ema: Annotated[
        bool,
        typer.Option(
            "--ema/--no-ema",
            help="The EMA weights (smoother, usually better) or the raw weights of the last step.",
        ),
    ] = True,
    copy: Annotated[
        bool,
        typer.Option(
            "--copy/--no-copy",
            help="Copy the teacher's components (a self-contained folder to ship or move) or "
            "symlink them (no extra disk; the teacher folder must stay).",
        ),
    ] = False,
    merge_lora: Annotated[
        bool,
        typer.Option(
            "--merge-lora/--no-merge-lora",
            help="A LoRA run: write the WanPipeline with the adapter merged into the teacher's "
            "transformer, instead of the LoRA file for the teacher folder (default: the file).",
        ),
    ] = False,
) -> None:
    """Write a WanPipeline folder that stock diffusers loads and runs in K steps.

    The student, its K-step scheduler, the teacher's tokenizer, text encoder and VAE. A LoRA
    run writes its LoRA file for the teacher folder (and the K-step scheduler) unless
    --merge-lora."""
    from wandistill.student.export import export
    from wandistill.teacher.folder import TeacherFolder

    _out_dir(out_dir)
    r = export(run, TeacherFolder.open(teacher), out_dir, ema=ema, copy=copy, merge_lora=merge_lora)
    if r.lora:
        usage = "\n".join(f"  {line}" for line in r.usage.splitlines())
        out.print(
            f"exported the LoRA {r.weights} to {r.out}; use it as\n{usage}",
            highlight=False,
            soft_wrap=True,
        )
        return
    how = "linked" if r.linked else "copied"
    out.print(
        f"exported {r.weights} to {r.out} (tokenizer, text encoder, VAE {how}); use it as\n"
        f"  WanPipeline.from_pretrained({str(r.out)!r})(prompt, "
        f"num_inference_steps={r.num_inference_steps}, guidance_scale=1.0)",
        highlight=False,
        soft_wrap=True,
    )


# --------------------------------------------------------------------------- plan

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


@app.command("plan")
def plan_cmd(
    recipe: RecipeArg = None,
    teacher: Annotated[
        str | None,
        typer.Option(
            **loc("--teacher", url=False),
            help="Local diffusers Wan folder; sizes come from its safetensors headers, so its "
            "weights need not be downloaded yet.",
            show_default=_recipe_key("teacher.path"),
        ),
    ] = None,
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            metavar="NAME",  # checked, with its fix, by the loader
            help="A published teacher's shipped configs, no folder at all: to size a machine "
            f"before downloading ({', '.join(TEACHER_CONFIGS)}). Not with --teacher.",
            show_default="none",
        ),
    ] = None,
    placement: Annotated[
        str | None,
        typer.Option(
            help="Placement to check (the plan lists them all). " + PLACEMENT_HELP,
            show_default=_recipe_key("teacher.placement", "auto"),
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            **choice("--dtype", DTYPES),
            help="Teacher compute dtype to size for: bf16 halves fp32's weight memory.",
            show_default=_recipe_key("teacher.dtype", "fp32"),
        ),
    ] = None,
    overrides: SetOpt = None,
    as_json: Annotated[
        bool,
        typer.Option("--json/--no-json", help="Print the plan as JSON (for scripts)."),
    ] = False,
    gpus: Annotated[
        int | None,
        typer.Option(
            "--gpus",
            help=f"What-if: plan for a machine with N GPUs, 0..{MAX_GPUS} (with --gpu-mem) "
            "instead of this one.",
            show_default="this machine's",
        ),
    ] = None,
    gpu_mem: Annotated[
        str | None,
        typer.Option(
            "--gpu-mem",
            help=f"What-if: memory of each GPU (80GiB, 80GB), at most {MAX_SIZES['--gpu-mem']}.",
            show_default="this machine's",
        ),
    ] = None,
    cpu_mem: Annotated[
        str | None,
        typer.Option(
            "--cpu-mem",
            help=f"What-if: RAM (512GiB), at most {MAX_SIZES['--cpu-mem']}.",
            show_default="this machine's",
        ),
    ] = None,
    disk: Annotated[
        str | None,
        typer.Option(
            "--disk",
            help=f"What-if: free disk for disk-offload, at most {MAX_SIZES['--disk']}.",
            show_default="1TiB in a what-if, else the free space of the offload folder",
        ),
    ] = None,
    train: Annotated[
        bool,
        typer.Option(
            "--train/--no-train",
            help="Plan `train` instead: per-rank weights, gradients, AdamW, EMA and activations "
            "of the recipe's student for DDP / FSDP / checkpointing / LoRA / batch, and which fit.",
        ),
    ] = False,
) -> None:
    """Memory each placement needs, what fits, and which one auto picks (or, --train, training's).

    Per phase and device, on this machine or on one described with --gpus, --gpu-mem,
    --cpu-mem and --disk; nothing is loaded. A recipe named for a machine (`*_1x80gb`) is planned
    for that machine where this one has no GPU. --train: per-rank weights, gradients, AdamW, EMA
    and activations of the recipe's student for DDP / FSDP / checkpointing / LoRA / batch."""
    _machine_bounds(gpus, {"--gpu-mem": gpu_mem, "--cpu-mem": cpu_mem, "--disk": disk})
    from wandistill.config import load_recipe
    from wandistill.placement.estimate import SamplerSizes, dtype_from_name
    from wandistill.placement.inventory import Inventory
    from wandistill.placement.plan import make_plan, too_small
    from wandistill.placement.render import render_plan
    from wandistill.placement.train_inputs import machine_for
    from wandistill.teacher.folder import TeacherFolder

    if teacher and config:
        raise UsageError("--teacher and --config both given", fix="pass one of them")
    if train:
        _plan_train(recipe, teacher, config, overrides, as_json, (gpus, gpu_mem, cpu_mem, disk))
        return
    flags = {"teacher.path": teacher, "teacher.placement": placement, "teacher.dtype": dtype}
    sets = [
        *(overrides or []),
        *_flag_sets(flags),
    ]
    full = load_recipe(recipe, sets, stage="precompute")
    cfg = full.precompute
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
        inventory, line = machine_for(
            full, recipe, inventory, gpus_needed=cfg.teacher.placement.needs_cuda
        )
        if line:
            err.print(f"[yellow]note:[/yellow] {escape(line)}", highlight=False)
            what_if = True
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


def _plan_train(
    recipe: str | None,
    teacher: str | None,
    config: str | None,
    overrides: list[str] | None,
    as_json: bool,
    machine: tuple[int | None, str | None, str | None, str | None],
) -> None:
    """`plan --train`: the student's memory per rank for each way to train it."""
    from wandistill.config import load_recipe
    from wandistill.placement.inventory import Inventory
    from wandistill.placement.train_inputs import machine_for, train_inputs
    from wandistill.placement.train_plan import choice_of, make_train_plan, render_train_plan

    full = load_recipe(recipe, overrides or [], stage="train")
    gpus, gpu_mem, cpu_mem, disk = machine
    if any(v is not None for v in machine):
        inventory = Inventory.described(gpus=gpus, gpu_mem=gpu_mem, cpu_mem=cpu_mem, disk=disk)
    else:
        here = Inventory.detect(full.train.out or ".")
        wants_gpu = full.train.device != "cpu"
        inventory, line = machine_for(full, recipe, here, gpus_needed=wants_gpu)
        if line:
            err.print(f"[yellow]note:[/yellow] {escape(line)}", highlight=False)
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


# --------------------------------------------------------------------------- entry point


_PATH_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.EEXIST)
"""OSErrors that mean a path given on the command line is wrong: usage errors (exit 2)."""


_NO_FIX = "see `wandistill COMMAND --help` and docs/troubleshooting.md"
"""The fix line of an error raised without one: every error has an `error:` and a `fix:`."""


def _fail(message: str, code: int, fix: str | None = None) -> None:
    err.print(f"[bold red]error:[/bold red] {escape(message)}", highlight=False, soft_wrap=True)
    err.print(f"  [bold]fix:[/bold] {escape(fix or _NO_FIX)}", highlight=False, soft_wrap=True)
    sys.exit(code)


@functools.cache
def _command() -> Any:
    """The click command tree, built once: typer rebuilds it on every `app()` call (~0.1 s of
    signature inspection), which in-process callers (tests, the demo) would pay each time."""
    from wandistill.runtime.workarounds import hide_flag_types

    return hide_flag_types(typer.main.get_command(app))


def _stopped(e: WandistillError) -> bool:
    """A `failures.Stopped` (checked without importing torch, which failures needs: only a
    stage that imported it can raise one)."""
    failures = sys.modules.get("wandistill.runtime.failures")
    return failures is not None and isinstance(e, failures.Stopped)


def _rerun(argv: list[str], add: str = "") -> str:
    """The command that was run, exactly, plus `add` (an interruption hint names it)."""
    import shlex

    args = [*argv, add] if add and add not in argv else list(argv)
    world = os.environ.get("WORLD_SIZE", "1")
    launcher = "torchrun (the same launch flags) -m wandistill" if world != "1" else "wandistill"
    launcher = os.environ.get("WANDISTILL_LAUNCH", launcher)  # `wandistill launch ...` as typed
    return f"{launcher} {shlex.join(args)}"


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point; see the module docstring for the exit-code contract."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _command()(args=args, standalone_mode=False)
    except WandistillError as e:
        if _stopped(e):  # a graceful stop: the fix is the exact command that resumes it
            _fail(e.message, e.exit_code, f"to resume, run: {_rerun(args, e.resume_flag)}")
        if _debug:
            raise
        if e.same_on_every_rank and os.environ.get("RANK", "0") != "0":
            # rank 0 says it once for all ranks; torchrun stops every rank as soon as one
            # exits, so this one waits a moment for rank 0 to print first
            import time

            time.sleep(2.0)
            sys.exit(e.exit_code)
        _fail(e.message, e.exit_code, e.fix)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        _fail("interrupted", 130)
    except typer.TyperException as e:  # click usage errors: unknown command, bad option
        if not str(e):  # a group run without a command: click printed its help
            sys.exit(int(getattr(e, "exit_code", 2)))
        _fail(*_click_error(e))
    except KeyboardInterrupt:
        again = "--resume" if "train" in args[:3] else ""  # (after --debug / -v at most)
        _fail("interrupted", 130, f"to resume, run: {_rerun(args, again)}")
    except OSError as e:
        if _debug:
            raise
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):  # fsutil.name_target
            what = {
                errno.ENOSPC: "disk full",
                errno.EDQUOT: "disk quota exceeded",
                errno.EFBIG: "file too large (over the file size limit: `ulimit -f`, or the "
                "filesystem's)",
            }[e.errno]
            target = f" while writing {e.filename}" if e.filename else ""
            _fail(
                f"{what}{target}",
                1,
                "free space (or raise the limit), or choose another output directory; re-run "
                "to resume",
            )
        if e.errno in (errno.EMFILE, errno.ENFILE):
            _fail(
                f"{e.strerror or e}: {e.filename}" if e.filename else str(e),
                1,
                "raise the open-file limit (`ulimit -n 65536`) or lower data_threads",
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


def _click_error(e: Exception) -> tuple[str, int, str]:
    """A click usage error as our two lines: click's message (with its "Did you mean"), and
    the --help of the command it was parsing as the fix."""
    # (typer vendors its own click: read the exception by its attributes, not its class)
    message = e.format_message() if hasattr(e, "format_message") else str(e)
    opts = getattr(getattr(e, "param", None), "opts", None)
    if opts and opts[0] not in message:
        message = f"{'/'.join(opts)}: {message}"
    ctx = getattr(e, "ctx", None)
    path = ctx.command_path if ctx is not None else "wandistill"
    group = ctx is not None and hasattr(ctx.command, "commands")
    what = "its commands" if group else "its arguments and flags"
    return message, int(getattr(e, "exit_code", 2)), f"`{path} --help` lists {what}"


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
