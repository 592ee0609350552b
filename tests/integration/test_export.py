"""Few-step students end to end: precompute -> train (perflow, K = 2) -> export ->
stock `WanPipeline.from_pretrained(EXPORT)`, on the tiny Wan 2.1 and Wan 2.2 teachers."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from wandistill.train.metrics import read_metrics

from clirun import run_cli as _cli

pytestmark = pytest.mark.slow

K = 2
PROMPTS = ["a cat on a mat", "a dog in the park", "a red car", "the sea at night"]
MSL = 32  # the tiny recipe's max_sequence_length: the pipeline must pad the prompt the same way


def _precompute(teacher: Path, prompts: Path, cache: Path, *extra: str) -> None:
    from wandistill.config import load_recipe
    from wandistill.precompute.run import run

    sets = [
        f'teacher.path="{teacher}"',
        f'prompts="{prompts}"',
        f'cache.path="{cache}"',
        "sampler.num_inference_steps=4",
        "sampler.height=32",
        "sampler.width=32",
        "sampler.batch_size=4",
        "cache.holdout_fraction=0.0",
        "previews=0",
        *extra,
    ]
    run(load_recipe(Path("pipelines/tiny.toml"), sets, stage="precompute").precompute, quiet=True)


def _train(sets: list[str], cache: Path, out: Path) -> None:
    from wandistill.config import load_recipe
    from wandistill.train import run

    cfg = load_recipe(
        Path("pipelines/tiny.toml"), [*sets, f'cache="{cache}"', f'out="{out}"'], stage="train"
    ).train
    run(cfg)


TRAIN = [
    "steps=24",
    "batch_size=4",
    "log_every=4",
    "checkpoint_every=24",
    "data_threads=1",
    'device="cpu"',
    "tensorboard=false",
    "optim.warmup_steps=0",
    f"student.num_inference_steps={K}",
    "loss.output=0.0",
    "loss.final_latent=0.0",
    "loss.perflow=1.0",
]


@pytest.fixture(scope="module")
def world(
    tiny_teacher: Path, tiny_teacher_wan22: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Tiny Wan 2.1 and 2.2 teachers, a cache of each (every step of 4 recorded), a K = 2
    student trained on each, and a cache of the 2.1 teacher recording every 2nd step only."""
    root = tmp_path_factory.mktemp("fewstep")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    w = {"root": root, "prompts": prompts}
    teachers = {"wan21": tiny_teacher, "wan22": tiny_teacher_wan22}
    for layout in ("wan21", "wan22"):
        w[f"teacher_{layout}"] = teachers[layout]
        _precompute(w[f"teacher_{layout}"], prompts, root / f"cache_{layout}")
        _train(TRAIN, root / f"cache_{layout}", root / f"run_{layout}")
        w[f"cache_{layout}"], w[f"run_{layout}"] = root / f"cache_{layout}", root / f"run_{layout}"
    _precompute(w["teacher_wan21"], prompts, root / "sparse", "sampler.record_every=2")
    w["sparse"] = root / "sparse"
    return w


def _export(capsys, world: dict[str, Path], layout: str, out: Path, *flags: str) -> str:
    code, stdout, err = _cli(
        capsys,
        "export",
        "--run",
        str(world[f"run_{layout}"]),
        "--teacher",
        str(world[f"teacher_{layout}"]),
        "--out",
        str(out),
        *flags,
    )
    assert code == 0, err
    return stdout


