"""Benchmark: `wandistill eval`'s peak memory does not grow with the number of records it scores.

One cache of the tiny teacher (`make_tiny_teacher`: random weights, so cheap) holds 100n records,
n = 26 (the held-out records of `wandistill demo`'s own cache), at the demo's frame size (64x64, 1
frame) with a 4-step sampler recording every step: each record carries its whole trajectory as the
demo's do, only fewer steps of it. A 2-step training run gives the student. Then, for n, 10n and
100n records (`--max-records`, `--split all`: the cache as a separate eval cache), a fresh process
runs `evaluate` and reports its peak RSS (ru_maxrss) and seconds. `--repo` adds the same
measurement with another checkout's wandistill (the baseline: the eval before streaming).

    python tests/bench/eval_memory.py --repo /tmp/eval-base   # this checkout and a baseline one
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import MiB, machine_line, max_rss_bytes, write_json  # tests/bench, next to this script

REPO = Path(__file__).parents[2]
DEMO_HELD_OUT = 26


def child(cache: Path, run: Path, out: Path, records: int) -> dict:
    import torch

    from wandistill.eval.run import evaluate
    from wandistill.student.folders import read_run

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    result = evaluate(cache, read_run(run), out, split="all", max_records=records, warn=print)
    return {
        "records": result.records,
        "seconds": time.perf_counter() - t0,
        "peak_rss_mib": max_rss_bytes() / MiB,
        "latent_mse": result.latent_mse,
    }


def build(work: Path, n: int) -> tuple[Path, Path]:
    """The cache (n prompts, 1-frame 64x64, 4 steps, every step recorded) and a student run."""
    import torch

    from wandistill.config import load_recipe
    from wandistill.precompute.run import run as precompute
    from wandistill.teacher.tiny import make_tiny_teacher
    from wandistill.train import run as train

    torch.set_num_threads(1)
    teacher = make_tiny_teacher(work / "teacher")
    prompts = work / "prompts.txt"
    prompts.write_text("".join(f"a small red fox number {i} runs\n" for i in range(n)))
    cache, run = work / "cache", work / "run"
    cfg = load_recipe(
        REPO / "pipelines" / "tiny.toml",
        [
            f'precompute.teacher.path="{teacher}"',
            f'precompute.prompts="{prompts}"',
            f'precompute.cache.path="{cache}"',
            f'train.cache="{cache}"',
            f'train.out="{run}"',
            "precompute.previews=0",
            "precompute.sampler.num_inference_steps=4",
            "precompute.sampler.batch_size=64",
            "precompute.cache.shard_records=256",
            "train.steps=2",
            "train.checkpoint_every=2",
            'train.device="cpu"',
        ],
    )
    precompute(cfg.precompute, quiet=True)
    train(cfg.train)
    return cache, run


def measure(repo: Path, cache: Path, run: Path, records: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="wandistill-evalmem-") as out:
        got = subprocess.run(
            [sys.executable, __file__, "--child", str(cache), str(run), out, str(records)],
            cwd=repo,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)},
            capture_output=True,
            text=True,
            check=False,
        )
    if got.returncode != 0:
        raise SystemExit(f"eval of {records} records with {repo} failed:\n{got.stderr[-3000:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=DEMO_HELD_OUT)
    ap.add_argument("--times", type=int, nargs="+", default=[1, 10, 100])
    ap.add_argument("--repo", type=Path, action="append", default=[], help="baseline checkout")
    ap.add_argument("--work", type=Path, help="keep the cache and run here (default: a temp dir)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--child", nargs=4, metavar=("CACHE", "RUN", "OUT", "RECORDS"))
    args = ap.parse_args()
    if args.child:
        cache, run, out, records = args.child
        print(json.dumps(child(Path(cache), Path(run), Path(out) / "eval", int(records))))
        return
    print(machine_line())
    with tempfile.TemporaryDirectory(prefix="wandistill-evalmem-") as tmp:
        work = args.work or Path(tmp)
        cache, run = (
            (work / "cache", work / "run")
            if (work / "run").exists()
            else build(work, args.n * max(args.times))
        )
        found: dict[str, list[dict[str, Any]]] = {}
        for repo in [REPO, *args.repo]:
            rows = found[str(repo)] = [measure(repo, cache, run, args.n * t) for t in args.times]
            base = rows[0]["peak_rss_mib"]
            for r in rows:
                print(
                    f"{str(repo):24s} {r['records']:>6d} records: peak RSS "
                    f"{r['peak_rss_mib']:7.1f} MiB ({(r['peak_rss_mib'] / base - 1) * 100:+6.1f}% "
                    f"vs {rows[0]['records']}), {r['seconds']:6.1f} s, latent MSE "
                    f"{r['latent_mse']:.6f}"
                )
    if args.json:
        write_json(args.json, {"command": " ".join(sys.argv), "rows_by_checkout": found})


if __name__ == "__main__":
    main()
