"""Benchmark: the background cache writer (issue 11.4), two ratios against their baselines.

(1) Writing overhead: `precompute` into a webdataset cache (records written by the background
    thread while the next batch denoises) vs the same run with `null_sink=True` (records made,
    then discarded); and, for reference, the same run with the writes on the critical path
    (`synchronous`, the writer as it was before issue 11.4), and the same run with the cache
    created and finalised but every record dropped by the writer (`cache_only`: the fixed cost
    of a cache, manifest, shared tensors, embeddings, journals, all fsynced, that no writer
    thread can hide). The setting is 480p-shaped latents
    (480x832, a few frames) with the tiny teacher and 1-2 steps, so that writing is a real share
    of the work; that share is printed too: the time to write the run's records synchronously /
    the null-sink run's time.
(2) Writer throughput: the same records through `CacheWriter` (each record's safetensors
    member streamed into the tar, crc32c per tensor / step row, the shard's frame sha256, fsync
    and journal commit per shard) vs the plain baseline of one `safetensors.torch.save_file` +
    fsync per record, in bytes/s.

Targets: (1) overhead <= 3% where the writing share is >= 10%; (2) ratio >= 0.8x.

Every leg first touches and frees 4 GiB (`cache_io.prefault`; `--no-prefault` turns it off), so
that no leg pays a VM host's faults for memory an earlier leg freed.

    python tests/bench/precompute_write.py --prompts 32 --frames 5 --steps 1 --repeats 3

`--json FILE` also writes every leg's runs and the verdict figures (`verdict`: writing_share,
overhead_vs_null_sink, overhead_interval, writer_vs_safetensors_fsync, as fractions and a ratio),
which tests/bench/gpu.py reads.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from cache_io import prefault  # tests/bench, next to this script
from harness import bootstrap_interval, machine_line, write_json

from wandistill.cache.background import BackgroundWriter as _BACKGROUND


class _CacheOnly:
    """The `BackgroundWriter` interface over a writer that drops every record (`cache_only`)."""

    def __init__(self, writer, depth: int = 0) -> None:  # noqa: ANN001
        self.writer = writer
        self.records_written = self.records_skipped = self.bytes_written = 0

    def write(self, record) -> None:  # noqa: ANN001
        self.records_written += 1

    def drain(self) -> None:
        pass

    def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        self.writer.abort()


class _Synchronous:
    """The `BackgroundWriter` interface without the thread: the writes on the critical path,
    as before issue 11.4 (the `synchronous` leg)."""

    def __init__(self, writer, depth: int = 0) -> None:  # noqa: ANN001
        self.writer = writer

    def __getattr__(self, name: str):  # noqa: ANN204 - write, close, abort, counters
        return getattr(self.writer, name)

    def drain(self) -> None:
        pass


WRITERS = ("null_sink", "background", "synchronous", "cache_only")
"""The precompute legs, by how records are written (see the module docstring)."""

PREFAULT_BYTES = 4 << 30
"""Memory touched and freed before each leg: more than a leg's run allocates and writes."""


def precompute(teacher: Path, prompts: Path, args: argparse.Namespace, cache: Path,
               null_sink: bool, leg: str = "background") -> float:  # fmt: skip
    from wandistill.config import load_recipe
    from wandistill.precompute.run import run

    # The module itself: `import wandistill.precompute.run as module` gives the package's `run`
    # attribute, which is this function, not the module (an earlier version of this bench
    # patched that function, so every leg but null_sink ran the real background writer).
    module = sys.modules["wandistill.precompute.run"]
    writers = {"synchronous": _Synchronous, "cache_only": _CacheOnly}
    module.BackgroundWriter = writers.get(leg, _BACKGROUND)  # type: ignore[attr-defined]
    cfg = load_recipe(
        None,
        [
            f'teacher.path="{teacher}"',
            f'prompts="{prompts}"',
            f'cache.path="{cache}"',
            f"sampler.num_inference_steps={args.steps}",
            f"sampler.batch_size={args.batch_size}",
            f"sampler.height={args.height}",
            f"sampler.width={args.width}",
            f"sampler.num_frames={args.frames}",
            f"sampler.guidance_scale={args.guidance}",
            "sampler.max_sequence_length=32",
            f"cache.shard_records={args.shard_records}",
            f'cache.backend="{args.backend}"',
            f'cache.store_dtype="{args.store_dtype}"',
        ],
        stage="precompute",
    ).precompute
    t0 = time.perf_counter()
    run(cfg, null_sink=null_sink, quiet=True)
    return time.perf_counter() - t0


