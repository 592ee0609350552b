"""`wandistill train` under torchrun: 2 gloo ranks on CPU, as a subprocess with a timeout.

The first test starts torchrun and its ranks as fresh interpreters; the others fork them from
the session's zygote (tests/zygote.py): the same code in real processes, without the imports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from wandistill.config import load_recipe
from wandistill.train import run
from wandistill.train.checkpoint import resolve_latest
from wandistill.train.metrics import read_metrics

from cachefixtures import write_cache
from zygote import Zygote

pytestmark = [pytest.mark.dist, pytest.mark.slow]

REPO = Path(__file__).parents[2]
COMMON = (
    "--set",
    "batch_size=2",
    "--set",
    "log_every=1",
    "--set",
    "data_threads=1",
    "--set",
    'device="cpu"',
    "--set",
    "tensorboard=false",
    "--set",
    "optim.warmup_steps=2",
    "--set",
    "optim.lr=1e-3",
    "--set",
    "loss.final_latent=0.5",
    "--set",
    "student.num_layers=1",
    "--set",
    "student.num_attention_heads=2",
    "--set",
    "student.attention_head_dim=12",
    "--set",
    "student.ffn_dim=32",
)


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120", **extra}
    env.pop("WANDISTILL_FAULT", None)
    env.update(extra)
    return env


def _torchrun(nproc: int, *args: str, python: str = sys.executable) -> list[str]:
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "wandistill",
        "train",
        *args,
    ]


def _launch(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """Run a torchrun command in its own session; on a hang, kill that whole session."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun hung past {timeout} s:\n{err[-3000:]}")
    return proc.returncode, out, err


def _sets(args: tuple[str, ...]) -> list[str]:
    return [args[i + 1] for i in range(0, len(args), 2) if args[i] == "--set"]


def test_two_ranks_equal_one_rank_with_twice_the_accumulation(tmp_path: Path) -> None:
    write_cache(tmp_path / "c", range(8))  # 24 samples: 6 global batches of 4 per epoch
    args = ("--cache", str(tmp_path / "c"), "--steps", "8", *COMMON)
    code, _, err = _launch(_torchrun(2, *args, "--out", str(tmp_path / "ddp")), _env(), 300)
    assert code == 0, err[-3000:]
    one = load_recipe(
        None,
        [
            *_sets(args),
            f'cache="{tmp_path / "c"}"',
            f'out="{tmp_path / "one"}"',
            "steps=8",
            "grad_accum=2",
        ],
        stage="train",
    ).train
    run(one)
    for name in ("student", "student_ema"):
        a = load_file(tmp_path / "ddp" / name / "diffusion_pytorch_model.safetensors")
        b = load_file(tmp_path / "one" / name / "diffusion_pytorch_model.safetensors")
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)
    ddp_rows = [r for r in read_metrics(tmp_path / "ddp") if "loss" in r]
    one_rows = [r for r in read_metrics(tmp_path / "one") if "loss" in r]
    assert [r["step"] for r in ddp_rows] == [r["step"] for r in one_rows] == list(range(1, 9))
    for a_row, b_row in zip(ddp_rows, one_rows, strict=True):
        assert a_row["loss"] == pytest.approx(b_row["loss"], rel=1e-4)


def test_an_exception_on_one_rank_brings_every_rank_down(zygote: Zygote, tmp_path: Path) -> None:
    write_cache(tmp_path / "c", range(8))
    args = ("--cache", str(tmp_path / "c"), "--out", str(tmp_path / "run"), "--steps", "50")
    # The timeout is a hang guard; the contract (all ranks down well within 60 s) is not timed.
    code, out, err = _launch(
        _torchrun(2, *args, *COMMON, python=zygote.python),
        zygote.env(_env(WANDISTILL_FAULT="train:step:3:1:raise")),
        180,
    )
    assert code != 0
    assert err.count("error: injected failure on rank 1 at train step 3") == 1
    assert "[rank0]: Traceback" not in err and "[rank1]: Traceback" not in err
    assert not (tmp_path / "run" / "student").exists()


def test_follow_mode_under_torchrun_trains_while_the_cache_grows(
    zygote: Zygote, tmp_path: Path
) -> None:
    cache = tmp_path / "c"
    write_cache(cache, range(4), finalize=False, complete=False)  # 12 samples: 3 global batches
    args = (
        "--cache",
        str(cache),
        "--out",
        str(tmp_path / "run"),
        "--steps",
        "100",
        "--follow",
        "--set",
        "checkpoint_every=1",
        "--set",
        "follow_poll_interval=0.1",
        *COMMON,
    )
    proc = subprocess.Popen(
        _torchrun(2, *args, python=zygote.python),
        cwd=REPO,
        env=zygote.env(_env()),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        root = tmp_path / "run" / "checkpoints"
        deadline = time.monotonic() + 240  # hang guard only
        while not (root / "checkpoint-3").is_dir() and time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        write_cache(cache, range(4, 7), rank=1, finalize=False, complete=False)  # +9 samples
        write_cache(cache, [], rank=0, finalize=True, complete=True)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:].decode()
    state = (resolve_latest(root) / "state.json").read_text()
    assert '"step": 5' in state  # (12 + 9) // 4 global batches, then the cache is exhausted
