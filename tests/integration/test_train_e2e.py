"""train end to end: kill -9 and resume, no teacher needed, the student samples in WanPipeline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from wandistill.train.checkpoint import resolve_latest

from cachefixtures import write_cache
from zygote import Zygote, alive, kill

pytestmark = pytest.mark.slow

REPO = Path(__file__).parents[2]
SMALL = [
    "--set",
    "student.num_layers=1",
    "--set",
    "student.num_attention_heads=2",
    "--set",
    "student.attention_head_dim=12",
    "--set",
    "student.ffn_dim=32",
    "--set",
    'device="cpu"',
    "--set",
    "tensorboard=false",
    "--set",
    "data_threads=1",
]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "WANDISTILL_FAULT"}
    return {**env, "OMP_NUM_THREADS": "1", "COLUMNS": "120", **extra}


def test_kill_9_mid_run_then_resume_gives_the_same_final_weights(
    zygote: Zygote, tmp_path: Path
) -> None:
    """Each run is a real process forked from the module's zygote (tests/zygote.py)."""
    write_cache(tmp_path / "c", range(6))
    args = [
        "--cache",
        str(tmp_path / "c"),
        "--steps",
        "12",
        "--set",
        "batch_size=2",
        "--set",
        "checkpoint_every=3",
        "--set",
        "loss.final_latent=0.5",
        "--set",
        "optim.warmup_steps=2",
        *SMALL,
    ]
    whole = zygote.cli(["train", *args, "--out", str(tmp_path / "whole")], tmp_path / "whole.log")
    assert whole.returncode == 0, whole.stderr[-3000:]

    # This run blocks forever after step 7 (the last checkpoint before it is step 6).
    cut = tmp_path / "cut"
    train_cut = ["train", *args, "--out", str(cut)]
    pids = zygote.start(train_cut, tmp_path / "cut.log", WANDISTILL_FAULT="train:step:7:0:hang")
    try:
        deadline = time.monotonic() + 240  # hang guard only
        while time.monotonic() < deadline and alive(pids[0]):
            latest = resolve_latest(cut / "checkpoints")
            if latest is not None and latest.name == "checkpoint-6":
                break
            time.sleep(0.05)
        assert alive(pids[0]), "the run ended before it could be killed"
    finally:
        kill(pids[0], signal.SIGKILL)
        zygote.wait(pids)
    assert not (cut / "student").exists()

    resumed = zygote.cli([*train_cut, "--resume"], tmp_path / "resumed.log")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "at step 6" in resumed.stderr
    for name in ("student", "student_ema"):
        a = (tmp_path / "whole" / name / "diffusion_pytorch_model.safetensors").read_bytes()
        b = (cut / name / "diffusion_pytorch_model.safetensors").read_bytes()
        assert a == b, f"{name} differs after kill -9 and --resume"


BLOCK_TEACHER = textwrap.dedent(
    """
    import importlib.abc
    import sys


    class NoTeacher(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "wandistill.teacher" or name.startswith("wandistill.teacher."):
                raise ImportError(f"{name} is off limits to train (test guard)")
            return None


    sys.meta_path.insert(0, NoTeacher())
    from wandistill.cli import main

    main(sys.argv[1:])
    """
)


def test_train_needs_no_teacher_and_its_student_samples_in_wan_pipeline(tmp_path: Path) -> None:
    from diffusers import WanPipeline, WanTransformer3DModel

    from wandistill.config import load_recipe
    from wandistill.precompute.run import run as precompute
    from wandistill.teacher.tiny import make_tiny_teacher

    teacher = make_tiny_teacher(tmp_path / "teacher")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat on a mat\na dog in the park\na red car\nthe sea\na tree\nsnow\n")
    cfg = load_recipe(
        REPO / "pipelines" / "tiny.toml",
        [
            f'teacher.path="{teacher}"',
            f'prompts="{prompts}"',
            f'cache.path="{tmp_path / "cache"}"',
            "sampler.num_inference_steps=4",
            "cache.holdout_fraction=0.0",
            "previews=0",
        ],
        stage="precompute",
    ).precompute
    precompute(cfg, quiet=True)

    parked = tmp_path / "parked"
    teacher.rename(parked)  # train must not need the teacher folder...
    script = tmp_path / "no_teacher.py"
    script.write_text(BLOCK_TEACHER)  # ...nor the teacher module
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            "train",
            str(REPO / "pipelines" / "tiny.toml"),
            "--cache",
            str(tmp_path / "cache"),
            "--out",
            str(tmp_path / "run"),
            "--steps",
            "6",
            "--set",
            "batch_size=4",
            "--set",
            "loss.final_latent=0.5",
            "--set",
            'device="cpu"',
            "--set",
            "tensorboard=false",
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not teacher.exists()
    parked.rename(teacher)

    student = WanTransformer3DModel.from_pretrained(tmp_path / "run" / "student")
    pipe = WanPipeline.from_pretrained(teacher, transformer=student)
    latents = pipe(
        prompt="a cat on a mat",
        height=32,
        width=32,
        num_frames=1,
        num_inference_steps=3,
        guidance_scale=1.0,  # the student learned the guided output: one forward per step
        max_sequence_length=32,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
    ).frames
    assert latents.shape == (1, 16, 1, 4, 4) and torch.isfinite(latents).all()
