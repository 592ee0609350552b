"""Per-expert students under DDP: 2 gloo ranks train like 1 rank with accumulation 2, even when a
micro-batch holds samples of one expert only (the idle expert's zero-gradient forward keeps
DDP's reducer and the optimizer step identical across layouts)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from wandistill.config import load_recipe
from wandistill.train import run

from cachefixtures import SETTINGS, write_cache
from zygote import Zygote

pytestmark = [pytest.mark.dist, pytest.mark.slow]

REPO = Path(__file__).parents[2]
SETS = [
    "batch_size=2",
    "steps=5",
    "log_every=1",
    "data_threads=1",
    'device="cpu"',
    "tensorboard=false",
    "optim.lr=1e-3",
    "loss.final_latent=0.5",
    'student.experts="per-expert"',
    "student.num_layers=1",
    "student.num_attention_heads=2",
    "student.attention_head_dim=12",
    "student.ffn_dim=32",
]
WEIGHTS = "diffusion_pytorch_model.safetensors"


def _torchrun_train(zygote: Zygote, cache: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """2 ranks under torchrun, agent and ranks forked from the session's zygote."""
    args = ["--cache", str(cache), "--out", str(out), *(x for s in SETS for x in ("--set", s))]
    env = {k: v for k, v in os.environ.items() if k != "WANDISTILL_FAULT"}
    return zygote.torchrun(
        ["-m", "wandistill", "train", *args], env={**env, "OMP_NUM_THREADS": "1"}
    )


def test_two_ranks_train_per_expert_students_like_one_rank_with_accumulation(
    zygote: Zygote,
    tmp_path: Path,
) -> None:
    # Records hold t = 999 (transformer), 500 and 250 (transformer_2): micro-batches of 2
    # samples are often one-sided.
    write_cache(tmp_path / "c", range(6), settings={**SETTINGS, "boundary_ratio": 0.875})
    ddp = _torchrun_train(zygote, tmp_path / "c", tmp_path / "ddp")
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    sets = [*SETS, f'cache="{tmp_path / "c"}"', f'out="{tmp_path / "one"}"', "grad_accum=2"]
    run(load_recipe(None, sets, stage="train").train)
    worst = 0.0
    for name in ("student", "student_ema"):
        for expert in ("transformer", "transformer_2"):
            a = load_file(tmp_path / "ddp" / name / expert / WEIGHTS)
            b = load_file(tmp_path / "one" / name / expert / WEIGHTS)
            assert a.keys() == b.keys()
            for key in a:  # the same samples per step; only the float summation order differs
                torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)
                worst = max(worst, float((a[key] - b[key]).abs().max()))
    print(f"max |2 ranks - 1 rank x accum 2| over both experts: {worst:.3g}")
