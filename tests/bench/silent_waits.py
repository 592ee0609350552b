#!/usr/bin/env python
"""The longest silent interval of the hostile cases that wait: every line a command prints is
timestamped; a gap is the time between two lines (or from the start to the first line, or from
the last line to the exit).

    python tests/bench/silent_waits.py [--work DIR] [--json FILE] [--quick] [--only NAME ...]

Cases (each `python -m wandistill ...` as its own process, default settings unless named):
- `cache info` on an S3 endpoint that accepts connections and never answers (defaults: 5 s to
  connect, 20 s to answer, 2 attempts);
- `cache info` on an unreachable endpoint, and on one that is another HTTP server;
- `train --follow` on an incomplete cache whose writer is gone (default poll interval);
- a manual `WORLD_SIZE=2` launch of `train` with no peer (WANDISTILL_DIST_TIMEOUT=15);
- `plan --gpus 1000000`.

Two figures per case: the longest gap of all, and the longest gap before the first line that
says what the command waits for (`waiting:`) or ends it (`error:`): the target is that no
command is silent for over 10 s without such a line. Startup (imports) counts: it is part of
what a user sees. `--quick`: WANDISTILL_STORAGE_TIMEOUT=5 for the stalled endpoint. `--only`:
run only the named cases (stalled, unreachable, not_s3, follow, rendezvous, plan). Not a
pytest test: run once, its output goes to docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import machine_line, write_json  # tests/bench, next to this script

ROOT = Path(__file__).parents[2]
CASES = ("stalled", "unreachable", "not_s3", "follow", "rendezvous", "plan")
"""The cases' names, in the order they run (`--only`)."""
sys.path.insert(0, str(ROOT / "tests"))


def timed(argv: list[str], env: dict[str, str], limit: float = 300) -> dict[str, object]:
    """Run one command; every output line with its time since the start."""
    start = time.monotonic()
    p = subprocess.Popen(
        [sys.executable, "-m", "wandistill", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    )
    lines: list[tuple[float, str]] = []
    assert p.stdout is not None
    for line in p.stdout:
        lines.append((time.monotonic() - start, line.rstrip()))
        if time.monotonic() - start > limit:
            p.kill()
    code = p.wait()
    end = time.monotonic() - start
    stamps = [0.0, *(t for t, _ in lines), end]
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    told = next((t for t, s in lines if s.startswith(("waiting:", "error:"))), end)
    return {
        "argv": " ".join(argv),
        "exit": code,
        "seconds": round(end, 1),
        "longest_gap_s": round(max(gaps), 1),
        "silent_before_told_s": round(told, 1),
        "lines": [f"{t:6.1f}s {s}" for t, s in lines if s.startswith(("waiting:", "error:"))],
    }


def _dead_writer_cache(work: Path, real: Path | None) -> tuple[Path, list[str]]:
    """A tiny run's cache as an interrupted precompute leaves it (entries in its journal, not
    complete), claimed and released (a dead writer: marker, free lock); the train flags that
    fit it."""
    import shutil

    from wandistill.io import outputs

    from realfiles import TRAIN_SETS, RealFiles, real_files

    if real is not None and (real / "running").is_dir():  # built before: reuse it
        names = ("teacher", "wds", "zarr", "running", "run")
        files = RealFiles(real, **{n: real / n for n in names})
    else:
        files = real_files(real or work / "real")
    cache = work / "dead-writer"
    if cache.exists():
        shutil.rmtree(cache)
    shutil.copytree(files.running, cache)
    outputs.claim(cache, "cache").release()
    return cache, [x for s in TRAIN_SETS for x in ("--set", s)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--real", type=Path, default=None, help="tests/realfiles.py output to reuse")
    ap.add_argument("--only", nargs="+", choices=CASES, default=list(CASES))
    args = ap.parse_args()
    print(machine_line(), flush=True)
    from s3server import hostile_endpoints  # tests/ is on sys.path (above)

    with hostile_endpoints() as ends:  # stopped when the cases are done
        measure(args, ends)


def measure(args: argparse.Namespace, ends: dict[str, str]) -> None:
    """Run the chosen cases against `ends` and print (and write) their silences."""
    work = args.work or Path(tempfile.mkdtemp(prefix="silent-"))
    work.mkdir(parents=True, exist_ok=True)
    creds = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x"}
    creds |= {"AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    stalled = {**creds, "AWS_ENDPOINT_URL": ends["stalled"]}
    if args.quick:
        stalled["WANDISTILL_STORAGE_TIMEOUT"] = "5"
    for old in ("run", "solo"):  # outputs of an earlier run of this script
        shutil.rmtree(work / old, ignore_errors=True)
    cache, sets = _dead_writer_cache(work, args.real)
    train = ["train", "--cache", str(cache), "--out", str(work / "run"), "--steps", "1", *sets]
    solo = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    solo |= {"MASTER_PORT": "29517", "WANDISTILL_DIST_TIMEOUT": "15"}
    cases = [
        (["cache", "info", "s3://bucket/c"], stalled),
        (["cache", "info", "s3://bucket/c"], {**creds, "AWS_ENDPOINT_URL": ends["unreachable"]}),
        (["cache", "info", "s3://bucket/c"], {**creds, "AWS_ENDPOINT_URL": ends["not_s3"]}),
        ([*train, "--follow", "--steps", "1000"], {}),  # more than the 5 records committed
        ([*train, "--out", str(work / "solo")], solo),
        (["plan", "--config", "wan2.1-14b", "--gpus", "1000000", "--gpu-mem", "80GiB"], {}),
    ]
    chosen = [case for name, case in zip(CASES, cases, strict=True) if name in args.only]
    results = [timed(argv, env) for argv, env in chosen]
    for r in results:
        print(json.dumps(r, indent=1))
    worst = max(results, key=lambda r: r["silent_before_told_s"])
    print(
        f"longest silence before a line saying what it waits for: "
        f"{worst['silent_before_told_s']} s ({worst['argv']}); longest gap of all: "
        f"{max(r['longest_gap_s'] for r in results)} s"
    )
    if args.json:
        write_json(args.json, {"command": " ".join(sys.argv), "cases": results})


if __name__ == "__main__":
    main()
