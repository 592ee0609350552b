"""Real files from a tiny run, built once per test session, for the file-validation tests.

`real_files()` makes a tiny teacher, runs precompute into a webdataset and a zarr cache, makes a
copy of the webdataset cache as a run still in progress (its shard entries in
`journal/rank-00000.json`, the manifest not yet complete: exactly what an interrupted precompute
leaves), and trains two steps into a run folder with two checkpoints. Everything goes through
`wandistill.cli.main`, in process. Tests copy what they mutate into their own folder.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from wandistill.cli import main

PROMPTS = ["a cat on a mat", "a dog in the park", "a red car at night", "the sea", "a tree"]
TRAIN_SETS = (
    "student.num_layers=1",
    "student.num_attention_heads=2",
    "student.attention_head_dim=12",
    "student.ffn_dim=32",
    "batch_size=2",
    "data_threads=1",
    'device="cpu"',
    "tensorboard=false",
    "checkpoint_every=1",
    "keep_checkpoints=2",
    "log_every=1",
)


@dataclass(frozen=True)
class RealFiles:
    root: Path
    teacher: Path
    wds: Path
    """A complete webdataset cache."""
    zarr: Path
    """A complete zarr cache."""
    running: Path
    """A webdataset cache still being written: its entries live in journal/rank-00000.json."""
    run: Path
    """A run folder: checkpoints/checkpoint-1, checkpoint-2, latest; student/config.json."""

    def train_args(self, cache: Path, out: Path, *extra: str) -> list[str]:
        sets = [x for s in TRAIN_SETS for x in ("--set", s)]
        return ["train", "--cache", str(cache), "--out", str(out), "--steps", "2", *sets, *extra]


def _cli(*args: str) -> None:
    try:
        main(list(args))
    except SystemExit as e:
        assert not e.code, f"building the real files failed: wandistill {' '.join(args)}"


def _precompute(teacher: Path, prompts: Path, cache: Path, backend: str) -> None:
    sets = [
        "sampler.num_inference_steps=2",
        "sampler.height=32",
        "sampler.width=32",
        "sampler.batch_size=2",
        "cache.shard_records=2",
        "cache.holdout_fraction=0.0",
        "previews=0",
    ]
    _cli(
        "precompute",
        "pipelines/tiny.toml",
        "--teacher",
        str(teacher),
        "--prompts",
        str(prompts),
        "--out",
        str(cache),
        "--backend",
        backend,
        *(x for s in sets for x in ("--set", s)),
    )


def _as_running(cache: Path, running: Path) -> None:
    """The cache as it was mid-run: shard entries in the writer's journal, none folded in."""
    shutil.copytree(cache, running)
    manifest = json.loads((running / "manifest.json").read_text())
    (running / "journal").mkdir(exist_ok=True)
    journal = {"rank": 0, "shards": manifest["shards"]}
    (running / "journal" / "rank-00000.json").write_text(json.dumps(journal, indent=1) + "\n")
    manifest["shards"], manifest["complete"] = [], False
    (running / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


_BUILT: RealFiles | None = None


def real_files(root: Path) -> RealFiles:
    """Build the files under `root` (once per process; later calls return the first build)."""
    global _BUILT
    if _BUILT is not None:
        return _BUILT
    from wandistill.teacher.tiny import make_tiny_teacher

    teacher = make_tiny_teacher(root / "teacher")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    files = RealFiles(
        root=root,
        teacher=teacher,
        wds=root / "wds",
        zarr=root / "zarr",
        running=root / "running",
        run=root / "run",
    )
    _precompute(teacher, prompts, files.wds, "webdataset")
    _precompute(teacher, prompts, files.zarr, "zarr")
    _as_running(files.wds, files.running)
    _cli(*files.train_args(files.wds, files.run))
    _BUILT = files
    return files


def tree_digest(root: Path, skip: Path | None = None) -> dict[str, str]:
    """sha256 of every file under `root` but `skip`: to show a failed command wrote nothing."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p != skip
    }
