#!/usr/bin/env python
"""Journal commits over a long run: segmented journals vs one ever-growing journal file.

    python tests/bench/journal_commits.py --shards 4000 --work /tmp/jc [--out DIR]

One writer rank commits --shards one-record shards (tiny records, so the commit is the work) to
a webdataset cache, twice in one run: with the segment size the writer uses
(`manifest.JOURNAL_SEGMENT_BYTES`), and with segments so large that the journal is one file
rewritten whole at every commit (what every writer did before segments: the baseline). Prints the
seconds per quarter of the run and the journal bytes written, and their ratios; with --out,
also `results.json` / `results.md` with the machine (tests/bench/harness.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for cachefixtures

from harness import Report, environment, max_rss_bytes  # noqa: E402

from wandistill.cache import CacheWriter  # noqa: E402
from wandistill.cache import manifest as mf  # noqa: E402
from wandistill.cache.contract import field_specs  # noqa: E402

from cachefixtures import SETTINGS, TEACHER, make_record  # noqa: E402


def run(out: Path, shards: int, segment_bytes: int) -> tuple[list[float], int]:
    """Seconds per quarter of the commits, and the journal bytes they wrote."""
    shutil.rmtree(out, ignore_errors=True)
    mf.JOURNAL_SEGMENT_BYTES = segment_bytes
    written = 0
    write = mf.write_journal_chunks

    def counting(cache, rank, entries, **kw):  # type: ignore[no-untyped-def]
        nonlocal written
        written += sum(map(len, entries))
        return write(cache, rank, entries, **kw)

    mf.write_journal_chunks = counting
    fields = field_specs(latent_dtype=torch.float32, embed_dtype=torch.bfloat16, features=[])
    w = CacheWriter(out, backend="webdataset", teacher=TEACHER, settings=SETTINGS,
                    fields=fields, shard_records=1)  # fmt: skip
    records = [make_record(i) for i in range(16)]
    quarters, t = [], time.perf_counter()
    try:
        for i in range(shards):
            w.write(dataclasses.replace(records[i % 16], key=f"k{i:08d}"))
            if (i + 1) % (shards // 4) == 0:
                quarters.append(time.perf_counter() - t)
                t = time.perf_counter()
        w.close()
    finally:
        mf.write_journal_chunks = write
    return quarters, written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--shards", type=int, default=4000)
    p.add_argument("--work", type=Path, default=Path("/tmp/journal-commits"))
    p.add_argument("--out", type=Path, help="also write results.json / results.md here")
    args = p.parse_args()
    env = environment()
    default = mf.JOURNAL_SEGMENT_BYTES
    legs = {"segmented": default, "one file (baseline)": 1 << 62}
    got = {
        name: run(args.work / str(i), args.shards, b) for i, (name, b) in enumerate(legs.items())
    }
    shutil.rmtree(args.work, ignore_errors=True)
    print(f"{args.shards} one-record shards, segment {default >> 10} KiB")
    print(f"{'leg':22} {'quarters (s)':32} {'total s':>8} {'journal MB':>11}")
    for name, (q, b) in got.items():
        print(f"{name:22} {' '.join(f'{x:7.2f}' for x in q):32} {sum(q):8.2f} {b / 1e6:11.1f}")
    (qs, bs), (qb, bb) = got.values()
    print(f"segmented vs one file: total time {sum(qs) / sum(qb):.2f}x, "
          f"last quarter {qs[-1] / qb[-1]:.2f}x, journal bytes {bs / bb:.2f}x")  # fmt: skip
    if args.out:
        rows = [{"leg": n, "quarters_s": [round(x, 3) for x in q], "total_s": round(sum(q), 3),
                 "journal_bytes": b} for n, (q, b) in got.items()]  # fmt: skip
        summary = {"time ratio": sum(qs) / sum(qb), "last quarter ratio": qs[-1] / qb[-1],
                   "journal bytes ratio": bs / bb,
                   "max RSS MiB": max_rss_bytes() / 2**20}  # fmt: skip
        Report(args.out, "Journal commits").update(
            {"command": " ".join(sys.argv), "environment": env},
            commits={"status": "ok", "rows": rows, "summary": summary},
        )


if __name__ == "__main__":
    main()
