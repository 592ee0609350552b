"""Which run conditions change the bits of a cached record (the manifest's `numerics` block).

Runs the tiny teacher's precompute once per variation, each in a fresh process (environment
switches such as MKL_CBWR and ATEN_CPU_CAPABILITY act at library load), and compares every
record tensor with the baseline's, bit for bit.

    python tests/bench/record_bits.py [--out /tmp/record_bits]

Prints one line per variation: the fields whose bits differ from the baseline (batch size 2,
one intra-op thread, default CPU kernels). The results on the project's 2-core VM are in
docs/cache-format.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

PROMPTS = ["a cat on a mat", "a dog in the park", "a red car at night", "the sea", "a tree", "dawn"]
VARIATIONS: dict[str, dict[str, str]] = {
    "baseline (batch 2, 1 thread)": {},
    "baseline again": {},
    "sampler.batch_size=1": {"BATCH": "1"},
    "sampler.batch_size=3": {"BATCH": "3"},
    "sampler.batch_size=6": {"BATCH": "6"},
    "torch.set_num_threads(2)": {"THREADS": "2"},
    "torch.set_num_threads(3)": {"THREADS": "3"},
    "torch.set_num_threads(4)": {"THREADS": "4"},
    "ATEN_CPU_CAPABILITY=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "ATEN_CPU_CAPABILITY=default": {"ATEN_CPU_CAPABILITY": "default"},
    "MKL_CBWR=COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"},
    "MKL_CBWR=AVX2": {"MKL_CBWR": "AVX2"},
    "torch.backends.mkldnn.enabled=False": {"NO_MKLDNN": "1"},
    "torch.use_deterministic_algorithms(True)": {"DETERMINISTIC": "1"},
}

CHILD = """
import hashlib, json, os, sys
import torch
torch.set_num_threads(int(os.environ.get("THREADS", "1")))
if os.environ.get("DETERMINISTIC"):
    torch.use_deterministic_algorithms(True)
if os.environ.get("NO_MKLDNN"):
    torch.backends.mkldnn.enabled = False
from pathlib import Path
from wandistill.cache import open_cache
from wandistill.config import load_recipe
from wandistill.precompute.run import run
teacher, prompts, out, result = sys.argv[1:5]
sets = [f'teacher.path="{teacher}"', f'prompts="{prompts}"', f'cache.path="{out}"',
        "sampler.num_inference_steps=4", "sampler.height=32", "sampler.width=32",
        "cache.holdout_fraction=0.0", "previews=0", "cache.shard_records=8",
        f"sampler.batch_size={os.environ.get('BATCH', '2')}"]
run(load_recipe(Path("pipelines/tiny.toml"), sets, stage="precompute").precompute, quiet=True)
digests = {}
with open_cache(out) as store:
    for rec in store.records():
        for name, t in rec.tensors().items():
            raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
            digests[f"{rec.prompt}/{name}"] = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
Path(result).write_text(json.dumps(digests))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="/tmp/record_bits")
    args = parser.parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    teacher = root / "teacher"
    if not teacher.exists():
        subprocess.run(
            [sys.executable, "-m", "wandistill", "teacher", "make-tiny", str(teacher)],
            check=True,
            env=env,
            capture_output=True,
        )
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    results: dict[str, dict[str, str]] = {}
    for i, (name, extra) in enumerate(VARIATIONS.items()):
        cache, result = root / f"cache{i}", root / f"result{i}.json"
        shutil.rmtree(cache, ignore_errors=True)  # a fresh cache: no resume across variations
        subprocess.run(
            [sys.executable, "-c", CHILD, str(teacher), str(prompts), str(cache), str(result)],
            check=True,
            env={**env, **extra},
            capture_output=True,
        )
        results[name] = json.loads(result.read_text())
    base = results["baseline (batch 2, 1 thread)"]
    print(f"torch {_version('torch')}, {os.cpu_count()} CPUs")
    for name, digests in results.items():
        changed = sorted({k.split("/")[-1] for k in base if digests.get(k) != base[k]})
        print(f"{name:44s} bits differ in: {', '.join(changed) or 'nothing'}")


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
