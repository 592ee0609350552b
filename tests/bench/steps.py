#!/usr/bin/env python
"""Few-step students from the cache: R_K for K = 1, 2, 4 and each objective, and the speed-up.

    python tests/bench/steps.py [--work DIR] [--ks 1,2,4] [--objectives perflow,unroll,...]
                                [--train-steps N] [--json FILE] [--set KEY=VALUE ...]
                                [--teacher PATH [--prompts N]] [--seeds-per-prompt S]
                                [--train-gap N] [--teacher-blocks B]

On the trained tiny teacher (`wandistill.teacher.trained`, built once under --work) with the
demo's recipe (`pipelines/tiny-fewstep.toml`: 64x64, N = 16 UniPC steps, CFG 5.0, every step
recorded):

1. a training cache of the grammar's prompts minus the held-out ones (`--eval-prompts` of them,
   never trained on), sampler seed 0;
2. an eval cache of the held-out prompts with FRESH noise (sampler seed 1_000_000: no noise the
   training cache holds), split "all";
3. one student per (K, objective), trained with the recipe's student and budget: `perflow`
   (piecewise reflow), `unroll` (backpropagation through the K-step sampler) and
   `perflowunroll` (both at 1); and the step-imitating baseline (`output` loss, K unset = N,
   the teacher's own scheduler), the same student and budget;
4. `wandistill.eval.run.evaluate` of each on the eval cache, with the teacher (teacher@K: the
   teacher's own scheduler at K steps, same noise, same prompts, CFG as cached) and the baseline:
   R_K = MSE(student@K, teacher@N) / MSE(teacher@K, teacher@N), and the baseline's ratio at K;
5. speed, same box, same run: the exported K = 4 student of the best objective through
   `WanPipeline.from_pretrained(EXPORT)` at K steps, guidance 1, vs the teacher's own folder at N
   steps with CFG, one prompt per call (median over the held-out prompts after a warm-up call,
   text encoding and VAE decoding included: the user's call); forwards per sample K vs 2N.

`--seeds-per-prompt S` trains on S trajectories (seeds) of every training prompt; `--train-gap N`
also scores every student on the first N training (prompt, noise) pairs and prints a second
table, training vs held-out student MSE (a ratio well above 1: the student memorised its data).
`--teacher-blocks B` builds the trained teacher with B blocks (default 2, the demo's); the `half`
depth is then B // 2 blocks started from the teacher's blocks 0, 2, ...

Targets: R_4 <= 0.5; R_K < 1 is the least that counts as working. Not a pytest test.

`--teacher PATH` (e.g. a random `wandistill teacher make-tiny` one) replaces the trained teacher,
with N generic prompts (`--prompts`, default 256): the plumbing and the speed-up are measured, the
quality figures are those of a teacher that draws noise (no structure to learn).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from harness import bootstrap_interval, machine_line, max_rss_bytes, paired_ratios, write_json

RECIPE = "tiny-fewstep"
WEIGHTS = ("perflow", "unroll")
"""The few-step loss weights an objective sets, every one of them: the recipe's own choice
(perflow = 1 in tiny-fewstep) must not ride along with another objective."""


def _objective(**weights: float) -> list[str]:
    return [f"loss.{name}={float(weights.get(name, 0.0))}" for name in WEIGHTS]


OBJECTIVES = {
    "unroll": _objective(unroll=1),
    "perflow": _objective(perflow=1),
    "perflowunroll": _objective(perflow=1, unroll=1),
}


DEPTHS = ("full", "half")


def depth_sets(depth: str, teacher_blocks: int) -> list[str]:
    """Student depth: all the teacher's blocks, or half of them started from every other one
    (blocks 0, 2, ...: the spread-out initialisation a layer-dropping student starts from)."""
    if depth == "full":
        return []
    half = list(range(0, teacher_blocks, 2))[: max(1, teacher_blocks // 2)]
    return [f"student.num_layers={len(half)}", f"student.init_from_teacher.blocks={half}"]


def grammar() -> list[str]:
    """Every prompt of the trained teacher's grammar, shuffled."""
    from wandistill.teacher.world import grammar_prompts, synthetic_prompts

    return synthetic_prompts(len(grammar_prompts()), seed=0)


