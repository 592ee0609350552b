"""Where the zarr cache writer's time goes: per-thread CPU and the floor without hashing / fsync.

Writes the same records as tests/bench/cache_io.py (Wan 480p, bf16, 4.71 MB each) with
`CacheWriter(backend="zarr")` and, in the same rounds, the per-record `save_file` + fsync
baseline. Two diagnostic legs replace parts of the writer to show what the rest costs: `nohash`
(the sink's sha256 replaced by a constant) and `nohash_nofsync` (no fsync either; not durable).
Prints median wall seconds, the ratio to the baseline, and CPU seconds per thread: `MainThread`
(buffering, finite check, claim), `zarr` (zarr-python's event loop: the codec pipeline) and
`asyncio` (worker threads: file writes, sha256, fsync).

    flock /tmp/wandistill-bench.lock python tests/bench/zarr_write_profile.py [--records 64]
        [--shard-records 16] [--repeats 5] [--batch-sizes 64]

`--batch-sizes 1,64` runs the full writer leg once per zarr `codec_pipeline.batch_size`
(`zarr_backend.WRITE_BATCH_CHUNKS`; zarr's own default is 1).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import cache_io  # noqa: E402

from wandistill.cache import zarr_backend as zb  # noqa: E402


def thread_cpu() -> collections.Counter:
    """CPU seconds so far per thread kind (Linux /proc)."""
    names = {t.native_id: t.name.split("_")[0] for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: collections.Counter = collections.Counter()
    for stat in glob.glob("/proc/self/task/*/stat"):
        try:
            text = open(stat).read()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        kind = names.get(int(stat.split("/")[4]), "asyncio")
        out[kind] += (int(fields[11]) + int(fields[12])) / tick
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=64)
    p.add_argument("--shard-records", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch-sizes", default=str(zb.WRITE_BATCH_CHUNKS))
    args = p.parse_args()
    records = cache_io.make_records(args.records, cache_io.STEPS, torch.bfloat16, seed=0)
    out = Path(tempfile.mkdtemp(prefix="wandistill-zarr-prof-"))
    seal, durable = zb._SealingStore._seal, zb._SealingStore.make_durable

    def nohash(self, key, value, fsync):  # noqa: ANN001, ANN202
        if fsync:
            zb._fsync_path(self.local_root / key)
        return len(value), "0" * 64

    def nofsync(self, keys=()):  # noqa: ANN001, ANN202
        self._pending, self._touched = set(), set()

    def nohash_nofsync(self, key, value, fsync):  # noqa: ANN001, ANN202
        return len(value), "0" * 64

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    legs = {
        **{f"zarr bs{b}" if len(sizes) > 1 else "zarr": (seal, durable, b) for b in sizes},
        "nohash": (nohash, durable, sizes[-1]),
        "nohash_nofsync": (nohash_nofsync, nofsync, sizes[-1]),
    }
    wall: dict[str, list[float]] = collections.defaultdict(list)
    cpu: dict[str, list[collections.Counter]] = collections.defaultdict(list)
    try:
        for _ in range(args.repeats):
            for name, (s, d, b) in legs.items():
                zb._SealingStore._seal, zb._SealingStore.make_durable = s, d
                zb.WRITE_BATCH_CHUNKS = b
                shutil.rmtree(out / "zarr", ignore_errors=True)
                os.sync()
                c0, t0 = thread_cpu(), time.perf_counter()
                cache_io.write_cache(
                    records, out / "zarr", "zarr", torch.bfloat16, args.shard_records
                )
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(thread_cpu() - c0)
            zb._SealingStore._seal, zb._SealingStore.make_durable = seal, durable
            shutil.rmtree(out / "files", ignore_errors=True)
            os.sync()
            c0, t0 = thread_cpu(), time.perf_counter()
            cache_io.write_files(records, out / "files")
            cache_io.fsync_tree(out / "files")
            wall["save_file + fsync"].append(time.perf_counter() - t0)
            cpu["save_file + fsync"].append(thread_cpu() - c0)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    base = statistics.median(wall["save_file + fsync"])
    print(
        f"{args.records} records x 4.71 MB, {args.shard_records} per shard, "
        f"median of {args.repeats}; load {os.getloadavg()}"
    )
    for name, ws in wall.items():
        w = statistics.median(ws)
        per = {
            k: round(statistics.median(c[k] for c in cpu[name]), 2)
            for k in ("MainThread", "zarr", "asyncio")
        }
        print(
            f"  {name:18s} {w:6.3f} s  {base / w:5.2f}x  cpu {per}  runs "
            + "/".join(f"{x:.2f}" for x in ws)
        )


if __name__ == "__main__":
    main()
