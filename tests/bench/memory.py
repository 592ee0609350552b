"""Benchmark: precompute's memory does not grow with the prompt file.

For each prompt count (default 1k, 10k, 100k) a fresh process runs, with the tiny teacher
(`wandistill teacher make-tiny`), one of:

  encode    the encode phase alone (`encode_phase` into an embedding store under a cache
            folder): what precompute does today;
  inram     the baseline it replaced: every embedding kept in a dict in memory (what the encode
            phase did before, measured in the same run);
  full      `wandistill precompute` end to end with a 1-step sampler at 16x16 (so 100k prompts
            finish), records written to a webdataset cache.

and reports its peak RSS (ru_maxrss), the RSS right after reading the prompt file and computing
keys and batches, and the seconds per 1k prompts. Target: peak RSS at 100k within 10% of 1k.

    python tests/bench/memory.py                       # encode + inram at 1k, 10k, 100k
    python tests/bench/memory.py --modes full --prompts 1000 10000 100000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).parents[2]
WORDS = "a quiet red fox runs over the snowy hill under a pale winter sky at dusk".split()


def write_prompts(path: Path, n: int) -> None:
    """n distinct prompts of 10-16 words (the tiny tokenizer's words), one per line."""
    with open(path, "w") as f:
        for i in range(n):
            k = 10 + i % 7
            words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(k)]
            f.write(f"{' '.join(words)} {i}\n")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def recipe(teacher: Path, prompts: Path, cache: Path) -> list[str]:
    return [
        f'teacher.path="{teacher}"',
        f'prompts="{prompts}"',
        f'cache.path="{cache}"',
        "previews=0",
        "sampler.height=16",
        "sampler.width=16",
        "sampler.num_frames=1",
        "sampler.num_inference_steps=1",
        "sampler.max_sequence_length=32",
        "sampler.batch_size=64",
        "cache.shard_records=256",
    ]


def child(mode: str, n: int, teacher: Path, work: Path) -> dict:
    import torch

    from wandistill.config import load_recipe

    torch.set_num_threads(1)
    prompts = work / "prompts.txt"
    write_prompts(prompts, n)
    cfg = load_recipe(None, recipe(teacher, prompts, work / "cache"), stage="precompute").precompute
    if mode == "full":
        from wandistill.precompute.run import run

        t0 = time.perf_counter()
        s = run(cfg, quiet=True)
        return {"seconds": time.perf_counter() - t0, "records": s.records_written}
    return encode_only(cfg, mode)


def encode_only(cfg, mode: str) -> dict:  # noqa: ANN001 - a PrecomputeConfig
    """The encode phase as precompute runs it (mode encode), or into a dict (mode inram)."""
    import torch

    from wandistill.cache.embeds import EmbedStore
    from wandistill.placement.load import resolve_placement
    from wandistill.precompute import encode_phase as ep
    from wandistill.precompute.encode_phase import EncodeJob, TextEncoder
    from wandistill.precompute.prompts import read_prompts
    from wandistill.precompute.run import _key, inspect_teacher, sampler_settings
    from wandistill.precompute.table import KeyTable, PromptTable

    teacher = inspect_teacher(cfg.teacher.path, None)
    prompts, _ = read_prompts(cfg.prompts, into=PromptTable())  # as precompute.run does
    settings = sampler_settings(teacher, cfg)
    keys = KeyTable(_key(p, settings) for p in prompts)
    bs = cfg.sampler.batch_size
    batches = [range(i, min(i + bs, len(prompts))) for i in range(0, len(prompts), bs)]
    after_plan = rss_mib()
    placement = resolve_placement(
        "cpu", folder=teacher.path, dtype=torch.float32, sampler=cfg.sampler, world_size=1
    )
    job = EncodeJob(
        teacher_path=teacher.path,
        prompts=prompts,
        keys=keys,
        batches=batches,
        negative_prompt="",
        max_sequence_length=cfg.sampler.max_sequence_length,
        dtype=torch.float32,
        load_kw={"dtype": torch.float32, "placement": placement},
        show_progress=False,
    )
    encoder = TextEncoder(job, _nothing)
    encoder.encode([""])  # load the tokenizer and encoder first: time the encoding only
    t0 = time.perf_counter()
    if mode == "encode":
        store = EmbedStore(cfg.cache.path, flush_records=cfg.cache.shard_records)
        encoded = ep.encode_phase(job, store, encoder, lambda: None)
    else:  # the old way: every embedding held in memory until the denoise phase
        kept: dict[int, torch.Tensor] = {}
        for b in batches:
            kept.update(zip(b, encoder.encode([prompts[i].text for i in b]).embeds, strict=True))
        encoded = len(kept)
    seconds = time.perf_counter() - t0
    encoder.close()
    return {"seconds": seconds, "encoded": encoded, "rss_after_plan_mib": after_plan}


class _nothing:  # noqa: N801 - a do-nothing context manager factory (no signals in the bench)
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def measure(mode: str, n: int, teacher: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="wandistill-mem-") as work:
        out = subprocess.run(
            [sys.executable, __file__, "--child", mode, str(n), str(teacher), work],
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode != 0:
            raise SystemExit(f"{mode} {n} failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[1000, 10_000, 100_000])
    ap.add_argument("--modes", nargs="+", default=["encode", "inram"])
    ap.add_argument("--child", nargs=4, metavar=("MODE", "N", "TEACHER", "WORK"))
    args = ap.parse_args()
    if args.child:
        mode, n, teacher, work = args.child
        result = child(mode, int(n), Path(teacher), Path(work))
        result.update(mode=mode, prompts=int(n), peak_rss_mib=peak_mib())
        print(json.dumps(result))
        return
    from wandistill.teacher.tiny import make_tiny_teacher

    print(
        f"machine: {platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}"
    )
    with tempfile.TemporaryDirectory(prefix="wandistill-mem-teacher-") as root:
        teacher = make_tiny_teacher(Path(root) / "teacher")
        for mode in args.modes:
            rows = [measure(mode, n, teacher) for n in args.prompts]
            base = rows[0]["peak_rss_mib"]
            for r in rows:
                per_k = r["seconds"] / r["prompts"] * 1000
                print(
                    f"{mode:7s} {r['prompts']:>7d} prompts: peak RSS {r['peak_rss_mib']:7.1f} MiB "
                    f"({(r['peak_rss_mib'] / base - 1) * 100:+5.1f}% vs {args.prompts[0]}), "
                    f"{per_k:6.2f} s per 1k prompts"
                    + (
                        f", RSS after prompts/keys/batches {r['rss_after_plan_mib']:.1f} MiB"
                        if "rss_after_plan_mib" in r
                        else ""
                    )
                )


if __name__ == "__main__":
    main()