def build_caches(
    work: Path, teacher: Path, prompts: list[str], n_eval: int, sets: list[str], repeats: int = 1
) -> tuple[Path, Path]:
    """Training cache (prompts minus held-out ones, each `repeats` times: a line's seed is the
    base seed + its index, so every repeat is another trajectory of the same prompt) and eval
    cache (held-out, fresh noise)."""
    from wandistill.config import load_recipe
    from wandistill.precompute.run import run as precompute

    split = {"train": prompts[n_eval:] * repeats, "eval": prompts[:n_eval]}
    seeds = {"train": 0, "eval": 1_000_000}
    for name, texts in split.items():
        (work / f"{name}.txt").write_text("\n".join(texts) + "\n")
        # A .txt file takes a repeated line for a duplicate; a .jsonl line names its own seed.
        lines = (json.dumps({"prompt": t, "seed": seeds[name] + i}) for i, t in enumerate(texts))
        (work / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        cfg = load_recipe(
            RECIPE,
            [
                f'teacher.path="{teacher}"',
                f'prompts="{work / f"{name}.jsonl"}"',
                f'cache.path="{work / f"cache-{name}"}"',
                "cache.holdout_fraction=0.0",
                f"sampler.seed={seeds[name]}",
                *(s.removeprefix("precompute.") for s in sets if s.startswith("precompute.")),
            ],
            stage="precompute",
        )
        precompute(cfg.precompute, quiet=True)
    return work / "cache-train", work / "cache-eval"


def build_seen_cache(work: Path, teacher: Path, n: int, sets: list[str]) -> Path:
    """A cache of the first `n` training lines with their training seeds: the very (prompt,
    noise) pairs the students were trained on, so eval on it measures the training error that
    the held-out error is compared with (overfitting shows as a gap between the two)."""
    from wandistill.config import load_recipe
    from wandistill.precompute.run import run as precompute

    lines = (work / "train.jsonl").read_text().splitlines()[:n]
    (work / "seen.jsonl").write_text("\n".join(lines) + "\n")
    cfg = load_recipe(
        RECIPE,
        [
            f'teacher.path="{teacher}"',
            f'prompts="{work / "seen.jsonl"}"',
            f'cache.path="{work / "cache-seen"}"',
            "cache.holdout_fraction=0.0",
            "sampler.seed=0",
            *(s.removeprefix("precompute.") for s in sets if s.startswith("precompute.")),
        ],
        stage="precompute",
    )
    precompute(cfg.precompute, quiet=True)
    return work / "cache-seen"


def run_identity(cfg: Any, work: Path) -> dict[str, Any]:
    """Everything that makes a run's student: its whole resolved train config but the output
    folder (so --train-steps, --set train.* and recipe changes all count), and the training
    cache's content (the prompt/seed lines precompute ran, and the precompute.* overrides, via
    the cache's manifest settings)."""
    from wandistill.cache.reader import CacheReader

    config = dataclasses.asdict(cfg)
    config.pop("out", None)
    with CacheReader(work / "cache-train") as store:
        cache = {"settings": store.manifest.block_json("settings"), "records": len(store)}
    lines = hashlib.sha256((work / "train.jsonl").read_bytes()).hexdigest()
    identity = {"train": config, "cache": cache, "train_prompts_sha256": lines}
    return json.loads(json.dumps(identity, default=str))  # as bench-run.json will hold it


def _digest(identity: dict[str, Any]) -> str:
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def train_one(work: Path, name: str, teacher: Path, extra: list[str], sets: list[str]) -> Path:
    """The run `name` for these settings: runs/NAME-DIGEST, the digest of `run_identity`, so a
    rerun with other settings (more --train-steps, another cache) trains a new student instead
    of reporting the old one; only a finished run with the very same identity is reused (its
    identity is kept beside it in runs/NAME-DIGEST.json, outside the folder train claims)."""
    from wandistill.config import load_recipe
    from wandistill.demo import baseline_config
    from wandistill.io.fsutil import atomic_write_json
    from wandistill.train import run as train

    def config(out: Path) -> Any:
        cfg = load_recipe(
            RECIPE,
            [
                f'train.cache="{work / "cache-train"}"',
                f'train.out="{out}"',
                f'train.student.init_from_teacher.path="{teacher}"',
                "train.tensorboard=false",
                *(s if s.startswith("train.") else f"train.{s}" for s in extra),
                *(s for s in sets if s.startswith("train.")),
            ],
        ).train
        return baseline_config(cfg, out) if name == "baseline" else cfg

    identity = run_identity(config(work / "runs" / name), work)
    out = work / "runs" / f"{name}-{_digest(identity)}"
    cfg = config(out)
    marker = out.with_name(out.name + ".json")
    if marker.is_file():
        kept = json.loads(marker.read_text())
        if _digest(kept) != _digest(identity):  # a digest collision: never report another run
            raise SystemExit(f"error: {out} holds a run of other settings; fix: remove it")
        if (out / "sampling.json").is_file():
            print(f"  reusing finished run {out} (same settings)", flush=True)
            return out
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(marker, identity)
    t0 = time.perf_counter()
    train(cfg, resume=(out / "checkpoints" / "latest").exists())
    print(f"  trained {name} in {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def evaluate_one(
    work: Path, run: Path, teacher: Path, baseline: Path, cache: str = "cache-eval"
) -> dict[str, Any]:
    from wandistill.eval.run import evaluate
    from wandistill.student.folders import read_run
    from wandistill.teacher.folder import TeacherFolder

    result = evaluate(
        work / cache,
        read_run(run),
        work / ("eval" if cache == "cache-eval" else f"eval-{cache}") / run.name,
        teacher=TeacherFolder.open(teacher),
        baseline=read_run(baseline, flag="--baseline"),
        split="all",
    )
    return result.to_json()


def speed(work: Path, run: Path, teacher: Path, prompts: list[str]) -> dict[str, Any]:
    """The exported student at K steps vs the teacher's folder at N steps with CFG."""
    from diffusers import WanPipeline

    from wandistill.config import load_recipe
    from wandistill.io.modelfolder import load_pretrained
    from wandistill.student.export import export
    from wandistill.teacher.folder import TeacherFolder

    export(run, TeacherFolder.open(teacher), work / "export")
    s = load_recipe(RECIPE).precompute.sampler
    common = dict(height=s.height, width=s.width, num_frames=s.num_frames)
    common |= dict(max_sequence_length=s.max_sequence_length, output_type="np")
    k = json.loads((run / "sampling.json").read_text())["num_inference_steps"]
    legs = {
        f"student@{k} (export)": (work / "export", dict(num_inference_steps=k, guidance_scale=1.0)),
        f"teacher@{s.num_inference_steps} CFG": (
            teacher,
            dict(num_inference_steps=s.num_inference_steps, guidance_scale=s.guidance_scale),
        ),
    }
    out: dict[str, Any] = {}
    for name, (folder, call) in legs.items():
        pipe = load_pretrained(WanPipeline, folder)
        pipe.set_progress_bar_config(disable=True)
        pipe(prompts[0], **call, **common)  # warm-up
        times = []
        for i, prompt in enumerate(prompts):
            t0 = time.perf_counter()
            pipe(prompt, generator=torch.Generator().manual_seed(i), **call, **common)
            times.append(time.perf_counter() - t0)
        cfg = call["guidance_scale"] > 1.0
        out[name] = {
            "seconds_per_sample": statistics.median(times),
            "forwards_per_sample": call["num_inference_steps"] * (2 if cfg else 1),
            "seconds": times,
        }
    student, teacher_leg = (out[name]["seconds"] for name in legs)
    per_prompt = paired_ratios(teacher_leg, student)  # the same prompt and noise in both legs
    out["speedup_per_prompt"] = [statistics.median(per_prompt), *bootstrap_interval(per_prompt)]
    return out


def _acc(column: dict[str, Any] | None) -> str:
    view = (column or {}).get("viewer") or {}
    return f"{view['all']:.2f}" if "all" in view else "-"


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    """One row per run: R_K, equivalent teacher steps and, where eval's viewer judged the samples
    (the trained teacher's world), the share showing all four attributes and the spread ratio."""
    lines = [
        "| K | objective | R_K student | baseline@K ratio | student MSE | teacher@K MSE | "
        "student ~ teacher steps | accuracy student / teacher@K / teacher@N | spread ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        cols = {c["name"]: c for c in r["columns"]}
        k = r["num_inference_steps"]
        st, tk = cols[f"student@{k}"], next(c for c in r["columns"] if c["role"] == "teacher")
        tn = cols.get(f"teacher@{r['teacher_steps']}")
        spread = (st.get("viewer") or {}).get("spread_ratio")
        lines.append(
            f"| {k} | {name.split('-', 1)[1]} | {r['r_k']:.3f} | {r['baseline_r_k']:.3f} | "
            f"{st['latent_mse']:.4f} | {tk['latent_mse']:.4f} | {st.get('equivalent') or '-'} | "
            f"{_acc(st)} / {_acc(tk)} / {_acc(tn)} | "
            f"{'-' if spread is None else f'{spread:.2f}'} |"
        )
    return lines


def gap_table(held_out: dict[str, dict[str, Any]], seen: dict[str, dict[str, Any]]) -> list[str]:
    """One row per run evaluated on both caches: the student's MSE to teacher@N on training
    (prompt, noise) pairs and on held-out ones, and their ratio (>> 1: it memorised its data)."""
    lines = [
        "| K | objective | student MSE, trained pairs | student MSE, held-out "
        "| held-out / trained |",
        "|---|---|---|---|---|",
    ]
    for name, r in held_out.items():
        if name not in seen:
            continue
        k = r["num_inference_steps"]
        mse = {
            which: {c["name"]: c for c in res["columns"]}[f"student@{k}"]["latent_mse"]
            for which, res in (("seen", seen[name]), ("held", r))
        }
        lines.append(
            f"| {k} | {name.split('-', 1)[1]} | {mse['seen']:.4f} | {mse['held']:.4f} | "
            f"{mse['held'] / mse['seen']:.2f} |"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/wandistill-bench-steps"))
    p.add_argument("--ks", default="1,2,4")
    p.add_argument("--objectives", default="perflow,unroll", help=f"of {','.join(OBJECTIVES)}")
    p.add_argument("--depths", default="full", help="comma list of " + ",".join(DEPTHS))
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument("--train-steps", type=int, default=None, help="default: the recipe's")
    p.add_argument("--set", dest="sets", action="append", default=[], help="recipe override")
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--teacher-blocks",
        type=int,
        default=2,
        help="blocks of the trained teacher (the demo's: 2; 4 gives a 2-block half-depth student)",
    )
    p.add_argument("--teacher", type=Path, help="a Wan teacher folder instead of the trained one")
    p.add_argument("--prompts", type=int, default=256, help="with --teacher: generic prompts")
    p.add_argument(
        "--seeds-per-prompt",
        type=int,
        default=1,
        help="trajectories per training prompt (each repeat of a prompt line gets its own noise)",
    )
    p.add_argument(
        "--train-gap",
        type=int,
        default=0,
        help="also score every student on this many training (prompt, noise) pairs",
    )
    args = p.parse_args()
    threads = f"{torch.get_num_threads()} torch threads"
    print(f"# {' '.join(sys.argv)}\n# {machine_line()}, {threads}", flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    sets = list(args.sets) + ([f"train.steps={args.train_steps}"] if args.train_steps else [])
    t0 = time.perf_counter()
    if args.teacher is None:
        from wandistill.teacher.trained import ensure_trained_teacher

        teacher = ensure_trained_teacher(
            args.work, seed=0, blocks=args.teacher_blocks, progress=False
        )
        prompts = grammar()
    else:
        teacher = args.teacher.absolute()
        prompts = [f"a photo of subject {i}" for i in range(args.prompts)]
    build_caches(args.work, teacher, prompts, args.eval_prompts, sets, args.seeds_per_prompt)
    if args.train_gap:
        build_seen_cache(args.work, teacher, args.train_gap, sets)
    print(f"# teacher + caches: {time.perf_counter() - t0:.1f} s", flush=True)
    baseline = train_one(args.work, "baseline", teacher, ["loss.output=1.0"], sets)
    results: dict[str, dict[str, Any]] = {}
    seen: dict[str, dict[str, Any]] = {}
    runs: dict[str, Path] = {}
    for depth in args.depths.split(","):
        for k in (int(x) for x in args.ks.split(",")):
            for obj in args.objectives.split(","):
                name = f"k{k}-{obj}" + ("" if depth == "full" else f"-{depth}")
                extra = [
                    f"student.num_inference_steps={k}",
                    *OBJECTIVES[obj],
                    *depth_sets(depth, args.teacher_blocks),
                ]
                run = train_one(args.work, name, teacher, extra, sets)
                results[name] = evaluate_one(args.work, run, teacher, baseline)
                if args.train_gap:
                    seen[name] = evaluate_one(args.work, run, teacher, baseline, "cache-seen")
                runs[name] = run
    for line in table(results) + ([""] + gap_table(results, seen) if seen else []):
        print(line)
    best = min(
        (n for n in results if results[n]["num_inference_steps"] == 4),
        key=lambda n: results[n]["r_k"],
        default=None,
    )
    timing = {}
    if best is not None:
        held_out = (args.work / "eval.txt").read_text().splitlines()[:8]
        timing = speed(args.work, runs[best], teacher, held_out)
        med, lo, hi = timing.pop("speedup_per_prompt")
        for name, t in timing.items():
            print(f"{name}: {t['seconds_per_sample']:.4f} s/sample, {t['forwards_per_sample']} fwd")
        print(f"speed-up, paired per prompt: {med:.1f}x, 95% {lo:.1f}-{hi:.1f}x")
        timing["speedup_per_prompt"] = [med, lo, hi]
    print(f"# peak RSS {max_rss_bytes() / 2**20:.0f} MiB", flush=True)
    if args.json:
        report = {"command": " ".join(sys.argv), "results": results, "trained_pairs": seen}
        write_json(args.json, {**report, "speed": timing})


if __name__ == "__main__":
    main()
