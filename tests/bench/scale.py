#!/usr/bin/env python
"""Costs that must grow linearly (or not at all) with the size of a cache: n against 4n.

    python tests/bench/scale.py --shards 1000 --work /tmp/scale [--out DIR]

Each leg runs at n and at 4n in the same run and prints the ratio: ~4 is linear, ~16 quadratic,
~1 bounded. Synthetic caches: the entries of a real 8-record cache copied under new names and
keys, so no records are written for the manifest legs.

manifest     `load_committed` of a finalized cache of n four-record shards
follow       a `CacheReader` polling a running cache whose journal gains 50 shards per poll:
             total refresh time (n/50 polls: ~16 is linear per poll), and the last poll's
keyindex     `NameIndex.add` of 100n record keys (the writer's and the embedding store's index)
epoch plan   bytes a TrainingReader holds per (record, step) sample for an epoch's order
             (tracemalloc; the permutation tensor counted too)
open files   file descriptors left open after reading one sample from each of n/4 shards

With --out, `results.json` / `results.md` with the machine go there (tests/bench/harness.py).
Timed legs: best of --repeats (the heap's garbage collections make single runs noisy). The
script also runs on a checkout from before the 2026-11-27 fixes (`git worktree add`), for the
before/after table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for cachefixtures

from harness import Report, environment  # noqa: E402

from wandistill.cache import journal as jn  # noqa: E402
from wandistill.cache import manifest as mf  # noqa: E402
from wandistill.cache.files import Entries  # noqa: E402
from wandistill.cache.keyindex import NameIndex  # noqa: E402
from wandistill.cache.reader import CacheReader  # noqa: E402
from wandistill.cache.seal import seal_entry  # noqa: E402
from wandistill.io.storage import open_storage  # noqa: E402

from cachefixtures import write_cache  # noqa: E402


def entries(base: Path, n: int) -> list[dict]:
    """n sealed shard entries: copies of `base`'s, each with its own name and keys."""
    real = mf.read_manifest(base).shards.json_list()
    out = []
    for j in range(n):
        e = copy.deepcopy(real[j % len(real)])
        e.pop(mf.ENTRY_DIGEST, None)
        e["name"] = f"r00000-{j:06d}"
        e["keys"] = [f"{j:024x}{i:08x}" for i in range(len(e["keys"]))]
        out.append(seal_entry(e))
    return out


def cache_of(base: Path, path: Path, shards: list[dict]) -> Path:
    shutil.copytree(base, path)
    m = mf.read_manifest(path)
    m.shards = Entries(m.shards.model, shards)
    mf.write_manifest(open_storage(path), m)
    return path


def manifest_leg(base: Path, work: Path, n: int) -> float:
    path = cache_of(base, work / f"m{n}", entries(base, n))
    t = time.perf_counter()
    mf.load_committed(path)
    t = time.perf_counter() - t
    shutil.rmtree(path)
    return t


def follow_leg(base: Path, work: Path, n: int, per_poll: int = 50) -> tuple[float, float]:
    path = cache_of(base, work / f"f{n}", [])
    m = mf.read_manifest(path)
    m.complete = False
    mf.write_manifest(open_storage(path), m)
    chunks = [jn.entry_json(e) for e in entries(base, n)]
    store, total, last, seg, start, size = None, 0.0, 0.0, 0, 0, 0
    limit = getattr(jn, "JOURNAL_SEGMENT_BYTES", None)  # None: before segments (2026-11-27)
    for upto in range(per_poll, n + 1, per_poll):
        for k in range(upto - per_poll, upto):  # the writer's segments
            if limit and k > start and size + len(chunks[k]) > limit:
                seg, start, size = seg + 1, k, 0
            size += len(chunks[k])
        kw = {"segment": seg} if limit else {}
        jn.write_journal_chunks(open_storage(path), 0, chunks[start:upto], **kw)
        t = time.perf_counter()
        if store is None:
            store = CacheReader(path)
        else:
            store.refresh()
        last = time.perf_counter() - t
        total += last
    shutil.rmtree(path)
    return total, last


