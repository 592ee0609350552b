"""`wandistill eval` and `wandistill sample`: score a student against its teacher, and sample
images from a student or the teacher."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from wandistill.cli.common import _out_dir, _positive, app, err, option, out
from wandistill.errors import ConfigError, UsageError

RunOpt = Annotated[
    Path | None,
    option(
        "--run",
        help="The --out folder of a finished `wandistill train`: its student, K-step scheduler "
        "and the cache it learned from (for sizes). Pick it for a run you have not exported. "
        "One of --run, --export, --student (default: none; eval needs one, sample without "
        "one samples the teacher).",
        path="--run",
    ),
]
ExportOpt = Annotated[
    Path | None,
    option(
        "--export",
        help="A folder written by `wandistill export` (a complete WanPipeline): pick it to test "
        "exactly what users will load. One of --run, --export, --student (default: none).",
        path="--export",
    ),
]
StudentOpt = Annotated[
    Path | None,
    option(
        "--student",
        help="A finished run's student/ or student_ema/ folder (its run's sampling.json gives K): "
        "the same as --run with --no-ema / --ema, named by folder. One of --run, --export, "
        "--student (default: none).",
        path="--student",
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


EvalCacheOpt = Annotated[
    str,
    option(
        help="The cache the student was trained from (its held-out records are scored) or a "
        "separate cache of the same teacher (with --split all); a folder or an fsspec URL.",
        path="--cache",
        url=True,
    ),
]
EvalOutOpt = Annotated[
    Path, option("--out", help="New folder for eval.md, eval.json and grid.png.", path="--out")
]
EvalTeacherOpt = Annotated[
    Path | None,
    option(
        help="The cache's teacher folder: adds teacher@K (the teacher itself at K steps, with "
        "its CFG), the column R_K compares with. Default: none (no R_K).",
        path="--teacher",
    ),
]
BaselineOpt = Annotated[
    Path | None,
    option(
        help="Run folder of a step-imitating student (train with loss.output only): adds "
        "baseline@K and baseline@N, to show what few-step training buys. Default: none.",
        path="--baseline",
    ),
]
EvalStepsOpt = Annotated[
    int | None,
    typer.Option(
        help="Sampler steps K, 1..the student's K. Default: the student's own K (fewer: to see "
        "how it degrades)."
    ),
]
SplitOpt = Annotated[
    str,
    typer.Option(
        help="holdout: the records cache.holdout_fraction kept out of training (the student's "
        "own cache); all: every record (a separate eval cache)."
    ),
]
MaxRecordsOpt = Annotated[
    int | None, typer.Option(help="Score at most N records (>= 1) for a quick look. Default: all.")
]
BatchSizeOpt = Annotated[
    int, typer.Option(help="Records per pipeline call (>= 1): lower it if memory runs out.")
]
DecodeOpt = Annotated[
    bool,
    typer.Option(
        "--decode/--no-decode",
        help="Grid of VAE-decoded frames and image PSNR (needs --teacher; slower), or of latents.",
    ),
]


@app.command("eval")
def eval_cmd(
    cache: EvalCacheOpt,
    out_dir: EvalOutOpt,
    run: RunOpt = None,
    export: ExportOpt = None,
    student: StudentOpt = None,
    ema: EmaOpt = True,
    teacher: EvalTeacherOpt = None,
    baseline: BaselineOpt = None,
    steps: EvalStepsOpt = None,
    split: SplitOpt = "holdout",
    max_records: MaxRecordsOpt = None,
    batch_size: BatchSizeOpt = 8,
    decode: DecodeOpt = False,
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


SamplePromptsOpt = Annotated[
    Path, option(help="Prompt file: .txt (one per line) or .jsonl.", path="--prompts")
]
SampleOutOpt = Annotated[
    Path, option("--out", help="New folder for NNNN.png (frame 0) and grid.png.", path="--out")
]
SampleTeacherOpt = Annotated[
    Path | None,
    option(
        help="Teacher folder. With --run/--student: its tokenizer, text encoder and VAE (the "
        "run's teacher). Alone: the teacher itself is sampled, to compare. Default: none (an "
        "--export brings its own).",
        path="--teacher",
    ),
]
SampleCacheOpt = Annotated[
    str | None,
    option(
        help="Teacher alone: take steps, sizes and CFG from this cache's settings (what the "
        "student learned from). Default: none.",
        path="--cache",
        url=True,
    ),
]
SampleRecipeOpt = Annotated[
    str | None,
    typer.Option(
        help="Teacher alone: take them from this recipe's \\[precompute.sampler] (file or "
        "shipped name). Without --cache or --recipe: WanPipeline's own defaults."
    ),
]
SampleStepsOpt = Annotated[
    int | None,
    typer.Option(
        help="Sampler steps >= 1. Default: a student's K (it takes at most K); the teacher "
        "alone: --cache's / --recipe's N, else WanPipeline's."
    ),
]
PixelsOpt = Annotated[
    int | None, typer.Option(help=f"Pixels, a multiple of 16. {_SAMPLE_DEFAULT}.")
]
FramesOpt = Annotated[int | None, typer.Option(help=f"4k + 1 (1: an image). {_SAMPLE_DEFAULT}.")]
GuidanceOpt = Annotated[
    float | None,
    typer.Option(
        help="Teacher only (> 1: CFG, two forwards per step; 1: none). Default: --cache's / "
        "--recipe's, else WanPipeline's. A student always samples with 1.0."
    ),
]
SampleSeedOpt = Annotated[
    int, typer.Option(help="Prompt i draws its noise from SEED + i (0..2^63-1).")
]
MaxSeqOpt = Annotated[
    int | None,
    typer.Option(help=f"Text padding length >= 1; keep it the cache's. {_SAMPLE_DEFAULT}."),
]
LimitOpt = Annotated[
    int, typer.Option(help="Sample the first N prompts of the file (>= 1); the rest are left.")
]


@app.command("sample")
def sample_cmd(
    prompts: SamplePromptsOpt,
    out_dir: SampleOutOpt,
    export: ExportOpt = None,
    run: RunOpt = None,
    student: StudentOpt = None,
    ema: EmaOpt = True,
    teacher: SampleTeacherOpt = None,
    cache: SampleCacheOpt = None,
    recipe: SampleRecipeOpt = None,
    steps: SampleStepsOpt = None,
    height: PixelsOpt = None,
    width: PixelsOpt = None,
    num_frames: FramesOpt = None,
    guidance_scale: GuidanceOpt = None,
    seed: SampleSeedOpt = 0,
    max_sequence_length: MaxSeqOpt = None,
    limit: LimitOpt = 16,
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
    flags = dict(height=height, width=width, num_frames=num_frames)  # the sampler's, as given
    flags.update(max_sequence_length=max_sequence_length, guidance_scale=guidance_scale, seed=seed)
    _check_sampler_flags(num_inference_steps=steps, **flags)
    where = _device(device)
    _out_dir(out_dir)
    folder = TeacherFolder.open(teacher) if teacher is not None else None
    chosen = open_student(run=run, export=export, student=student, ema=ema, required=False)
    defaults, n = _teacher_defaults(cache, recipe, student=chosen is not None)
    options = SampleOptions(steps=steps, **flags)
    items, _ = read_prompts(prompts)
    paths = sample(
        [p.text for p in items[:limit]],
        out_dir,
        student=chosen,
        teacher=folder,
        sizes=defaults,
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
