"""Eval, sample and the demo on the tiny teacher: what a user sees first."""

from __future__ import annotations

import functools
import json
import re
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from wandistill.config import load_recipe
from wandistill.errors import UsageError
from wandistill.eval import grid as gridmod
from wandistill.eval.run import evaluate
from wandistill.eval.sample import SampleOptions, sample
from wandistill.precompute.run import run as precompute
from wandistill.student.folders import read_student
from wandistill.teacher.folder import TeacherFolder
from wandistill.teacher.tiny import make_tiny_teacher
from wandistill.train import run as train

from clirun import cli_env
from zygote import Zygote


@pytest.fixture(scope="module")
def trained(tiny_teacher: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    teacher = tiny_teacher
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(f"prompt {i} about a cat" for i in range(24)) + "\n")
    cfg = load_recipe(
        Path("pipelines/tiny.toml"),
        [
            f'precompute.teacher.path="{teacher}"',
            f'precompute.prompts="{prompts}"',
            f'precompute.cache.path="{root / "cache"}"',
            f'train.cache="{root / "cache"}"',
            f'train.out="{root / "run"}"',
            "precompute.sampler.height=32",
            "precompute.sampler.width=32",
            "precompute.cache.holdout_fraction=0.25",
            "train.steps=30",
            "train.batch_size=8",
            "train.checkpoint_every=30",
            'train.device="cpu"',
        ],
    )
    precompute(cfg.precompute, quiet=True)
    result = train(cfg.train)
    return {
        "teacher": teacher,
        "cache": root / "cache",
        "student": result.student,
        "prompts": prompts,
        "root": root,
    }


def test_eval_with_decode_scores_and_shows_the_teachers_vae_frames(
    trained: dict[str, Path], tmp_path: Path
) -> None:
    student = read_student(trained["student"])
    teacher = TeacherFolder.open(trained["teacher"])
    a = evaluate(trained["cache"], student, tmp_path / "a", teacher=teacher, decode=True)
    assert a.view == "decoded" and a.image_psnr is not None
    assert a.column("teacher@8").image_psnr == 100.0  # the reference against itself
    table = (tmp_path / "a" / "eval.md").read_text()
    for row in ("latent MSE vs teacher@8", "latent PSNR", "image PSNR", "| student@8 | 8 | 8 |"):
        assert row in table
    with Image.open(tmp_path / "a" / "grid.png") as img:
        assert img.size[1] == gridmod.HEADER + a.records * (gridmod.CELL + gridmod.GAP)
    # Only held-out records are scored: none of them was trained on.
    assert a.records == len(a.per_record) < 24


def test_eval_refuses_a_cache_without_held_out_records(
    trained: dict[str, Path], tmp_path: Path
) -> None:
    from cachefixtures import write_cache

    write_cache(tmp_path / "c", range(3))
    with pytest.raises(UsageError, match="no held-out records"):
        evaluate(tmp_path / "c", read_student(trained["student"]), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_sample_writes_pngs_with_the_student_and_with_the_teacher(
    trained: dict[str, Path], tmp_path: Path
) -> None:
    teacher = TeacherFolder.open(trained["teacher"])
    for who, student in (("student", read_student(trained["student"])), ("teacher", None)):
        paths = sample(
            ["a cat", "a dog", "a car"],
            tmp_path / who,
            student=student,
            teacher=teacher,
            options=SampleOptions(
                steps=3, height=32, width=32, num_frames=1, max_sequence_length=32
            ),
        )
        assert len(paths) == 3 and (tmp_path / who / "grid.png").is_file()
        with Image.open(paths[0]) as img:
            assert img.size == (32, 32)


def _env() -> dict[str, str]:
    return cli_env(threads=2, COLUMNS="120")


DEMO_SETS = [  # the demo's recipe, made cheap: 4 teacher steps, a K = 2 student, a few steps
    "precompute.sampler.num_inference_steps=4",
    "precompute.sampler.height=32",
    "precompute.sampler.width=32",
    "train.student.num_inference_steps=2",
    "train.steps=4",
    "train.batch_size=8",
    "train.checkpoint_every=4",
    "train.data_threads=1",
    'train.device="cpu"',
]


@pytest.mark.slow
def test_demo_runs_end_to_end_and_a_rerun_reuses_everything(zygote: Zygote, tmp_path: Path) -> None:
    """The demo's whole path (teacher and prompts given: the tiny random teacher, so no minute
    of teacher training): precompute -> few-step student + baseline -> eval with teacher@K.
    `python` is a fork of the session's zygote (tests/zygote.py): a real process."""
    make_tiny_teacher(tmp_path / "teacher")
    prompts = tmp_path / "prompts.txt"  # given: the trained teacher's grammar is not needed
    prompts.write_text("\n".join(f"a cat number {i}" for i in range(40)) + "\n")
    sets = [*DEMO_SETS, f'precompute.prompts="{prompts}"']
    cmd = [zygote.python, "-m", "wandistill", "demo", "--root", "demo"]  # as a person types it
    cmd += ["--teacher", "teacher", *(x for s in sets for x in ("--set", s))]
    run = functools.partial(
        subprocess.run, cwd=tmp_path, capture_output=True, text=True, timeout=900
    )
    first = run(cmd, env=zygote.env({**_env(), "COLUMNS": "80"}))
    assert first.returncode == 0, first.stderr[-3000:]
    lines = (first.stdout + first.stderr).splitlines()
    wide = [line for line in lines if len(line.rstrip()) > 80]
    assert not wide, "\n".join(wide)  # every line of demo output fits 80 columns
    stages = [line.split(":")[0] for line in lines if line.startswith("demo ")]
    assert stages == [
        "demo 1/5 teacher",
        "demo 2/5 cache",
        "demo 3/5 student",
        "demo 4/5 baseline",
        "demo 5/5 eval",
    ], first.stdout
    assert "wandistill export --run demo/run" in first.stdout
    assert "warning: only" in first.stderr  # 40 prompts hold out too few records to trust
    cells = [re.sub(r"\s+", " ", c).strip() for c in re.split(r"[│┃|]", first.stdout)]
    for row in (["student@2", "2", "2"], ["teacher@2", "2", "4"], ["baseline@4"]):
        at = cells.index(row[0])  # the terminal table: one row per column, cells in order
        assert cells[at : at + len(row)] == row, first.stdout
    assert "R_2 =" in first.stdout, first.stdout
    assert "noise | teacher@4 | teacher@2 | student@2 | baseline@2 | baseline@4" in first.stdout
    made = ("grid.png", "loss.png", "metrics.png", "eval/eval.json", "run/student/config.json")
    for name in made:
        assert (tmp_path / "demo" / name).is_file(), name
    manifest = json.loads((tmp_path / "demo" / "cache" / "manifest.json").read_text())
    again = run(cmd, env=zygote.env(_env()))
    assert again.returncode == 0, again.stderr[-3000:]
    after = json.loads((tmp_path / "demo" / "cache" / "manifest.json").read_text())
    assert after["shards"] == manifest["shards"]  # the cache was reused, not rewritten
    assert json.loads((tmp_path / "demo" / "eval" / "eval.json").read_text())["records"] > 0