def keyindex_leg(n: int) -> float:
    keys = [os.urandom(16).hex() for _ in range(n)]
    index = NameIndex()
    t = time.perf_counter()
    for k in keys:
        index.add(k, 0)
    return time.perf_counter() - t


def open_files_leg(work: Path, n: int) -> int:
    path = work / f"o{n}"
    write_cache(path, range(n), shard_records=1)
    with CacheReader(path) as store:
        before = len(os.listdir("/proc/self/fd"))
        for e in store.entries:
            store.read_sample(e, 0, 0, ["xt", "prompt_embeds"])
        opened = len(os.listdir("/proc/self/fd")) - before
    shutil.rmtree(path)
    return opened


def sample_space_leg(base: Path, work: Path, n: int) -> float:
    """Bytes held per training sample by an epoch's plan: the sample space and its shuffled
    order (`TrainingReader._space` and what `_epoch_plan` builds from it)."""
    import tracemalloc

    from wandistill.cache.training import TrainingReader

    path = cache_of(base, work / f"s{n}", entries(base, n))
    reader = TrainingReader(path, batch_size=4)
    tracemalloc.start()
    space = reader._space(reader.store.entries)
    order = reader._permutation(len(space), "epoch", 0)
    if hasattr(space, "shuffled"):
        plan = space.shuffled(order)
    else:  # before 2026-11-27: a list of (entry, row, slot) tuples and a shuffled copy
        plan = [space[j] for j in order.tolist()]
    held = tracemalloc.get_traced_memory()[0] + order.numel() * order.element_size()
    tracemalloc.stop()
    samples = len(space)
    del space, plan
    shutil.rmtree(path)
    return held / samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards", type=int, default=1000, help="n (the legs also run at 4n)")
    p.add_argument("--work", type=Path, default=Path("/tmp/wandistill-scale"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, help="also write results.json / results.md here")
    args = p.parse_args()
    env = environment()
    shutil.rmtree(args.work, ignore_errors=True)
    base = write_cache(args.work / "base", range(8), shard_records=4).path
    n = args.shards
    rows = []
    for name, leg in (
        ("manifest load s", lambda k: manifest_leg(Path(base), args.work, k)),
        ("follow: all polls s", lambda k: follow_leg(Path(base), args.work, k)[0]),
        ("follow: last poll s", lambda k: follow_leg(Path(base), args.work, k)[1]),
        ("keyindex: 100n adds s", lambda k: keyindex_leg(100 * k)),
        ("epoch plan: bytes per sample", lambda k: sample_space_leg(Path(base), args.work, k)),
        ("open files after n/4 shards", lambda k: open_files_leg(args.work, k // 4)),
    ):
        runs = 1 if name.startswith(("open", "epoch")) else args.repeats
        a, b = (min(leg(k) for _ in range(runs)) for k in (n, 4 * n))
        rows.append((name, a, b))
    shutil.rmtree(args.work, ignore_errors=True)
    print(f"n = {n} shards; 4n = {4 * n}")
    print(f"{'leg':30} {'n':>10} {'4n':>10} {'4n / n':>8}")
    for name, a, b in rows:
        ratio = f"{b / a:8.1f}" if a else "       -"
        print(f"{name:30} {a:10.3f} {b:10.3f} {ratio}")
    print("(~4: linear, ~16: quadratic, ~1: bounded)")
    if args.out:
        table = [
            {"leg": name, "n": a, "4n": b, "4n / n": b / a if a else None} for name, a, b in rows
        ]
        Report(args.out, "Scale: n against 4n").update(
            {"command": " ".join(sys.argv), "environment": env},
            scale={"status": "ok", "rows": table, "notes": [f"n = {n} shards"]},
        )


if __name__ == "__main__":
    main()
