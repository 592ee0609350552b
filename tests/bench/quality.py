#!/usr/bin/env python
"""Quality benchmark: offline distillation from the cache vs online distillation, same budget.

    python tests/bench/quality.py [--steps 1000] [--seeds 2] [--legs a,b,b2] [--json FILE]

On the tiny teacher, one cache is built with `wandistill.precompute.run` (timed: the cache build
time), then the same student (config, init seed, batch, steps, optimizer, LR schedule, EMA, loss)
is trained by each leg of tests/bench/train.py, in a fresh subprocess each:

(a)  offline: `wandistill.train.run` on the cache (the finite set of recorded trajectories, one
     fixed noise per prompt, reused every epoch);
(b)  online: the teacher in the loop; every step draws B training prompts with fresh noise,
     encodes them, runs the teacher's CFG sampler through the whole trajectory and keeps one
     random recorded step of each (plus its final latent);
(b2) online, trajectory-shared: B / S fresh trajectories per step, all S recorded steps used.

(train.py's docstring has the details.) The online legs draw from the same training prompts as
the cache (held-out prompts excluded) with the same sampler settings, so the only difference in
what they learn from is fresh noise every step instead of the cache's fixed noise.

Every trained student (`<run>/student`, written by `save_pretrained`, and `<run>/student_ema`)
is scored by `wandistill.eval.run.evaluate` on the same held-out records of the cache: the
student's own sampler from each record's cached noise and embedding, against the teacher's cached
final latent (latent MSE / PSNR), and the student's output at the recorded (x_t, t) against the
teacher's guided output (step loss). Defaults are the demo's recipe (pipelines/tiny.toml: 64x64,
8 steps, CFG 5, a 1-block student, batch 16, 1000 steps); every leg runs once per --seeds value
(student init and data order / online draws), and figures are averaged over seeds.

Targets (issue 5, item 4): held-out latent MSE of (a) within 5% of (b)'s, at >= 3x less wall time
per step. Also reported: the cache build time and the break-even number of epochs E* (passes over
the N training samples) from which precompute + offline costs less wall time than online:
T_cache + E * (N / B) * t_a = E * (N / B) * t_b, i.e. E* = T_cache / ((N / B) * (t_b - t_a)).

Not a pytest test (tests/bench is excluded from collection).
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from harness import write_json  # tests/bench, next to this script


def load_train_bench() -> ModuleType:
    """tests/bench/train.py (legs, batch sources, cache build), imported by path."""
    path = Path(__file__).resolve().with_name("train.py")
    spec = importlib.util.spec_from_file_location("wandistill_bench_train", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def scores(run: Path, cache: Path) -> dict[str, Any]:
    from wandistill.eval.run import evaluate
    from wandistill.student.folders import read_run

    out: dict[str, Any] = {}
    for name in ("student", "student_ema"):
        student = read_run(run, ema=name == "student_ema")  # evaluate takes the typed run
        out_dir = run.parent / f"eval-{run.name}-{name}"  # eval never writes inside its --run
        ev = evaluate(cache, student, out_dir, teacher=None, split="holdout")
        out[name] = {
            "records": ev.records,
            "latent_mse": ev.latent_mse,
            "latent_psnr": ev.latent_psnr,
            "step_loss": ev.step_loss,
            "noise_mse": ev.noise_mse,
        }
    return out


def main() -> None:
    tb = load_train_bench()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    tb.add_common(p)
    p.set_defaults(height=64, width=64, layers=1, heads=2, head_dim=12, ffn=64)
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps per leg")
    p.add_argument("--seeds", type=int, default=2, help="runs per leg (train seeds 0..N-1)")
    p.add_argument("--legs", default="a,b,b2")
    args = p.parse_args()
    legs = [x.strip() for x in args.legs.split(",") if x.strip()]
    if unknown := [x for x in legs if x not in ("a", "b", "b2")]:
        raise SystemExit(f"unknown legs {unknown}; choose from a, b, b2")
    torch.set_num_threads(args.threads)  # evaluation runs here, with the legs' thread count
    work = args.work or Path(tempfile.mkdtemp(prefix="wandistill-bench-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        cache = tb.build_cache(args, work)
        print(
            f"  cache: {cache['records']} records, {cache['train_samples']} training samples, "
            f"built in {cache['seconds']:.1f} s",
            flush=True,
        )
        runs: dict[str, list[dict[str, Any]]] = {leg: [] for leg in legs}
        for seed in range(args.seeds):
            for leg in legs:
                a = argparse.Namespace(**{**vars(args), "seed": seed})
                out = work / f"run-{leg}-s{seed}"
                res = tb.spawn_leg(
                    leg, tb.train_overrides(a, work / "cache", out), work, f"{leg}-s{seed}", a
                )
                res["seed"] = seed
                res["eval"] = scores(out, work / "cache")
                runs[leg].append(res)
                ev = res["eval"]["student"]
                print(
                    f"  seed {seed} {leg:>2}: {res['steady']['step_ms']:.1f} ms/step, held-out "
                    f"latent MSE {ev['latent_mse']:.5f}, step loss {ev['step_loss']:.5f}, "
                    f"others {res['others_cores']:.2f} cores",
                    flush=True,
                )
                shutil.rmtree(out, ignore_errors=True)
        report(tb, args, cache, runs, time.perf_counter() - t0)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def mean_of(rs: list[dict[str, Any]], which: str, key: str) -> float:
    return statistics.mean(r["eval"][which][key] for r in rs)


def report(
    tb: ModuleType,
    args: argparse.Namespace,
    cache: dict[str, Any],
    runs: dict[str, list[dict[str, Any]]],
    total: float,
) -> None:
    for line in tb.describe_setup(args, cache):
        print(line)
    samples_per_epoch = cache["train_samples"]
    steps_per_epoch = samples_per_epoch / args.batch_size
    print(
        f"# {args.steps} steps per leg = {args.steps / steps_per_epoch:.1f} epochs of the cache's "
        f"{samples_per_epoch} training samples; seeds 0..{args.seeds - 1}; held-out records: "
        f"{runs[next(iter(runs))][0]['eval']['student']['records']}; bench wall {total:.0f} s"
    )
    noise = runs[next(iter(runs))][0]["eval"]["student"]["noise_mse"]
    print(f"# do-nothing baseline (initial noise vs teacher final latent): latent MSE {noise:.5f}")
    print(
        f"{'leg':<36}{'ms/step':>9}{'latent MSE':>12}{'PSNR dB':>9}{'step loss':>11}"
        f"{'EMA MSE':>10}{'MSE per seed':>22}"
    )
    legs: dict[str, dict[str, Any]] = {}
    for leg, rs in runs.items():
        s = tb.pooled(rs)
        fig = {
            "step_s": s["seconds"] / s["steps"],
            "median_window_step_s": 1 / s["median_window"],
            "wait_frac": s["wait_frac"],
            "latent_mse": mean_of(rs, "student", "latent_mse"),
            "latent_psnr": mean_of(rs, "student", "latent_psnr"),
            "step_loss": mean_of(rs, "student", "step_loss"),
            "ema_latent_mse": mean_of(rs, "student_ema", "latent_mse"),
            "ema_step_loss": mean_of(rs, "student_ema", "step_loss"),
            "per_seed_mse": [r["eval"]["student"]["latent_mse"] for r in rs],
            "startup_s": statistics.mean(r.get("online_startup_s", 0.0) for r in rs),
        }
        legs[leg] = fig
        per_seed = " / ".join(f"{x:.5f}" for x in fig["per_seed_mse"])
        print(
            f"({leg}) {tb.LEGS[leg]:<31}{1e3 * fig['step_s']:>9.1f}{fig['latent_mse']:>12.5f}"
            f"{fig['latent_psnr']:>9.2f}{fig['step_loss']:>11.5f}{fig['ema_latent_mse']:>10.5f}"
            f"{per_seed:>22}"
        )
    print(
        "ms/step: steady mean over seeds (fit's step time, teacher included for (b)/(b2)); MSE, "
        "PSNR, step loss: held-out,\nraw student, mean over seeds; EMA MSE: the same for "
        "student_ema"
    )
    figures: dict[str, Any] = {"cache": cache, "legs": legs, "runs": runs}
    if "a" in legs:
        a = legs["a"]
        t_cache = cache["seconds"]
        print(
            f"cache build (precompute, {cache['records']} prompts, no previews): {t_cache:.1f} s = "
            f"{t_cache / a['step_s']:.0f} offline steps"
        )
        for leg in ("b", "b2"):
            if leg not in legs:
                continue
            o = legs[leg]
            rel = (a["latent_mse"] - o["latent_mse"]) / o["latent_mse"]
            rel_step = (a["step_loss"] - o["step_loss"]) / o["step_loss"]
            rel_ema = (a["ema_latent_mse"] - o["ema_latent_mse"]) / o["ema_latent_mse"]
            speed = o["step_s"] / a["step_s"]
            gap = o["step_s"] - a["step_s"]
            breakeven = t_cache / (steps_per_epoch * gap) if gap > 0 else float("inf")
            credited = max(0.0, t_cache - o["startup_s"])  # online loads the teacher too
            breakeven_credited = credited / (steps_per_epoch * gap) if gap > 0 else float("inf")
            figures[f"a_vs_{leg}"] = {
                "latent_mse_rel": rel,
                "step_loss_rel": rel_step,
                "ema_latent_mse_rel": rel_ema,
                "time_per_step_ratio": speed,
                "breakeven_epochs": breakeven,
                "breakeven_epochs_credited": breakeven_credited,
                "online_startup_s": o["startup_s"],
            }
            verdict_q = "met" if rel <= 0.05 else "MISSED"
            verdict_t = "met" if speed >= 3 else "MISSED"
            print(
                f"(a) vs ({leg}): held-out latent MSE {100 * rel:+.1f}% (target <= +5%: "
                f"{verdict_q}); step loss {100 * rel_step:+.1f}%; EMA latent MSE "
                f"{100 * rel_ema:+.1f}%"
            )
            print(
                f"(a) vs ({leg}): wall time per step {speed:.2f}x less (target >= 3x: {verdict_t});"
                f" break-even after {breakeven:.2f} epochs ({breakeven * steps_per_epoch:.0f} "
                "steps): beyond that, precompute + offline takes less wall time than online"
            )
            print(
                f"    crediting online's own start-up ({o['startup_s']:.1f} s: teacher load + "
                f"negative prompt): break-even after {breakeven_credited:.2f} epochs"
            )
    if args.json:
        write_json(args.json, {"command": " ".join(sys.argv), "args": vars(args), **figures})


if __name__ == "__main__":
    main()
