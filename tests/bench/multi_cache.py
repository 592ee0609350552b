#!/usr/bin/env python
"""Several caches as one dataset vs one cache of the same records: train steps/s and reader
samples/s (issue 29; target: the several-cache leg >= 0.95x the one-cache leg).

    python tests/bench/multi_cache.py [--records 240] [--caches 2] [--rounds 5] [--steps 30]
                                      [--batch 8] [--json FILE]

The same synthetic records (tests/cachefixtures.py: ragged embeddings, 3 recorded steps) are
written once as one cache and once split over `--caches` caches, all of `--backend`. Each round
runs both legs back to back, alternating which goes first: an in-process `wandistill.train.run`
of `--steps` steps (the tiny student of the unit tests, CPU, one rank; steps/s after the first
step) and `--reader-epochs` passes of the TrainingReader alone (samples/s; where several caches
cost most: a mixed batch is read per cache and copied into place). The ratio is several / one
per round; the median and the spread (min..max) are reported, as the box is shared.
Not a pytest test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from harness import environment, machine_line, paired_ratios, write_json  # noqa: E402  (tests/bench)

from wandistill.cache.training import TrainingReader  # noqa: E402
from wandistill.config import load_recipe  # noqa: E402
from wandistill.train import run  # noqa: E402
from wandistill.train.metrics import read_metrics  # noqa: E402

from cachefixtures import write_cache  # noqa: E402

SIZES = (
    "student.num_layers=1",
    "student.num_attention_heads=2",
    "student.attention_head_dim=12",
    "student.ffn_dim=32",
)


def build(work: Path, records: int, caches: int, backend: str) -> tuple[list[Path], list[Path]]:
    """(the one cache, the several caches), holding the same records."""
    one = work / "one"
    write_cache(one, range(records), shard_records=16, backend=backend)
    bounds = [records * i // caches for i in range(caches + 1)]
    several = []
    for i in range(caches):
        path = work / f"part{i}"
        write_cache(path, range(bounds[i], bounds[i + 1]), shard_records=16, backend=backend)
        several.append(path)
    return [one], several


def train_leg(caches: list[Path], out: Path, steps: int, batch: int) -> float:
    """Optimizer steps per second of an in-process train run, its first step excluded."""
    listed = ", ".join(f'"{c}"' for c in caches)
    sets = [
        f"cache=[{listed}]",
        f'out="{out}"',
        f"steps={steps}",
        f"batch_size={batch}",
        f"checkpoint_every={steps}",
        "log_every=1",
        "data_threads=2",
        'device="cpu"',
        "tensorboard=false",
        *SIZES,
    ]
    run(load_recipe(None, sets, stage="train").train)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    times = [r["time"] for r in read_metrics(out) if "loss" in r]
    return (len(times) - 1) / (times[-1] - times[0])


def reader_leg(caches: list[Path], batch: int, epochs: int) -> float:
    """Samples per second of `epochs` epochs of the reader alone."""
    reader = TrainingReader(caches, batch_size=batch, num_threads=2, pad="batch")
    n = reader.batches_per_epoch() * epochs
    t0 = time.perf_counter()
    it = iter(reader)
    for _ in range(n):
        next(it)
    it.close()
    return n * batch / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--records", type=int, default=240)
    p.add_argument("--caches", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--reader-epochs", type=int, default=5)
    p.add_argument("--backend", choices=("webdataset", "zarr"), default="webdataset")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    legs: dict[str, dict[str, list[float]]] = {
        "train": {"one": [], "several": []},
        "reader": {"one": [], "several": []},
    }
    with tempfile.TemporaryDirectory(prefix="wandistill-multicache-") as tmp:
        work = Path(tmp)
        sources = dict(
            zip(
                ("one", "several"),
                build(work, args.records, args.caches, args.backend),
                strict=True,
            )
        )
        for r in range(args.rounds):
            order = ["one", "several"] if r % 2 == 0 else ["several", "one"]
            for name in order:
                out = work / f"run-{name}-{r}"
                legs["train"][name].append(train_leg(sources[name], out, args.steps, args.batch))
                legs["reader"][name].append(
                    reader_leg(sources[name], args.batch, args.reader_epochs)
                )
    result: dict[str, Any] = {
        "args": vars(args) | {"json": str(args.json) if args.json else None},
        "machine": environment(),
    }
    for what, by in legs.items():
        ratios = paired_ratios(by["several"], by["one"])
        result[what] = {
            "one_per_s": statistics.median(by["one"]),
            "several_per_s": statistics.median(by["several"]),
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "ratios": ratios,
        }
        got = result[what]
        print(
            f"{what}: one cache {got['one_per_s']:.2f}/s, {args.caches} caches "
            f"{got['several_per_s']:.2f}/s; ratio median {got['ratio_median']:.3f} "
            f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {args.rounds} rounds)"
        )
    print(machine_line())
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
