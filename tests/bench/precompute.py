"""Benchmark: `wandistill precompute` vs the naive loop users write today, on one teacher.

(a) naive: `WanPipeline` called once per prompt, `callback_on_step_end` capturing the latents of
    every step, one `torch.save` per sample (the baseline being replaced; it pickles, we do not);
(b) ours: `wandistill.precompute.run` into a webdataset cache;
(c) ours with a null sink: the same run with records discarded, to isolate cache-writing cost.

Prints prompts/s of each and the ratios (b)/(a) and (b)/(c) in the same run.
Targets (issue 3): (b)/(a) >= 1.5x on CPU with the tiny teacher; writing overhead <= 3%.

    python tests/bench/precompute.py --prompts 32 --steps 8 --batch-size 8 [--json FILE]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import machine_line, write_json  # tests/bench, next to this script


def naive(
    teacher: Path,
    prompts: list[str],
    args: argparse.Namespace,
    out: Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    num_frames: int = 1,
    max_sequence_length: int = 32,
) -> float:
    """The baseline: one `WanPipeline` call per prompt, every step's latents kept, one
    `torch.save` per sample; `tests/bench/gpu.py` runs it in bf16 on a GPU at 480p sizes."""
    from diffusers import WanPipeline

    t0 = time.perf_counter()
    pipe = WanPipeline.from_pretrained(teacher, torch_dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    out.mkdir(parents=True, exist_ok=True)
    for i, prompt in enumerate(prompts):
        steps: list[torch.Tensor] = []

        def grab(_pipe, _i, _t, kw, steps=steps):  # noqa: ANN001, ANN202
            steps.append(kw["latents"].detach().clone())
            return kw

        latents = pipe(
            prompt=prompt,
            negative_prompt="",
            height=args.height,
            width=args.width,
            num_frames=num_frames,
            num_inference_steps=args.steps,
            guidance_scale=5.0,
            max_sequence_length=max_sequence_length,
            generator=torch.Generator().manual_seed(i),
            output_type="latent",
            callback_on_step_end=grab,
        ).frames
        torch.save(
            {"prompt": prompt, "latents": torch.stack(steps), "final": latents}, out / f"{i:06d}.pt"
        )
    return time.perf_counter() - t0


def ours(
    teacher: Path,
    prompt_file: Path,
    args: argparse.Namespace,
    cache: Path,
    null_sink: bool,
    extra: tuple[str, ...] = (),
) -> float:
    """`wandistill.precompute.run` on the same prompts; `extra` overrides come last (gpu.py
    sets the device, dtype and sizes there)."""
    from wandistill.config import load_recipe
    from wandistill.precompute.run import run

    cfg = load_recipe(
        None,
        [
            f'teacher.path="{teacher}"',
            f'prompts="{prompt_file}"',
            f'cache.path="{cache}"',
            f"sampler.num_inference_steps={args.steps}",
            f"sampler.batch_size={args.batch_size}",
            f"sampler.height={args.height}",
            f"sampler.width={args.width}",
            "sampler.num_frames=1",
            "sampler.max_sequence_length=32",
            "cache.shard_records=64",
            *extra,
        ],
        stage="precompute",
    ).precompute
    t0 = time.perf_counter()
    run(cfg, null_sink=null_sink, quiet=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", type=Path, help="teacher folder (default: build the tiny one)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--height", type=int, default=32)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="best of N for each leg")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="wandistill-bench-"))
    try:
        teacher = args.teacher
        if teacher is None:
            from wandistill.teacher.tiny import make_tiny_teacher

            teacher = make_tiny_teacher(work / "teacher")
        prompts = [f"prompt number {i}: a cat and a dog in a park" for i in range(args.prompts)]
        prompt_file = work / "prompts.txt"
        prompt_file.write_text("\n".join(prompts) + "\n")
        legs: dict[str, float] = {}
        for r in range(args.repeats):
            for name in ("naive", "ours", "ours_null"):
                target = work / f"{name}-{r}"
                if name == "naive":
                    t = naive(teacher, prompts, args, target)
                else:
                    t = ours(teacher, prompt_file, args, target, null_sink=name == "ours_null")
                legs[name] = min(legs.get(name, float("inf")), t)
                shutil.rmtree(target, ignore_errors=True)
        print(f"# {' '.join(sys.argv)}")
        print(f"# {machine_line()}, threads {torch.get_num_threads()}")
        print(
            f"# {args.prompts} prompts, {args.steps} steps, batch {args.batch_size}, "
            f"{args.height}x{args.width}x1, best of {args.repeats}"
        )
        print(f"{'leg':<12}{'seconds':>10}{'prompts/s':>12}")
        for name, t in legs.items():
            print(f"{name:<12}{t:>10.2f}{args.prompts / t:>12.2f}")
        print(
            f"ours / naive      throughput ratio: {legs['naive'] / legs['ours']:.2f}x "
            "(target >= 1.5x)"
        )
        overhead = legs["ours"] / legs["ours_null"] - 1
        print(f"cache writing overhead vs null sink: {overhead * 100:+.1f}% (target <= 3%)")
        if args.json:
            write_json(
                args.json,
                {
                    "command": " ".join(sys.argv),
                    "settings": {k: v for k, v in vars(args).items() if k != "json"},
                    "threads": torch.get_num_threads(),
                    "seconds": legs,
                    "prompts_per_s": {name: args.prompts / t for name, t in legs.items()},
                    "ours_over_naive": legs["naive"] / legs["ours"],
                    "write_overhead": overhead,
                },
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
