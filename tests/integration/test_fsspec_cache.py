"""The whole path on an object store: precompute -> cache verify -> train, a kill -9 mid
precompute and a resume, and two torchrun "nodes" sharing one cache, all against a real S3
server on 127.0.0.1 (moto), with the CLI in real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from wandistill.cache.manifest import load_committed
from wandistill.cache.wds import WebDatasetSource
from wandistill.teacher.tiny import make_tiny_teacher

from s3server import BUCKET, s3_server

pytestmark = pytest.mark.slow
REPO = Path(__file__).parents[2]
SMALL_STUDENT = [
    *("--set", "student.num_layers=1", "--set", "student.num_attention_heads=2"),
    *("--set", "student.attention_head_dim=12", "--set", "student.ffn_dim=32"),
    *("--set", 'device="cpu"', "--set", "tensorboard=false", "--set", "data_threads=1"),
    *("--set", "batch_size=2"),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("fsspec")
    prompts = root / "p.txt"
    prompts.write_text("".join(f"prompt number {i}\n" for i in range(6)))
    with s3_server():
        yield {"teacher": make_tiny_teacher(root / "teacher"), "prompts": prompts, "root": root}


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **extra}


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "wandistill", *args],
        cwd=REPO,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _precompute(world: dict[str, Path], url: str) -> list[str]:
    return [
        *("precompute", "pipelines/tiny.toml", "--out", url),
        *("--teacher", str(world["teacher"]), "--prompts", str(world["prompts"])),
        *("--set", "previews=0", "--set", "sampler.batch_size=2"),
        *("--set", "cache.shard_records=2", "--set", "sampler.height=32"),
        *("--set", "sampler.width=32"),
    ]


def _blobs(url: str) -> dict[str, bytes]:
    m = load_committed(url)
    src = WebDatasetSource(url)
    try:
        return {k: src.read_blob(e, i) for e in m.shards for i, k in enumerate(e["keys"])}
    finally:
        src.close()


def test_precompute_verify_train_and_a_killed_precompute_resumes_on_s3(
    world: dict[str, Path],
) -> None:
    url = f"s3://{BUCKET}/whole"
    done = _run(*_precompute(world, url))
    assert done.returncode == 0, done.stderr[-3000:]
    verified = _run("cache", "verify", url)
    assert verified.returncode == 0 and "OK: 6 records in 3 shards" in verified.stdout
    trained = _run(
        "train", "pipelines/tiny.toml", "--cache", url, "--out", str(world["root"] / "run"),
        "--steps", "2", *SMALL_STUDENT,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (world["root"] / "run" / "student" / "config.json").is_file()

    killed_url = f"s3://{BUCKET}/killed"
    killed = _run(
        *_precompute(world, killed_url), env=_env(WANDISTILL_TEST_KILL_AT="precompute:record:3")
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    partial = load_committed(killed_url)
    assert not partial.complete and partial.num_records == 2  # the open shard was never named
    resumed = _run(*_precompute(world, killed_url))  # takes over the dead writer's lock
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    m = load_committed(killed_url)
    keys = [k for s in m.shards for k in s["keys"]]
    assert m.complete and len(keys) == len(set(keys)) == 6
    assert _blobs(killed_url) == _blobs(url)
