"""Benchmark: a precompute split in N independent parts vs one job over the same prompt list.

With the tiny random teacher, `wandistill precompute` runs once over the whole list and then as
parts 0/N .. N-1/N into one `--out` folder, each a fresh process (the real command line, startup
and teacher loading included: every part pays them). Reports each process's wall time and
records, the parts' sum (the machine time an array spends) and their max (an array's wall time
when every part has a node of its own), and checks that the parts' records are the one job's,
key for key and byte for byte. The parts run one after another here: on one shared machine, running
them at once would only measure contention.

    python tests/bench/parts.py --prompts 96 --parts 3
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import machine_line, write_json  # tests/bench, next to this script

REPO = Path(__file__).parents[2]


def sets(teacher: Path, prompts: Path, out: Path) -> list[str]:
    chosen = [
        f'teacher.path="{teacher}"',
        f'prompts="{prompts}"',
        f'cache.path="{out}"',
        "previews=0",
        "sampler.height=32",
        "sampler.width=32",
        "sampler.num_inference_steps=8",
        "sampler.batch_size=8",
        "cache.shard_records=16",
    ]
    return [a for s in chosen for a in ("--set", s)]


def precompute(args: list[str], part: str | None) -> float:
    argv = [sys.executable, "-m", "wandistill", "precompute", "pipelines/tiny.toml", *args]
    argv += ["--part", part] if part else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    got = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if got.returncode != 0:
        raise SystemExit(f"precompute {part or 'whole'} failed:\n{got.stderr[-3000:]}")
    return time.perf_counter() - t0


def records(cache: Path) -> dict[str, tuple[tuple[str, bytes], ...]]:
    from wandistill.cache import open_cache
    from wandistill.cache.contract import tensor_bytes

    with open_cache(cache) as store:
        return {
            r.key: tuple((k, tensor_bytes(t).tobytes()) for k, t in sorted(r.tensors().items()))
            for r in store.records()
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--parts", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    from wandistill.teacher.tiny import make_tiny_teacher

    print(machine_line())
    with tempfile.TemporaryDirectory(prefix="wandistill-parts-") as tmp:
        work = Path(tmp)
        teacher = make_tiny_teacher(work / "teacher")
        prompts = work / "prompts.txt"
        prompts.write_text(
            "".join(f"a small red fox number {i} runs\n" for i in range(args.prompts))
        )
        whole = precompute(sets(teacher, prompts, work / "one"), None)
        times = [
            precompute(sets(teacher, prompts, work / "parts"), f"{i}/{args.parts}")
            for i in range(args.parts)
        ]
        one = records(work / "one")
        union: dict[str, tuple[tuple[str, bytes], ...]] = {}
        counts = []
        for i in range(args.parts):
            got = records(work / "parts" / f"part-{i:05d}-of-{args.parts:05d}")
            counts.append(len(got))
            union |= got
        same = union == one
        print(f"one job: {len(one)} records in {whole:.1f} s")
        for i, (t, n) in enumerate(zip(times, counts, strict=True)):
            print(f"part {i}/{args.parts}: {n} records in {t:.1f} s")
        print(
            f"parts: {sum(counts)} records; sum {sum(times):.1f} s ({sum(times) / whole:.2f}x one "
            f"job), max {max(times):.1f} s ({max(times) / whole:.2f}x); union equals one job, "
            f"record for record: {same}"
        )
    if args.json:
        figures = {"one_job_s": whole, "parts_s": times, "part_records": counts}
        write_json(args.json, {"command": " ".join(sys.argv), **figures, "same_records": same})


if __name__ == "__main__":
    main()
