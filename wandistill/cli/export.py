"""`wandistill export`: a run's student as a WanPipeline folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from wandistill.cli.common import _out_dir, app, option, out


@app.command("export")
def export_cmd(
    run: Annotated[
        Path,
        option("--run", help="The --out folder of a finished `wandistill train`.", path="--run"),
    ],
    teacher: Annotated[
        Path,
        option(
            help="The run's teacher folder: its tokenizer, text encoder and VAE go into the "
            "pipeline (checked to be those the run's cache was made with).",
            path="--teacher",
        ),
    ],
    out_dir: Annotated[
        Path,
        option(
            "--out",
            help="New (or empty, or an earlier export's) folder for the WanPipeline.",
            path="--out",
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
