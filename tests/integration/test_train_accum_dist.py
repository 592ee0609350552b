"""2 ranks x accumulation 1 trains like 1 rank x accumulation 2, across an epoch boundary."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from wandistill.config import load_recipe
from wandistill.train import run

from cachefixtures import write_cache
from zygote import Zygote

pytestmark = [pytest.mark.dist, pytest.mark.slow]

REPO = Path(__file__).parents[2]
SETS = [
    "batch_size=2",
    "steps=7",
    "log_every=1",
    "data_threads=1",
    'device="cpu"',
    "tensorboard=false",
    "optim.lr=1e-3",
    "loss.final_latent=0.5",
    "student.num_layers=1",
    "student.num_attention_heads=2",
    "student.attention_head_dim=12",
    "student.ffn_dim=32",
]


def _torchrun_train(zygote: Zygote, cache: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """2 ranks under torchrun, agent and ranks forked from the session's zygote."""
    args = ["--cache", str(cache), "--out", str(out), *(x for s in SETS for x in ("--set", s))]
    env = {k: v for k, v in os.environ.items() if k != "WANDISTILL_FAULT"}
    return zygote.torchrun(
        ["-m", "wandistill", "train", *args], env={**env, "OMP_NUM_THREADS": "1"}
    )


def test_two_ranks_equal_one_rank_with_accumulation_past_an_epoch_boundary(
    zygote: Zygote, tmp_path: Path
) -> None:
    # 6 records x 3 recorded steps = 18 samples, 4 per optimizer step: epoch 1 begins at step 5.
    # Micro-batches of B x W (the old plan) would wrap at different places in the two layouts.
    write_cache(tmp_path / "c", range(6))
    ddp = _torchrun_train(zygote, tmp_path / "c", tmp_path / "ddp")
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    sets = [*SETS, f'cache="{tmp_path / "c"}"', f'out="{tmp_path / "one"}"', "grad_accum=2"]
    run(load_recipe(None, sets, stage="train").train)
    for name in ("student", "student_ema"):
        a = load_file(tmp_path / "ddp" / name / "diffusion_pytorch_model.safetensors")
        b = load_file(tmp_path / "one" / name / "diffusion_pytorch_model.safetensors")
        assert a.keys() == b.keys()
        for key in a:  # the same samples per step; only the float summation order differs
            torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)