def read_records(cache: Path) -> list:
    from wandistill.cache.reader import CacheReader

    with CacheReader(cache) as store:
        return [store.read_record(*where) for where in store.locate().values()]


def write_ours(records: list, like: Path, out: Path, shard_records: int) -> float:
    """The records through CacheWriter, synchronously (the thread's own work), into a cache with
    `like`'s header."""
    from wandistill.cache import manifest as mf
    from wandistill.cache.writer import CacheWriter

    m = mf.load_committed(like)
    t0 = time.perf_counter()
    w = CacheWriter(
        out,
        backend=m.backend,
        **{name: m.block_json(name) for name in ("teacher", "settings", "fields", "dims")},
        numerics=m.numerics,
        rank=0,
        shard_records=shard_records,
    )
    for r in records:
        w.write(r)
    w.close()
    return time.perf_counter() - t0


def write_baseline(records: list, out: Path) -> float:
    """One safetensors file per record, fsynced: what a user writes by hand."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    t0 = time.perf_counter()
    for r in records:
        path = out / f"{r.key}.safetensors"
        save_file(r.tensors(), str(path))
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    dfd = os.open(out, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--frames", type=int, default=5)
    p.add_argument("--height", type=int, default=480, help="480p-shaped latents by default")
    p.add_argument("--width", type=int, default=832, help="(gpu.py --smoke: toy sizes)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--guidance", type=float, default=1.0, help="1.0: no CFG, half the compute")
    p.add_argument("--shard-records", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="best of N for each leg")
    p.add_argument(
        "--no-prefault",
        dest="prefault",
        action="store_false",
        help="do not touch free memory before each leg (see cache_io.prefault)",
    )
    p.add_argument("--work", type=Path, help="scratch folder on the disk to measure")
    p.add_argument("--backend", choices=("webdataset", "zarr"), default="webdataset")
    p.add_argument(
        "--store-dtype",
        default="model",
        help="cache.store_dtype: model, fp32, bf16, fp16 or fp8 (the writer thread converts)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for the teacher (default 1: on a GPU box the teacher's "
        "compute leaves the host's cores to the writer; on a 2-core CPU box one core models "
        "that; with every core in the teacher's OpenMP pool the writer thread's wakeups stall "
        "its barriers, see docs/benchmarks-history.md)",
    )
    p.add_argument(
        "--legs",
        default="null_sink,background,synchronous,cache_only",
        help="precompute legs to run (null_sink and background are needed; synchronous and "
        "cache_only are for reference)",
    )
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)  # argv: gpu.py calls it in its own process
    run_legs = tuple(args.legs.split(","))
    if not {"null_sink", "background"} <= set(run_legs) or not set(run_legs) <= set(WRITERS):
        p.error(f"--legs: null_sink and background, plus any of {', '.join(WRITERS)}")
    torch.set_num_threads(args.threads)
    if args.work is not None:  # --work may name a folder not made yet
        args.work.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="wandistill-bench-write-", dir=args.work))
    try:
        from wandistill.teacher.tiny import make_tiny_teacher

        teacher = make_tiny_teacher(work / "teacher")
        prompts = work / "prompts.txt"
        prompts.write_text("".join(f"prompt {i}: a cat and a dog\n" for i in range(args.prompts)))
        runs: dict[str, list[float]] = {}
        keep = work / "kept"
        faults: dict[str, list[int]] = {}
        for r in range(args.repeats):  # interleaved, so load drifts hit every leg alike
            # Each round starts with another leg: a leg right after one that freed a cache's
            # worth of page cache touches memory the VM's host has taken back (see the docs).
            k = r % len(run_legs)
            for name in run_legs[k:] + run_legs[:k]:
                target = work / f"{name}-{r}"
                if args.prefault:  # every leg on memory the VM's host backs (cache_io.prefault)
                    prefault(PREFAULT_BYTES)
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t = precompute(teacher, prompts, args, target, name == "null_sink", name)
                faults.setdefault(name, []).append(
                    resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
                )
                runs.setdefault(name, []).append(t)
                if name == "background" and not keep.exists():
                    target.rename(keep)
                shutil.rmtree(target, ignore_errors=True)
        records = read_records(keep)
        nbytes = sum(t.numel() * t.element_size() for r in records for t in r.tensors().values())
        for r in range(args.repeats):
            for name in ("cache_writer", "safetensors_fsync"):
                target = work / f"{name}-{r}"
                if args.prefault:
                    prefault(PREFAULT_BYTES)
                if name == "cache_writer":
                    t = write_ours(records, keep, target, args.shard_records)
                else:
                    t = write_baseline(records, target)
                runs.setdefault(name, []).append(t)
                shutil.rmtree(target, ignore_errors=True)
        legs = {name: min(ts) for name, ts in runs.items()}
        print(f"# {' '.join(sys.argv)}")
        print(f"# {machine_line()}")
        print(
            f"# {args.prompts} prompts, {args.steps} steps, guidance {args.guidance}, "
            f"batch {args.batch_size}, backend {args.backend}, store {args.store_dtype}, "
            f"{args.height}x{args.width}x{args.frames}, "
            f"{nbytes / len(records) / 2**20:.1f} MiB of tensors per record, "
            f"shard_records {args.shard_records}, best of {args.repeats}"
        )
        print(f"{'leg':<20}{'best s':>10}{'median s':>10}{'minor faults':>14}  runs (s)")
        for name, ts in runs.items():
            flt = f"{statistics.median(faults[name]):>14.0f}" if name in faults else " " * 14
            every = " / ".join(f"{t:.3f}" for t in ts)
            print(f"{name:<20}{min(ts):>10.3f}{statistics.median(ts):>10.3f}{flt}  {every}")
        share = legs["cache_writer"] / (legs["null_sink"] + legs["cache_writer"])
        overhead = legs["background"] / legs["null_sink"] - 1
        print(f"writing share of the work (synchronous): {share * 100:.1f}% (needs >= 10%)")
        print(f"writing overhead vs null sink: {overhead * 100:+.1f}% (target <= 3%)")
        if "synchronous" in legs:
            sync = legs["synchronous"] / legs["null_sink"] - 1
            print(f"  (synchronous writes, as before: {sync * 100:+.1f}%)")
        if "cache_only" in legs:
            fixed = legs["cache_only"] / legs["null_sink"] - 1
            print(f"  (of which a cache's fixed cost, no record written: {fixed * 100:+.1f}%)")
        med = {name: statistics.median(ts) for name, ts in runs.items()}
        compared = [n for n in run_legs if n != "null_sink"]
        rel = ", ".join(f"{n} {100 * (med[n] / med['null_sink'] - 1):+.1f}%" for n in compared)
        print(f"  (medians vs null sink: {rel})")

        def paired(name: str) -> list[float]:
            """Each round's leg / null sink of the same round: a round's legs ran back to back,
            so the machine's drift between rounds cancels."""
            return [a / b for a, b in zip(runs[name], runs["null_sink"], strict=True)]

        def paired_median(name: str) -> float:
            return statistics.median(paired(name)) - 1

        each = ", ".join(f"{n} {100 * paired_median(n):+.1f}%" for n in compared)
        print(f"  (paired: median over rounds of leg / null sink of the same round: {each})")
        lo, hi = (x - 1 for x in bootstrap_interval(paired("background")))  # an overhead
        print(f"  (background, paired median's bootstrap 95% interval: {lo:+.1%} to {hi:+.1%})")
        ratio = legs["safetensors_fsync"] / legs["cache_writer"]
        print(
            f"writer throughput vs per-record safetensors + fsync: {ratio:.2f}x "
            f"({nbytes / legs['cache_writer'] / 2**20:.0f} vs "
            f"{nbytes / legs['safetensors_fsync'] / 2**20:.0f} MiB/s; target >= 0.8x)"
        )
        if args.json:
            verdict = {
                "writing_share": share,
                "overhead_vs_null_sink": overhead,
                "overhead_interval": [lo, hi],
                "writer_vs_safetensors_fsync": ratio,
                **{f"{n}_overhead": legs[n] / legs["null_sink"] - 1 for n in compared},
                **{f"{n}_paired_median_overhead": paired_median(n) for n in compared},
            }
            settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
            write_json(
                args.json,
                {
                    "command": " ".join(
                        ["tests/bench/precompute_write.py", *(argv or sys.argv[1:])]
                    ),
                    "settings": {k: v for k, v in settings.items() if k != "json"},
                    "bytes_per_record": nbytes / len(records),
                    "best_s": legs,
                    "median_s": med,
                    "runs_s": runs,
                    "minor_faults": faults,
                    "verdict": verdict,
                },
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