@pytest.mark.parametrize("layout", ["wan21", "wan22"])
def test_the_exported_folder_in_stock_wan_pipeline_equals_the_students_own_sampler(
    tmp_path: Path, world: dict[str, Path], layout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from diffusers import WanPipeline, WanTransformer3DModel

    from wandistill.cache import open_cache
    from wandistill.cache.contract import pad_embeds
    from wandistill.student.sampler import sample_latents, student_pipeline
    from wandistill.student.schedule import StudentSchedule

    out = tmp_path / "export"
    assert f"num_inference_steps={K}, guidance_scale=1.0" in _export(capsys, world, layout, out)
    pipe = WanPipeline.from_pretrained(out)
    pipe.set_progress_bar_config(disable=True)
    # One student for every step: no second expert, no boundary (Wan 2.2 included).
    assert pipe.transformer_2 is None and pipe.config.boundary_ratio is None
    sampling = json.loads((world[f"run_{layout}"] / "sampling.json").read_text())
    schedule = StudentSchedule.from_json(sampling["student_schedule"])
    student = WanTransformer3DModel.from_pretrained(world[f"run_{layout}"] / "student_ema")
    ours = student_pipeline(student, schedule)
    with open_cache(world[f"cache_{layout}"]) as store:
        records = list(store.records())[:2]
    for rec in records:
        theirs = pipe(
            rec.prompt,
            num_inference_steps=K,
            guidance_scale=1.0,
            latents=rec.noise[None],
            height=32,
            width=32,
            num_frames=1,
            max_sequence_length=MSL,
            output_type="latent",
        ).frames
        mine = sample_latents(ours, rec.noise[None], pad_embeds(rec.prompt_embeds, MSL)[None], K)
        # The same WanPipeline code, weights and scheduler on both sides; the prompt goes through
        # the linked text encoder here and came from the cache there (encoded in a batch of 4),
        # so at most float32 rounding of the encoder may differ. On CPU it is bit-identical.
        torch.testing.assert_close(theirs, mine, rtol=0, atol=1e-5)
        assert theirs.abs().max() > 0.1  # a real latent, not zeros


@pytest.mark.parametrize("layout", ["wan21", "wan22"])
def test_perflow_trains_one_k_step_student_over_the_whole_trajectory(
    world: dict[str, Path], layout: str
) -> None:
    sampling = json.loads((world[f"run_{layout}"] / "sampling.json").read_text())
    assert sampling["num_inference_steps"] == K
    assert sampling["student_schedule"]["teacher_steps"] == [0, 2]
    assert sampling["objectives"] == {"perflow": [0, 2]}
    rows = [r for r in read_metrics(world[f"run_{layout}"]) if "loss" in r]
    assert all(r["loss_perflow"] > 0 for r in rows)
    assert rows[-1]["loss_perflow"] < rows[0]["loss_perflow"]
    if layout == "wan22":  # steps on both sides of the expert boundary (t = 875)
        from wandistill.cache import open_cache

        with open_cache(world["cache_wan22"]) as store:
            t = next(iter(store.records())).timesteps
        assert (t >= 875).any() and (t < 875).any()


def test_the_export_folder_is_complete_linked_readable_and_replaceable(
    tmp_path: Path, world: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "export"
    _export(capsys, world, "wan22", out)
    index = json.loads((out / "model_index.json").read_text())
    assert index["transformer_2"] == [None, None] and "boundary_ratio" not in index
    assert index["transformer"] == ["diffusers", "WanTransformer3DModel"]
    teacher = world["teacher_wan22"]
    for name in ("tokenizer", "text_encoder", "vae"):
        assert (out / name).is_symlink()
        assert Path(os.readlink(out / name)) == (teacher / name).resolve()
    scheduler = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["solver_order"] == 1 and scheduler["disable_corrector"] == list(range(K))
    mask = os.umask(0)
    os.umask(mask)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~mask  # not mkdtemp's 0700
    weights = out / "transformer" / "diffusion_pytorch_model.safetensors"
    assert (weights.stat().st_mode & 0o777) == 0o666 & ~mask
    marker = json.loads((out / "wandistill_export.json").read_text())
    assert marker["num_inference_steps"] == K and marker["weights"] == "student_ema"
    # An export over an export replaces it; --copy makes real folders; --no-ema the raw weights.
    _export(capsys, world, "wan22", out, "--copy", "--no-ema")
    assert (out / "text_encoder").is_dir() and not (out / "text_encoder").is_symlink()
    assert json.loads((out / "wandistill_export.json").read_text())["weights"] == "student"
    assert [p.name for p in tmp_path.iterdir()] == ["export"], "no temp folder left behind"
    pieces = {"model_index.json", "transformer", "scheduler", "tokenizer", "text_encoder", "vae"}
    assert {p.name for p in out.iterdir()} == pieces | {
        "wandistill_export.json",
        ".wandistill.json",
        ".wandistill.lock",
    }


def test_an_export_over_an_export_removes_the_old_index_first_and_installs_the_new_one_last(
    tmp_path: Path,
    world: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reader that finds model_index.json finds every piece it names: while the entries move,
    OUT has no model_index.json."""
    from wandistill.student import export as export_mod

    out = tmp_path / "export"
    _export(capsys, world, "wan21", out)
    (out / ".wandistill.json").unlink()  # an export made before output claims: still adopted
    moves: list[tuple[str, str]] = []
    real = os.replace

    def replace(src: str | Path, dst: str | Path) -> None:
        if Path(dst).is_relative_to(out) and not Path(src).name.endswith(".tmp"):
            moves.append((Path(src).name, str(Path(dst).relative_to(out))))  # not atomic writes
        real(src, dst)

    monkeypatch.setattr(export_mod.os, "replace", replace)
    _export(capsys, world, "wan21", out)
    first, last = moves[0], moves[-1]
    assert first[0] == "model_index.json" and first[1].startswith(".export.old")
    assert last == ("model_index.json", "model_index.json")
    installed = [dst for _, dst in moves if not dst.startswith(".")]
    assert set(installed) >= {"transformer", "scheduler", "vae", "wandistill_export.json"}


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_export_refuses_bad_runs_teachers_and_outputs_writing_nothing(
    tmp_path: Path, world: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("keep me")
    unfinished = tmp_path / "unfinished"
    shutil.copytree(world["run_wan21"], unfinished)
    (unfinished / "sampling.json").unlink()
    nan_run = tmp_path / "nan"
    shutil.copytree(world["run_wan21"], nan_run)
    weights = nan_run / "student_ema" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    first = sorted(tensors)[0]
    tensors[first] = torch.full_like(tensors[first], float("nan"))
    save_file(tensors, weights)
    from wandistill.teacher.tiny import make_tiny_teacher

    other = make_tiny_teacher(tmp_path / "other", seed=5)  # another text encoder and VAE
    run21, t21 = world["run_wan21"], world["teacher_wan21"]
    evals = tmp_path / "evals"  # a folder wandistill wrote for another purpose
    code, _, err = _cli(capsys, "eval", "--cache", str(world["cache_wan21"]), "--run", str(run21),
                        "--split", "all", "--max-records", "1", "--out", str(evals))  # fmt: skip
    assert code == 0, err
    cases = [
        (run21, t21, foreign, "is not empty and was not written by wandistill"),
        (run21, t21, evals, "is a wandistill eval folder, not an export folder"),
        (unfinished, t21, tmp_path / "a", "holds no finished student"),
        (nan_run, t21, tmp_path / "b", "hold NaN or inf"),
        (run21, other, tmp_path / "c", "is not the one the run's cache was made with"),
    ]
    before = _snapshot(tmp_path)
    for run, teacher, out, message in cases:
        args = ["export", "--run", str(run), "--teacher", str(teacher), "--out", str(out)]
        code, _, err = _cli(capsys, *args)
        assert code == 2 and message in err and "Traceback" not in err, err
        assert err.count("error:") == 1
    assert _snapshot(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "evals",
        "nan",
        "notes",
        "other",
        "unfinished",
    ]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["student.num_inference_steps=3"], "does not land on the teacher's 4-step one"),
        (["student.num_inference_steps=8"], "exceeds the teacher's 4 steps"),
        (["student.num_inference_steps=4"], "is more than the 2 steps the cache recorded"),
        (["loss.perflow=1.0", "student.num_inference_steps=4"], "perflow trains the 4-step"),
    ],
)
def test_train_refuses_objectives_the_cache_cannot_serve_before_writing_anything(
    tmp_path: Path,
    world: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    sets: list[str],
    message: str,
) -> None:
    args = ["train", "--cache", str(world["sparse"]), "--out", str(tmp_path / "run")]
    for s in sets:
        args += ["--set", s]
    code, _, err = _cli(capsys, *args)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert err.count("error:") == 1 and ("choose K" in err or "re-run precompute" in err), err
    assert not (tmp_path / "run").exists()


def test_perflow_trains_from_a_cache_of_the_students_steps_alone(
    tmp_path: Path, world: dict[str, Path]
) -> None:
    """K = 2 on a cache of every 2nd step: perflow's windows [0 -> 2 -> final latent] are all
    there; no teacher forward, the term falls."""
    objective = "perflow"
    weights = ["loss.output=0.0", "loss.final_latent=0.0", f"loss.{objective}=1.0"]
    out = tmp_path / "run"
    _train([s for s in TRAIN if not s.startswith("loss.")] + weights, world["sparse"], out)
    assert json.loads((out / "sampling.json").read_text())["objectives"][objective] == [0, 2]
    rows = [r for r in read_metrics(out) if "loss" in r]
    assert all(r[f"loss_{objective}"] == r["loss"] for r in rows)
    assert rows[-1][f"loss_{objective}"] < rows[0][f"loss_{objective}"]


def test_a_student_depth_the_teachers_blocks_cannot_initialise_is_refused_before_writing(
    tmp_path: Path, world: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["train", "--cache", str(world["sparse"]), "--out", str(tmp_path / "run")]
    teacher = world["teacher_wan21"]
    for s in (
        "student.num_layers=1",
        "student.ffn_dim=32",  # the teacher's width: only the block index is wrong
        f'student.init_from_teacher.path="{teacher}"',
        "student.init_from_teacher.blocks=[2]",
    ):
        args += ["--set", s]
    code, _, err = _cli(capsys, *args)
    assert code == 2 and "Traceback" not in err and err.count("error:") == 1, err
    assert "names teacher block(s) [2], but the teacher has 2 (0..1)" in err
    assert not (tmp_path / "run").exists()
    # Half the teacher's depth from its first block trains (the bench's `half` student).
    half = tmp_path / "half"
    sets = [s for s in TRAIN if s not in ("steps=24", "checkpoint_every=24")]
    sets += ["steps=4", "checkpoint_every=4", "student.num_layers=1", "student.ffn_dim=32"]
    sets += [f'student.init_from_teacher.path="{teacher}"', "student.init_from_teacher.blocks=[0]"]
    _train(sets, world["sparse"], half)
    config = json.loads((half / "student" / "config.json").read_text())
    assert config["num_layers"] == 1


def test_dry_runs_show_the_recorded_steps_each_objective_uses(
    world: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["train", "--cache", str(world["cache_wan22"]), "--dry-run"]
    sets = [*TRAIN, "loss.output=1.0"]  # output at every recorded step, perflow at K's
    code, out, err = _cli(capsys, *args, *(x for s in sets for x in ("--set", s)))
    assert code == 0, err
    assert "student: K = 2 steps with first-order UniPCMultistepScheduler" in out
    lines = [line.split() for line in out.splitlines() if "sigma=" in line]
    assert [line[0] for line in lines] == ["0:", "1:", "2:", "3:"]
    assert "perflow" in lines[2] and "perflow" not in lines[1]
    assert "transformer" in lines[0] and "transformer_2" in lines[3]
    code, out, err = _cli(
        capsys,
        "precompute",
        "pipelines/tiny.toml",
        "--teacher",
        str(world["teacher_wan21"]),
        "--set",
        "sampler.num_inference_steps=8",
        "--set",
        "sampler.record_for_student_steps=[2, 4]",
        "--dry-run",
    )
    assert code == 0 and "precompute records 4 of 8 steps: [0, 2, 4, 6]" in out, err
