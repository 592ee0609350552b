"""Eval and sample of few-step students: the columns a user compares, the export path, bad inputs.

One tiny world shared by the module: a tiny Wan 2.1 teacher, a cache (4 steps, CFG, a quarter
held out), a K = 2 student (perflow) and a step-imitating baseline, a few
optimiser steps each (the figures need not be good, only computed the way they claim)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from wandistill.eval import grid as gridmod
from wandistill.eval.equivalent import place
from wandistill.eval.run import evaluate
from wandistill.student.folders import read_run
from wandistill.teacher.folder import TeacherFolder

from clirun import run_cli as _cli

pytestmark = pytest.mark.slow

PROMPTS = [f"a {c} {s}" for c in ("red", "blue", "green", "white") for s in ("cat", "boat", "tree")]
COMMON = ["steps=6", "batch_size=4", "checkpoint_every=6", 'device="cpu"', "data_threads=1"]
FEWSTEP = [
    "student.num_inference_steps=2",
    "loss.output=0.0",
    "loss.final_latent=0.0",
    "loss.perflow=1.0",
]


@pytest.fixture(scope="module")
def world(tiny_teacher: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from wandistill.config import load_recipe
    from wandistill.precompute.run import run as precompute
    from wandistill.train import run as train

    root = tmp_path_factory.mktemp("evalk")
    teacher = tiny_teacher
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    sets = [
        f'teacher.path="{teacher}"',
        f'prompts="{root / "prompts.txt"}"',
        f'cache.path="{root / "cache"}"',
        "sampler.num_inference_steps=4",
        "sampler.height=32",
        "sampler.width=32",
        "cache.holdout_fraction=0.25",
        "previews=0",
    ]
    precompute(load_recipe("tiny", sets, stage="precompute").precompute, quiet=True)
    for name, extra in (("fewstep", FEWSTEP), ("baseline", [])):
        where = [f'cache="{root / "cache"}"', f'out="{root / name}"']
        train(load_recipe("tiny", [*COMMON, *where, *extra], stage="train").train)
    return {
        "root": root,
        "teacher": teacher,
        "cache": root / "cache",
        **{n: root / n for n in ("fewstep", "baseline", "prompts.txt")},
    }


def _figures(path: Path) -> dict:
    """eval.json without the wall times (the only figures that do not repeat)."""
    data = json.loads(path.read_text())
    data.pop("grid")
    for c in data["columns"]:
        c.pop("seconds_per_sample")
    return data


def test_eval_sets_the_k_step_student_beside_the_teacher_at_k_and_a_step_imitating_baseline(
    world: dict[str, Path], tmp_path: Path
) -> None:
    teacher = TeacherFolder.open(world["teacher"])
    args = dict(teacher=teacher, baseline=read_run(world["baseline"], flag="--baseline"))
    result = evaluate(world["cache"], read_run(world["fewstep"]), tmp_path / "a", **args)
    evaluate(world["cache"], read_run(world["fewstep"]), tmp_path / "b", **args)
    names = [c.name for c in result.columns]
    assert names == ["noise", "teacher@4", "teacher@2", "student@2", "baseline@2", "baseline@4"]
    by = {c.name: c for c in result.columns}
    # forwards per sample: CFG doubles the teacher's; a student takes one forward per step
    assert [by[n].forwards_per_sample for n in names] == [0, 8, 4, 2, 2, 4]
    assert all(by[n].seconds_per_sample > 0 for n in names[2:])
    assert by["teacher@4"].latent_mse == 0 and by["teacher@2"].latent_mse > 0
    assert result.r_k == pytest.approx(by["student@2"].latent_mse / by["teacher@2"].latent_mse)
    assert result.baseline_r_k == pytest.approx(
        by["baseline@2"].latent_mse / by["teacher@2"].latent_mse
    )
    # equivalent steps: the teacher re-sampled at 2..N from the same noise, the student placed
    curve = {int(s): m for s, m in result.teacher_curve.items()}
    assert sorted(curve) == [2, 3, 4]
    assert curve[2] == pytest.approx(by["teacher@2"].latent_mse)
    assert curve[4] < 1e-10 < min(curve[2], curve[3])  # teacher@N again lands on the cache
    for name in ("student@2", "baseline@2", "baseline@4"):
        where = place(curve, by[name].latent_mse)
        assert (by[name].equivalent, by[name].equivalent_steps) == (where.text, where.steps)
    student = by["student@2"]
    if student.equivalent_steps is not None:  # on the curve (this untrained teacher's curve
        assert 2 <= student.equivalent_steps <= 4  # need not fall monotonically)
    table = (tmp_path / "a" / "eval.md").read_text()
    for text in (
        "| student@2 | 2 | 2 |",
        "| teacher@2 | 2 | 4 |",
        "R_2 = MSE(student@2",
        f"student@2 ~ {student.equivalent} on the teacher's own curve",
        f" {student.equivalent} |",
    ):
        assert text in table
    assert json.loads((tmp_path / "a" / "eval.json").read_text())["teacher_curve"].keys() == {
        "2",
        "3",
        "4",
    }
    assert _figures(tmp_path / "a" / "eval.json") == _figures(tmp_path / "b" / "eval.json")
    rows = result.records
    with Image.open(tmp_path / "a" / "grid.png") as img:
        width, height = img.size
        header = np.asarray(img.convert("L"))[: gridmod.HEADER]
    assert height == gridmod.HEADER + rows * (gridmod.CELL + gridmod.GAP)
    assert width == gridmod.LABEL_WIDTH + len(names) * (gridmod.CELL + gridmod.GAP)
    assert (header < 128).any()  # the column names are drawn


def test_the_teacher_column_at_n_steps_reproduces_the_cached_final_latents(
    world: dict[str, Path], tmp_path: Path
) -> None:
    """teacher@K uses the cache's noise, embeddings, negative prompt, scheduler and CFG: at
    K = N it lands on the cached trajectory's end."""
    base = read_run(world["baseline"])  # a step-imitation student samples N = 4 steps
    result = evaluate(
        world["cache"], base, tmp_path / "e", teacher=TeacherFolder.open(world["teacher"])
    )
    again = result.column("teacher@4 again")
    assert again.forwards_per_sample == 8
    assert again.latent_mse < 1e-10


