#!/usr/bin/env python
"""Trained tiny teacher: build time, prompt conditioning and few-step degradation.

    python tests/bench/trained_teacher.py [--steps N] [--prompts 32] [--png PATH] [--json FILE]

1. Builds the trained teacher with the user's command, `python -m wandistill teacher
   make-trained DIR` (the default recipe unless --steps), in a fresh process with
   OMP_NUM_THREADS=2 and again with 1, timing wall and the process's CPU time (user + sys, from
   getrusage), and checks that both builds wrote the same safetensors bytes. The baseline is the
   random teacher, `python -m wandistill teacher make-tiny DIR`, built the same way in the same run.
2. Samples both teachers with stock `WanPipeline` at TRAINED_SAMPLER's sizes on fresh
   prompt/noise pairs (`synthetic_prompts(n, seed=1000)`, generator seed 1234: neither is what the
   demo uses) with K = 1, 2, 4, 8, 16 and 32 UniPC steps, at guidance 1, 3 and 5, and reports
   - few-step degradation: latent MSE(teacher@K, teacher@16) and MSE(teacher@K, teacher@32);
   - conditioning, on the 16-step samples: the share of samples nearer (latent MSE) to their own
     prompt's `synthetic_pattern` than to every other sampled prompt's; and, for the nearest of
     the grammar's 240 patterns, the share that agrees with the prompt on colour, shape, size and
     position; the same scores for jittered training samples of those prompts are the ceiling;
   - what a viewer sees (`wandistill.eval.viewer`, the model-free reader of the known renderer),
     at every K: the share of samples showing all four attributes of their prompt, each one, and
     the spread ratio to teacher@16 (also for the jittered training samples: the ceiling).
3. Writes a PNG of the first 8 prompts (rows) at each K and the ground-truth pattern (columns):
   latent channels 0-2 as RGB, each latent pixel 8x8, at --guidance.

Not a pytest test (tests/bench is excluded from collection).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from harness import busy_cpu_seconds, environment, machine_line, own_cpu_seconds, write_json
from PIL import Image, ImageDraw

from wandistill.eval import viewer
from wandistill.teacher.decode import save_png
from wandistill.teacher.trained import (
    TRAINED_SAMPLER,
    _training_batch,
    grammar_prompts,
    parse_prompt,
    synthetic_pattern,
    synthetic_prompts,
)

STEPS = (1, 2, 4, 8, 16, 32)
GUIDANCE = (1.0, 3.0, 5.0)


def timed_cli(args: list[str], threads: int) -> dict[str, float]:
    """Run `python -m wandistill ARGS` with OMP_NUM_THREADS=threads: wall and CPU seconds, and
    the cores other processes kept busy meanwhile (the box may be shared)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    busy, cpu, wall = busy_cpu_seconds(), own_cpu_seconds(children_only=True), time.perf_counter()
    subprocess.run([sys.executable, "-m", "wandistill", *args], env=env, check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    wall = time.perf_counter() - wall
    cpu = own_cpu_seconds(children_only=True) - cpu
    others = max(0.0, busy_cpu_seconds() - busy - cpu) / wall
    return {
        "threads": threads,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "others_cores": round(others, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }


def weights_digest(folder: Path) -> str:
    """sha256 over every safetensors file of a teacher folder, in path order."""
    h = hashlib.sha256()
    for f in sorted(folder.rglob("*.safetensors")):
        h.update(f.relative_to(folder).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def sample(pipe: Any, prompts: list[str], k: int, guidance: float) -> torch.Tensor:
    kwargs = {n: v for n, v in TRAINED_SAMPLER.items() if n != "flow_shift"}
    kwargs.update(num_inference_steps=k, guidance_scale=guidance)
    gen = torch.Generator().manual_seed(1234)
    return pipe(prompts, **kwargs, output_type="latent", generator=gen).frames


def conditioning(latents: torch.Tensor, prompts: list[str]) -> dict[str, float]:
    """Own-pattern win rate against the other sampled prompts, and per-attribute accuracy of
    the nearest grammar pattern."""
    sampled = sorted(set(prompts))
    wins = nearest_share(latents, prompts, sampled)
    grammar = grammar_prompts()
    every = torch.stack([synthetic_pattern(p) for p in grammar])
    nearest = (latents[:, None] - every[None]).square().mean(dim=(2, 3, 4, 5)).argmin(dim=1)
    got = [parse_prompt(grammar[i]) for i in nearest.tolist()]
    want = [parse_prompt(p) for p in prompts]
    out = {"own_pattern_wins": round(wins, 3)}
    for attr in ("colour", "shape", "size", "position"):
        hits = sum(getattr(g, attr) == getattr(w, attr) for g, w in zip(got, want, strict=True))
        out[attr] = round(hits / len(prompts), 3)
    return out


def nearest_share(latents: torch.Tensor, prompts: list[str], candidates: list[str]) -> float:
    """Share of latents whose nearest candidate pattern is their own prompt's."""
    patterns = torch.stack([synthetic_pattern(p) for p in candidates])
    nearest = (latents[:, None] - patterns[None]).square().mean(dim=(2, 3, 4, 5)).argmin(dim=1)
    hits = sum(candidates[j] == p for j, p in zip(nearest.tolist(), prompts, strict=True))
    return hits / len(prompts)


def seen(runs: dict[int, torch.Tensor], prompts: list[str]) -> dict[str, dict[str, float]]:
    """The viewer's shares per K (spread ratio against K = 16)."""
    tally = viewer.Tally()
    tally.add(prompts, {str(k): runs[k] for k in runs})
    fields = ("all", "colour", "shape", "size", "position", "clear", "spread_ratio")
    return {
        k: {f: round(getattr(s, f) or 0.0, 3) for f in fields}
        for k, s in tally.scores("16").items()
    }


def data_ceiling(prompts: list[str]) -> dict[str, float]:
    """The same scores for jittered training samples of the same prompts (4 per prompt): what a
    teacher that samples its training distribution exactly would score."""
    specs = [parse_prompt(p) for p in prompts]
    idx, latents = _training_batch(specs, 4 * len(specs), torch.Generator().manual_seed(0))
    out: dict[str, Any] = conditioning(latents, [prompts[i] for i in idx])
    tally = viewer.Tally()
    tally.add([prompts[i] for i in idx], {"data": latents})
    score = tally.scores("data")["data"]
    out["viewer"] = {
        f: round(getattr(score, f), 3) for f in ("all", "colour", "shape", "size", "position")
    }
    return out


def evaluate(folder: Path, prompts: list[str]) -> dict[str, Any]:
    """Per guidance: MSE of each K's samples to the 16- and 32-step ones, conditioning at 16."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    result: dict[str, Any] = {}
    for g in GUIDANCE:
        runs = {k: sample(pipe, prompts, k, g) for k in STEPS}

        def mse(ref: int, runs: dict[int, torch.Tensor] = runs) -> dict[int, float]:
            return {k: round(float((runs[k] - runs[ref]).square().mean()), 5) for k in STEPS}

        result[f"cfg{g:g}"] = {
            "mse_vs_16": mse(16),
            "mse_vs_32": mse(32),
            "conditioning_16": conditioning(runs[16], prompts),
            "viewer": seen(runs, prompts),
            "runs": runs,
        }
    return result


def to_rgb(latent_CFHW: torch.Tensor, scale: int = 8) -> np.ndarray:
    rgb = ((latent_CFHW[:3, 0].clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0)
    return np.kron(rgb.numpy(), np.ones((scale, scale, 1), dtype=np.uint8))


def grid_png(runs: dict[int, torch.Tensor], prompts: list[str], path: Path, title: str) -> None:
    cols = [k for k in STEPS if k != 32]
    tile, gap, left, top = 64, 4, 230, 34
    width = left + (len(cols) + 1) * (tile + gap)
    img = Image.new("RGB", (width, top + 8 * (tile + gap)), "white")
    draw = ImageDraw.Draw(img)
    draw.text((4, 4), title, fill="black")
    for j, name in enumerate([*(f"K={k}" for k in cols), "pattern"]):
        draw.text((left + j * (tile + gap) + 4, top - 14), name, fill="black")
    for i, prompt in enumerate(prompts[:8]):
        y = top + i * (tile + gap)
        draw.text((4, y + tile // 2 - 6), prompt, fill="black")
        tiles = [runs[k][i] for k in cols] + [synthetic_pattern(prompt)]
        for j, latent in enumerate(tiles):
            img.paste(Image.fromarray(to_rgb(latent)), (left + j * (tile + gap), y))
    save_png(img, path)


def build_all(tmp: Path, steps: int | None) -> tuple[dict[str, Any], Path, Path]:
    """The trained teacher under 2 and 1 threads, then the random baseline; timings + paths."""
    extra = [] if steps is None else ["--steps", str(steps)]
    builds = {}
    for threads in (2, 1):
        folder = tmp / f"trained-{threads}"
        builds[f"trained_omp{threads}"] = timed_cli(
            ["teacher", "make-trained", str(folder), *extra], threads
        )
        builds[f"trained_omp{threads}"]["weights"] = weights_digest(folder)
    builds["random_omp2"] = timed_cli(["teacher", "make-tiny", str(tmp / "random")], 2)
    builds["same_bytes_omp2_omp1"] = (
        builds["trained_omp2"]["weights"] == builds["trained_omp1"]["weights"]
    )
    return builds, tmp / "trained-2", tmp / "random"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: recipe)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--guidance", type=float, default=TRAINED_SAMPLER["guidance_scale"])
    ap.add_argument("--png", type=Path, default=Path("cache/trained-teacher-samples.png"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    env = environment()
    print(f"# {' '.join(sys.argv)}\n# {machine_line()}", file=sys.stderr)
    prompts = synthetic_prompts(args.prompts, seed=1000)
    with tempfile.TemporaryDirectory() as tmp:
        builds, folder, base = build_all(Path(tmp), args.steps)
        meta = json.loads((folder / "wandistill_teacher.json").read_text())
        trained, random_teacher = evaluate(folder, prompts), evaluate(base, prompts)
    runs = trained[f"cfg{args.guidance:g}"]["runs"]
    title = f"trained tiny teacher, CFG {args.guidance:g}: latent channels 0-2 as RGB"
    grid_png(runs, prompts, args.png, title)

    def strip(r: dict[str, Any]) -> dict[str, Any]:
        return {g: {k: v for k, v in d.items() if k != "runs"} for g, d in r.items()}

    report = {
        "command": " ".join(sys.argv),
        "environment": env,
        "builds": builds,
        "settings": meta["settings"],
        "final_loss": meta["final_loss"],
        "data_ceiling": data_ceiling(prompts),
        "trained": strip(trained),
        "random_baseline": strip(random_teacher),
        "png": str(args.png),
    }
    print(json.dumps(report, indent=1))
    if args.json:
        write_json(args.json, report)  # with the bench's own peak RSS


if __name__ == "__main__":
    main()
