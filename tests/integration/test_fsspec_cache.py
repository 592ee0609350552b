"""The whole path on an object store: precompute -> cache verify -> train -> eval, a kill -9 mid
precompute and a resume, and two torchrun "nodes" sharing one cache, all against a real S3
server on 127.0.0.1 (moto), with the CLI in real processes (forked from the session's zygote
that imported torch and diffusers once, tests/zygote.py; the two nodes are two torchrun agents
with one rank each, agents and ranks forked from it too)."""

from __future__ import annotations

import itertools
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from wandistill.cache.manifest import has_manifest, load_committed
from wandistill.cache.wds.reader import WebDatasetSource

from clirun import cli_env
from s3server import BUCKET, s3_server
from zygote import Zygote

pytestmark = pytest.mark.slow
_RUNS = itertools.count()
REPO = Path(__file__).parents[2]
SMALL_STUDENT = [
    *("--set", "student.num_layers=1", "--set", "student.num_attention_heads=2"),
    *("--set", "student.attention_head_dim=12", "--set", "student.ffn_dim=32"),
    *("--set", 'device="cpu"', "--set", "tensorboard=false", "--set", "data_threads=1"),
    *("--set", "batch_size=2"),
]


@pytest.fixture(scope="module")
def world(
    zygote: Zygote, tiny_teacher: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("fsspec")
    prompts = root / "p.txt"
    prompts.write_text("".join(f"prompt number {i}\n" for i in range(6)))
    with s3_server():  # the runs get the server's environment (each takes this process's)
        yield {"teacher": tiny_teacher, "prompts": prompts, "root": root,
               "zygote": zygote}  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    return cli_env(**extra)


def _run(world: dict, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`wandistill ARGS` in its own (forked) process; `env` is set in that process only."""
    log = world["root"] / f"run-{next(_RUNS)}.log"
    return world["zygote"].cli(list(args), log, **env)


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
        return {k: src.read_blob(e, i) for e in m.shards for i, k in enumerate(e.keys)}
    finally:
        src.close()


def test_precompute_verify_train_eval_and_a_killed_precompute_resumes_on_s3(
    world: dict[str, Path],
) -> None:
    url = f"s3://{BUCKET}/whole"
    done = _run(world, *_precompute(world, url))
    assert done.returncode == 0, done.stderr[-3000:]
    verified = _run(world, "cache", "verify", url)
    assert verified.returncode == 0 and "OK: 6 records in 3 shards" in verified.stdout
    trained = _run(
        world, "train", "pipelines/tiny.toml", "--cache", url, "--out", str(world["root"] / "run"),
        "--steps", "2", *SMALL_STUDENT,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (world["root"] / "run" / "student" / "config.json").is_file()
    evaluated = _run(
        world, "eval", "--cache", url, "--student", str(world["root"] / "run" / "student"),
        "--out", str(world["root"] / "eval"), "--split", "all", "--max-records", "1",
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert (world["root"] / "eval" / "eval.json").is_file()

    killed_url = f"s3://{BUCKET}/killed"
    killed = _run(world, *_precompute(world, killed_url), WANDISTILL_FAULT="precompute:record:3")
    assert killed.returncode == -9, killed.stderr[-3000:]
    partial = load_committed(killed_url)
    assert not partial.complete and partial.num_records == 2  # the open shard was never named
    resumed = _run(world, *_precompute(world, killed_url))  # takes over the dead writer's lock
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    m = load_committed(killed_url)
    keys = [k for s in m.shards for k in s.keys]
    assert m.complete and len(keys) == len(set(keys)) == 6
    assert _blobs(killed_url) == _blobs(url)


def test_a_zarr_cache_on_s3_survives_a_kill_resumes_verifies_and_trains(
    world: dict[str, Path],
) -> None:
    url = f"s3://{BUCKET}/zarr"
    args = [*_precompute(world, url), "--set", 'cache.backend="zarr"']
    killed = _run(world, *args, WANDISTILL_FAULT="precompute:record:3")
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert load_committed(url).num_records == 2  # the open shard's rows were never named
    resumed = _run(world, *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    verified = _run(world, "cache", "verify", url)
    assert verified.returncode == 0 and "OK: 6 records" in verified.stdout, verified.stderr
    trained = _run(
        world, "train", "pipelines/tiny.toml", "--cache", url, "--out", str(world["root"] / "zrun"),
        "--steps", "2", *SMALL_STUDENT,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "Unclosed" not in trained.stderr + resumed.stderr + verified.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_nodes(zygote: Zygote, *args: str) -> list[subprocess.CompletedProcess]:
    """`torchrun --nnodes=2 --nproc-per-node=1` twice on this host, c10d rendezvous on
    127.0.0.1: what docs/distributed.md runs on two machines."""
    endpoint = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            [
                *(zygote.python, "-m", "torch.distributed.run", "--nnodes=2"),
                *("--nproc-per-node=1", f"--node-rank={node}", "--rdzv-backend=c10d"),
                *(f"--rdzv-endpoint={endpoint}", "--rdzv-id=fsspec-test"),
                *("-m", "wandistill", *args),
            ],
            cwd=REPO,
            env=zygote.env(_env()),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


@pytest.mark.dist
def test_two_nodes_precompute_and_train_on_one_s3_cache(world: dict[str, Path]) -> None:
    url = f"s3://{BUCKET}/nodes"
    for node in _two_nodes(world["zygote"], *_precompute(world, url)):
        assert node.returncode == 0, node.stderr[-3000:]
    m = load_committed(url)
    assert m.complete and {s.rank for s in m.shards} == {0, 1} and m.num_records == 6
    whole = f"s3://{BUCKET}/whole"
    if not has_manifest(whole):  # the test above did not run on this server (-k, or xdist)
        assert _run(world, *_precompute(world, whole)).returncode == 0
    assert _blobs(url) == _blobs(whole)  # the single-process cache
    out = world["root"] / "nodes-run"
    train = ("train", "pipelines/tiny.toml", "--cache", url, "--out", str(out), "--steps", "2")
    for node in _two_nodes(world["zygote"], *train, *SMALL_STUDENT):
        assert node.returncode == 0, node.stderr[-3000:]
    assert (out / "student" / "config.json").is_file()
