#!/usr/bin/env python
"""Ways of reading one training sample from a zarr cache, warm, in one run.

    python tests/bench/zarr_read.py --records 128 [--old-backend FILE] [--samples 400]

Writes a zarr cache of Wan 2.1 480p-shaped records (tests/bench/cache_io.py's generator), then
times `read_tensors(entry, i, {prompt_embeds, xt[step], teacher_out[step], timesteps[step]})`
over shuffled (record, step) samples, on 1 thread and on a 4-thread pool, page cache warm:

source     wandistill's ZarrSource (zarr-python: one gather per sample, CacheReader for shard
           indexes, small per-record arrays read once per shard entry)
sync       stock zarr-python, one synchronous `Array.__getitem__` per field (no caching)
old        a ZarrSource loaded from --old-backend FILE (e.g. the hand-written shard reader:
           `git show ce82c81:wandistill/cache/zarr_backend.py > /tmp/old_zarr.py`)
zarrs      `sync` with zarr.config codec_pipeline.path = zarrs.ZarrsCodecPipeline (if installed)
tensorstore  the same reads through TensorStore's zarr3 driver (if installed)

Columns: ms per sample of wall time and of process CPU time (all threads). Not a pytest test.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr

sys.path.insert(0, str(Path(__file__).parent))
from cache_io import make_records, write_cache  # noqa: E402

from wandistill.cache.zarr_backend import ZarrSource  # noqa: E402

Job = tuple[dict[str, Any], int, int]
FIELDS = ("prompt_embeds", "xt", "teacher_out", "timesteps")


def source_reader(src: Any) -> Callable[[Job], Any]:
    def read(job: Job) -> Any:
        e, i, s = job
        return src.read_tensors(e, i, {n: (None if n == "prompt_embeds" else s) for n in FIELDS})

    return read


def sync_reader(cache: Path) -> Callable[[Job], Any]:
    g = zarr.open_group(cache / "data.zarr", mode="r")
    arrs = {k: g[k] for k in ("xt", "teacher_out", "timesteps", "prompt_embeds/values")}
    offsets = g["prompt_embeds/offsets"]

    def read(job: Job) -> Any:
        e, i, s = job
        row = e["rows"][0] + i
        a, n = (int(x) for x in offsets[row])
        return [arrs["prompt_embeds/values"][a : a + n]] + [
            arrs[k][row, s] for k in ("xt", "teacher_out", "timesteps")
        ]

    return read


def tensorstore_reader(cache: Path) -> Callable[[Job], Any]:
    import tensorstore as ts

    ctx = ts.Context({"cache_pool": {"total_bytes_limit": 64 << 20}})

    def open_(path: str) -> Any:
        kvstore = {"driver": "file", "path": f"{cache}/data.zarr/{path}"}
        spec = {"driver": "zarr3", "kvstore": kvstore}
        return ts.open(spec, read=True, context=ctx).result()

    arrs = {k: open_(k) for k in ("xt", "teacher_out", "timesteps", "prompt_embeds/values")}
    offsets = open_("prompt_embeds/offsets")

    def read(job: Job) -> Any:
        e, i, s = job
        row = e["rows"][0] + i
        a, n = (int(x) for x in offsets[row].read().result())
        futures = [arrs["prompt_embeds/values"][a : a + n].read()] + [
            arrs[k][row, s].read() for k in ("xt", "teacher_out", "timesteps")
        ]
        return [f.result() for f in futures]

    return read


def timed(read: Callable[[Job], Any], jobs: list[Job], threads: int) -> tuple[float, float]:
    read(jobs[0])
    t, c = time.perf_counter(), time.process_time()
    if threads == 1:
        for job in jobs:
            read(job)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, jobs))
    n = len(jobs)
    return (time.perf_counter() - t) / n * 1e3, (time.process_time() - c) / n * 1e3


def load_old(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("old_zarr_backend", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module.ZarrSource


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=128)
    p.add_argument("--samples", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best is shown")
    p.add_argument("--old-backend", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="zarr-read-"))
    cache = out / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    write_cache(make_records(args.records, 8, torch.bfloat16, 0), cache, "zarr", torch.bfloat16, 64)
    entries = json.loads((cache / "manifest.json").read_text())["shards"]
    jobs = [(e, i, s) for e in entries for i in range(e["records"]) for s in range(8)]
    random.Random(0).shuffle(jobs)
    jobs = jobs[: args.samples]
    legs: dict[str, Callable[[], Callable[[Job], Any]]] = {
        "source": lambda: source_reader(ZarrSource(cache)),
        "sync": lambda: sync_reader(cache),
    }
    if args.old_backend:
        legs["old"] = lambda: source_reader(load_old(args.old_backend)(cache))
    if importlib.util.find_spec("zarrs"):
        legs["zarrs"] = lambda: sync_reader(cache)
    if importlib.util.find_spec("tensorstore"):
        legs["tensorstore"] = lambda: tensorstore_reader(cache)
    best: dict[tuple[str, int], tuple[float, float]] = {}
    for _ in range(args.rounds):
        for name, make in legs.items():
            pipeline = "zarrs.ZarrsCodecPipeline" if name == "zarrs" else None
            with zarr.config.set({"codec_pipeline.path": pipeline} if pipeline else {}):
                read = make()
                for threads in (1, 4):
                    got = timed(read, jobs, threads)
                    old = best.get((name, threads), (np.inf, np.inf))
                    best[(name, threads)] = (min(old[0], got[0]), min(old[1], got[1]))
    print(f"command: {' '.join(sys.argv)}")
    print(f"{args.records} records, {len(jobs)} samples, zarr {zarr.__version__}, warm")
    print(f"{'leg':12s} {'threads':>7s} {'wall ms/sample':>15s} {'CPU ms/sample':>14s}")
    for (name, threads), (wall, cpu) in best.items():
        print(f"{name:12s} {threads:7d} {wall:15.2f} {cpu:14.2f}")
    if args.out is None:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