def test_sample_from_an_export_equals_wan_pipeline_from_pretrained_on_the_same_seed(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from diffusers import WanPipeline

    export, png = tmp_path / "export", tmp_path / "png"
    common = ["--prompts", world["prompts.txt"], "--limit", "2", "--seed", "7"]
    code, _, err = _cli(
        capsys, "export", "--run", world["fewstep"], "--teacher", world["teacher"], "--out", export
    )
    assert code == 0, err
    code, _, err = _cli(capsys, "sample", "--export", export, "--out", png, *common)
    assert code == 0, err
    pipe = WanPipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    for i, prompt in enumerate(PROMPTS[:2]):
        # The defaults the export recorded: K = 2, guidance 1, the cache's 32x32 and 32 tokens.
        frames = pipe(
            prompt,
            num_inference_steps=2,
            guidance_scale=1.0,
            height=32,
            width=32,
            num_frames=1,
            max_sequence_length=32,
            generator=torch.Generator().manual_seed(7 + i),
            output_type="np",
        ).frames[0]
        expected = (np.asarray(frames[0]) * 255).round().astype(np.uint8)
        with Image.open(png / f"{i:04d}.png") as img:
            np.testing.assert_array_equal(np.asarray(img), expected)
    # The run's student with its teacher's text encoder and VAE is that same pipeline.
    code, _, err = _cli(
        capsys,
        "sample",
        "--run",
        world["fewstep"],
        "--teacher",
        world["teacher"],
        "--out",
        tmp_path / "run",
        *common,
    )
    assert code == 0, err
    for i in range(2):
        with (
            Image.open(png / f"{i:04d}.png") as a,
            Image.open(tmp_path / "run" / f"{i:04d}.png") as b,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sample_of_the_teacher_alone_takes_its_sizes_from_the_cache_or_the_recipe(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not WanPipeline's 480x832x81: the cache's 32x32 (and its N, CFG), or the recipe's 64x64."""
    common = ["sample", "--teacher", world["teacher"], "--prompts", world["prompts.txt"]]
    common += ["--limit", "1", "--steps", "1"]
    for flag, value, size in (("--cache", world["cache"], 32), ("--recipe", "tiny", 64)):
        out = tmp_path / flag.strip("-")
        code, _, err = _cli(capsys, *common, flag, value, "--out", out)
        assert code == 0, err
        with Image.open(out / "0000.png") as img:
            assert img.size == (size, size)
    code, _, err = _cli(capsys, *common, "--cache", world["cache"], "--recipe", "tiny", "--out",
                        tmp_path / "x")  # fmt: skip
    assert code == 2 and "--cache and --recipe both given" in err


def test_eval_warns_in_one_line_with_the_fix_when_too_few_records_are_held_out(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """12 prompts, a quarter held out: a mean over 3 records is noise, and the user is told how
    to get more; asking for fewer with --max-records is not warned about."""
    args = ["eval", "--cache", world["cache"], "--run", world["baseline"]]
    on = ["--teacher", world["teacher"], "--device", "auto"]  # auto: the CPU here, planned
    code, out, err = _cli(capsys, *args, *on, "--out", tmp_path / "a")
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and len(err.strip().splitlines()) == 1, err
    for text in ("held-out records", "cache.holdout_fraction = 0.25", "--split all"):
        assert text in warnings[0], err
    assert "Warning: only" in (tmp_path / "a" / "eval.md").read_text()
    code, out, err = _cli(capsys, *args, "--out", tmp_path / "b", "--max-records", "2")
    assert code == 0 and "warning" not in err, err


def test_eval_and_sample_refuse_bad_inputs_in_one_line_writing_nothing(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from wandistill.teacher.tiny import make_tiny_teacher

    unfinished = tmp_path / "unfinished"
    shutil.copytree(world["fewstep"], unfinished)
    (unfinished / "sampling.json").unlink()
    damaged = tmp_path / "damaged"
    shutil.copytree(world["fewstep"], damaged)
    sampling = json.loads((damaged / "sampling.json").read_text())
    sampling["student_schedule"]["num_inference_steps"] = "two"
    (damaged / "sampling.json").write_text(json.dumps(sampling))
    export = tmp_path / "export"
    code, _, err = _cli(
        capsys, "export", "--run", world["fewstep"], "--teacher", world["teacher"], "--out", export
    )
    assert code == 0, err
    shutil.rmtree(export / "transformer")
    other = make_tiny_teacher(tmp_path / "other", seed=3)
    eval_ = ["eval", "--cache", world["cache"], "--out", tmp_path / "o"]
    run_teacher = ["--run", world["fewstep"], "--teacher", world["teacher"]]
    sample = ["sample", "--prompts", world["prompts.txt"], "--out", tmp_path / "o"]
    cases = [
        ([*eval_, "--run", unfinished], "holds no finished student"),
        ([*sample, "--run", unfinished, "--teacher", world["teacher"]], "no finished student"),
        ([*eval_, "--run", damaged], "student_schedule.num_inference_steps must be an integer"),
        ([*sample, "--export", export], "is incomplete: transformer missing"),
        ([*eval_, "--export", export], "is incomplete: transformer missing"),
        ([*eval_, "--run", world["fewstep"], "--steps", "4"], "beyond the 2 steps"),
        (
            [*sample, "--run", world["fewstep"], "--teacher", world["teacher"], "--steps", "3"],
            "beyond the 2 steps",
        ),
        ([*eval_, "--run", world["fewstep"], "--teacher", other], "is not the teacher cache"),
        ([*sample, "--run", world["fewstep"], "--teacher", other], "is not the one the run's"),
        ([*eval_, "--run", world["fewstep"], "--export", export], "both name a student"),
        ([*sample, "--run", world["fewstep"]], "needs --teacher"),
        ([*sample, *run_teacher, "--cache", world["cache"]], "--cache sets the teacher's defaults"),
    ]
    for args, message in cases:
        code, _, err = _cli(capsys, *args)
        assert code == 2 and message in err and "Traceback" not in err, (args, err)
        assert err.count("error:") == 1, err
        assert not (tmp_path / "o").exists()


def test_unroll_alone_trains_the_k_step_sampler_from_the_cached_noise(
    world: dict[str, Path], tmp_path: Path
) -> None:
    """loss.unroll: one sample per record (at the student's first step), the student's K-step
    sampler from its cached noise matched to its final latent; no forward at recorded x_t."""
    from wandistill.config import load_recipe
    from wandistill.train import run as train
    from wandistill.train.metrics import read_metrics

    out = tmp_path / "unroll"
    sets = [*COMMON, "steps=8", "student.num_inference_steps=2", "loss.output=0.0"]
    sets += ["loss.final_latent=0.0"]
    sets += ["loss.unroll=1.0", f'cache="{world["cache"]}"', f'out="{out}"']
    train(load_recipe("tiny", sets, stage="train").train)
    assert json.loads((out / "sampling.json").read_text())["objectives"] == {"unroll": [0]}
    rows = [r for r in read_metrics(out) if "loss" in r]
    assert rows and all("loss_output" not in r and r["loss_unroll"] == r["loss"] for r in rows)
    result = evaluate(world["cache"], read_run(out), tmp_path / "e")
    assert result.student.name == "student@2" and result.latent_mse > 0


def test_an_unroll_whose_k_steps_do_not_fit_is_refused_naming_the_checkpoint_lever(
    world: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import wandistill.student.unroll as unroll

    monkeypatch.setattr(unroll, "device_memory", lambda device: 1 << 10)  # a 1 KiB device
    args = ["train", "--cache", str(world["cache"]), "--out", str(tmp_path / "run")]
    for s in ("loss.output=0.0", "loss.final_latent=0.0", "loss.unroll=1.0"):
        args += ["--set", s]
    args += ["--set", "loss.unroll_checkpoint=false", "--set", "student.num_inference_steps=4"]
    code, _, err = _cli(capsys, *args)
    assert code == 2 and "Traceback" not in err and err.count("error:") == 1, err
    assert "K = 4 student steps" in err and "set loss.unroll_checkpoint = true" in err
    assert not (tmp_path / "run").exists()


def test_a_teacher_curve_beyond_the_caches_n_is_refused_before_writing(
    world: dict[str, Path], tmp_path: Path
) -> None:
    from wandistill.errors import UsageError

    teacher = TeacherFolder.open(world["teacher"])
    with pytest.raises(UsageError, match=r"teacher curve steps \[2, 9\] leave 1..4"):
        evaluate(world["cache"], read_run(world["fewstep"]), tmp_path / "x", teacher=teacher,
                 curve=[2, 9])  # fmt: skip
    assert not (tmp_path / "x").exists()
    few = evaluate(
        world["cache"], read_run(world["fewstep"]), tmp_path / "y", teacher=teacher, curve=[]
    )
    assert few.teacher_curve == {} and few.student.equivalent is None
    assert "~ teacher steps" not in (tmp_path / "y" / "eval.md").read_text()
