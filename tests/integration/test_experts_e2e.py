"""One student per Wan 2.2 expert, end to end: tiny Wan 2.2 teacher -> precompute -> train
`student.experts = "per-expert"` (K = 2: one step per expert) -> export -> stock
`WanPipeline.from_pretrained(EXPORT)` equals the project's sampler; eval and sample route the
same way; the bad inputs (Wan 2.1 cache, K too small, a resume that changes experts) write
nothing. Per-expert LoRA students (one adapter per expert) on the same cache: their two LoRA
files in the stock teacher pipeline (`load_lora_weights`, the second with
`load_into_transformer_2=True`) equal the project's sampler."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from wandistill.cache.manifest import read_manifest
from wandistill.train.metrics import read_metrics

from cachefixtures import write_cache
from clirun import run_cli

pytestmark = pytest.mark.slow

K = 2
MSL = 32
PROMPTS = ["a cat on a mat", "a dog in the park", "a red car", "the sea at night"]
TRAIN = [
    "steps=8",
    "batch_size=4",
    "log_every=2",
    "checkpoint_every=8",
    "data_threads=1",
    'device="cpu"',
    "tensorboard=false",
    "optim.warmup_steps=0",
    f"student.num_inference_steps={K}",
    'student.experts="per-expert"',
    "loss.output=0.0",
    "loss.final_latent=0.0",
    "loss.perflow=1.0",
]


@pytest.fixture(scope="module")
def world(tiny_teacher_wan22: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Wan 2.2 teacher, a cache of it (4 steps, all recorded) and a per-expert run."""
    from wandistill.config import load_recipe
    from wandistill.precompute.run import run as precompute
    from wandistill.train import run as train

    root = tmp_path_factory.mktemp("experts")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    teacher = tiny_teacher_wan22
    sets = [
        f'teacher.path="{teacher}"',
        f'prompts="{prompts}"',
        f'cache.path="{root / "cache"}"',
        "sampler.num_inference_steps=4",
        "sampler.height=32",
        "sampler.width=32",
        "sampler.batch_size=4",
        "cache.holdout_fraction=0.0",
        "previews=0",
    ]
    tiny = Path("pipelines/tiny.toml")
    precompute(load_recipe(tiny, sets, stage="precompute").precompute, quiet=True)
    init = [f'student.init_from_teacher.path="{teacher}"', "student.ffn_dim=32"]
    where = [f'cache="{root / "cache"}"', f'out="{root / "run"}"']
    with contextlib.redirect_stderr(io.StringIO()) as said:
        train(load_recipe(tiny, [*TRAIN, *init, *where], stage="train").train)
    return {
        "root": root,
        "teacher": teacher,
        "cache": root / "cache",
        "run": root / "run",
        "said": " ".join(said.getvalue().split()),  # type: ignore[dict-item]
    }


def _snapshot(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def test_the_cache_says_which_expert_made_each_point_and_the_run_splits_k_at_the_boundary(
    world: dict[str, Path],
) -> None:
    manifest = json.loads((world["cache"] / "manifest.json").read_text())
    assert manifest["dims"]["recorded_experts"] == ["transformer"] * 2 + ["transformer_2"] * 2
    sampling = json.loads((world["run"] / "sampling.json").read_text())
    assert sampling["experts"] == {
        "boundary_ratio": 0.875,
        "boundary_timestep": 875.0,
        "transformer_steps": [0],
        "transformer_2_steps": [1],
    }
    ck = world["run"] / "checkpoints" / "checkpoint-8" / "student.safetensors"
    with safe_open(ck, framework="pt") as f:
        prefixes = {k.split(".", 1)[0] for k in f.keys()}  # noqa: SIM118
    assert prefixes == {"transformer", "transformer_2"}
    rows = [r for r in read_metrics(world["run"]) if "loss" in r]
    assert rows and all(r["loss_perflow"] > 0 for r in rows)
    assert (
        "train: per-expert students split at t = 875: K-step steps [0] -> transformer, "
        "[1] -> transformer_2"
    ) in world["said"]


def test_each_expert_starts_from_its_own_teacher_expert(world: dict[str, Path]) -> None:
    from wandistill.config import load_recipe
    from wandistill.student import experts

    cfg = load_recipe(
        Path("pipelines/tiny.toml"),
        [*TRAIN, f'student.init_from_teacher.path="{world["teacher"]}"', "student.ffn_dim=32"],
        stage="train",
    ).train
    config = json.loads((world["run"] / "student" / "transformer" / "config.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    settings = read_manifest(world["cache"]).settings
    pair = experts.build(cfg.student, config, settings, seed=0)
    for name in experts.EXPERTS:
        path = world["teacher"] / name / "diffusion_pytorch_model.safetensors"
        with safe_open(path, framework="pt") as f:
            theirs = f.get_tensor("patch_embedding.weight")
        mine = getattr(pair, name).state_dict()["patch_embedding.weight"]
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_stock_wan_pipeline_of_the_export_equals_the_projects_sampler_and_uses_both_experts(
    tmp_path: Path, world: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from diffusers import WanPipeline

    from wandistill.cache import open_cache
    from wandistill.cache.contract import pad_embeds
    from wandistill.student.folders import read_run
    from wandistill.student.sampler import sample_latents, student_pipeline

    out = tmp_path / "export"
    code, _, err = run_cli(
        capsys, "export", "--run", world["run"], "--teacher", world["teacher"], "--out", out
    )
    assert code == 0, err
    index = json.loads((out / "model_index.json").read_text())
    assert index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    assert index["boundary_ratio"] == 0.875
    pipe = WanPipeline.from_pretrained(out)
    pipe.set_progress_bar_config(disable=True)
    student = read_run(world["run"])
    ours = student_pipeline(student.load(), student.schedule)
    high_only = student_pipeline(student.load().transformer, student.schedule)
    with open_cache(world["cache"]) as store:
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
        embeds = pad_embeds(rec.prompt_embeds, MSL)[None]
        mine = sample_latents(ours, rec.noise[None], embeds, K)
        torch.testing.assert_close(theirs, mine, rtol=0, atol=1e-5)
        one = sample_latents(high_only, rec.noise[None], embeds, K)
        assert (one - mine).abs().max() > 1e-3  # the low-noise expert took the second step


def test_sample_from_the_run_equals_sample_from_its_export_and_eval_runs(
    tmp_path: Path, world: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    export = tmp_path / "export"
    run_cli(capsys, "export", "--run", world["run"], "--teacher", world["teacher"], "--out", export)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat on a mat\n")
    pngs = {}
    for name, flags in (
        ("run", ["--run", world["run"], "--teacher", world["teacher"]]),
        ("export", ["--export", export]),
    ):
        code, _, err = run_cli(
            capsys, "sample", "--prompts", prompts, "--out", tmp_path / f"png_{name}", *flags
        )
        assert code == 0, err
        pngs[name] = (tmp_path / f"png_{name}" / "0000.png").read_bytes()
    assert pngs["run"] == pngs["export"]
    code, _, err = run_cli(
        capsys, "eval", "--run", world["run"], "--cache", world["cache"], "--split", "all",
        "--out", tmp_path / "eval",
    )  # fmt: skip
    assert code == 0, err
    assert (tmp_path / "eval" / "eval.json").is_file()


def _train_cli(
    capsys: pytest.CaptureFixture[str], cache: Path, out: Path, *sets: str, base: list[str] = TRAIN
) -> tuple[int, str]:
    flags = [f for s in [*base, *sets] for f in ("--set", f"train.{s}")]
    code, _, err = run_cli(
        capsys, "train", "pipelines/tiny.toml", "--cache", cache, "--out", out, *flags
    )
    return code, err


def _one_error(err: str) -> str:
    assert "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
    return line


def test_a_k_too_small_for_two_experts_is_refused_naming_the_smallest_k_writing_nothing(
    tmp_path: Path, world: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    code, err = _train_cli(capsys, world["cache"], out, "student.num_inference_steps=1")
    assert code == 2
    assert "leaving transformer_2 without a step" in _one_error(err)
    assert "train.student.num_inference_steps = 2" in err
    assert not out.exists()


def test_per_expert_on_a_wan21_cache_is_refused_writing_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "wan21"
    write_cache(cache, range(4))  # a one-expert teacher's cache: no boundary_ratio
    out = tmp_path / "run"
    step_imitation = [s for s in TRAIN if not s.startswith("student.num_inference_steps")]
    code, err = _train_cli(capsys, cache, out, base=step_imitation)
    assert code == 2
    assert "needs a cache of a Wan 2.2 A14B teacher" in _one_error(err)
    assert "train.student.experts = 'one'" in err
    assert not out.exists()


def test_a_resume_that_changes_experts_is_refused_leaving_the_run_as_it_was(
    world: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    before = _snapshot(world["run"])
    code, err = _train_cli(
        capsys, world["cache"], world["run"], 'student.experts="one"', "steps=12"
    )  # fmt: skip
    assert code == 2  # without --resume: the run folder's checkpoints are refused anyway
    code, _, err = run_cli(
        capsys, "train", "pipelines/tiny.toml", "--cache", world["cache"], "--out",
        world["run"], "--resume", "--steps", "12",
        *[f for s in TRAIN for f in ("--set", f"train.{s}")],
        "--set", 'train.student.experts="one"',
    )  # fmt: skip
    assert code == 2
    line = _one_error(err)
    assert "train.student.experts = 'per-expert'" in line and "'one'" in line
    assert _snapshot(world["run"]) == before


# --------------------------------------------------------------------------- per-expert LoRA

LORA = ["student.num_layers=2", "student.lora.rank=4", "student.lora.alpha=8", "optim.lr=1e-2"]


@pytest.fixture(scope="module")
def lora_run(world: dict[str, Path]) -> Path:
    """A per-expert LoRA run on the world's cache: each expert's adapter on its teacher expert."""
    from wandistill.config import load_recipe
    from wandistill.train import run as train

    out = world["root"] / "lora_run"
    sets = [
        *TRAIN,
        *LORA,
        "optim.ema_decay=0.5",
        f'student.init_from_teacher.path="{world["teacher"]}"',
        "student.ffn_dim=32",
        f'cache="{world["cache"]}"',
        f'out="{out}"',
    ]
    train(load_recipe(Path("pipelines/tiny.toml"), sets, stage="train").train)
    return out


def _stock(pipe, rec) -> torch.Tensor:
    return pipe(
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


def test_per_expert_lora_files_in_the_stock_teacher_pipeline_equal_the_projects_sampler(
    tmp_path: Path, world: dict[str, Path], lora_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import diffusers
    from diffusers import WanPipeline

    from wandistill.cache import open_cache
    from wandistill.cache.contract import pad_embeds
    from wandistill.student.folders import read_run
    from wandistill.student.sampler import sample_latents, student_pipeline

    for name in ("student", "student_ema"):  # one LoRA file per expert, and the boundary
        files = sorted(str(p.relative_to(lora_run / name)) for p in (lora_run / name).rglob("*"))
        assert files == [
            "experts.json",
            "transformer",
            "transformer/pytorch_lora_weights.safetensors",
            "transformer_2",
            "transformer_2/pytorch_lora_weights.safetensors",
        ]
    out = tmp_path / "lora"
    args = ["export", "--run", lora_run, "--teacher", world["teacher"], "--out", out]
    code, said, err = run_cli(capsys, *args)
    assert code == 0, err
    assert "load_into_transformer_2=True" in said
    marker = json.loads((out / "wandistill_export.json").read_text())
    assert marker["format"] == "wandistill-lora" and marker["boundary_ratio"] == 0.875
    assert not (out / "model_index.json").exists()
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    args = ["sample", "--export", out, "--prompts", prompts, "--out", tmp_path / "png"]
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and "is a LoRA export" in _one_error(err)  # no pipeline: --run or merge
    assert not (tmp_path / "png").exists()

    pipe = WanPipeline.from_pretrained(world["teacher"])  # both experts, its boundary_ratio
    pipe.set_progress_bar_config(disable=True)
    scheduler_class = getattr(diffusers, marker["scheduler_class"])
    pipe.scheduler = scheduler_class.from_pretrained(out, subfolder="scheduler")
    with open_cache(world["cache"]) as store:
        records = list(store.records())[:2]
    plain = [_stock(pipe, rec) for rec in records]  # the teacher's experts at K steps
    pipe.load_lora_weights(out / "transformer")
    high_only = [_stock(pipe, rec) for rec in records]
    pipe.load_lora_weights(out / "transformer_2", load_into_transformer_2=True)
    student = read_run(lora_run)
    ours = student_pipeline(student.load(), student.schedule)
    for rec, base, one in zip(records, plain, high_only, strict=True):
        theirs = _stock(pipe, rec)
        embeds = pad_embeds(rec.prompt_embeds, MSL)[None]
        mine = sample_latents(ours, rec.noise[None], embeds, K)
        torch.testing.assert_close(theirs, mine, rtol=0, atol=1e-5)
        assert (one - base).abs().max() > 1e-3  # the high-noise adapter changed step 0
        assert (theirs - one).abs().max() > 1e-3  # and the low-noise one step 1

    merged = tmp_path / "merged"
    args = ["export", "--run", lora_run, "--teacher", world["teacher"], "--out", merged]
    code, _, err = run_cli(capsys, *args, "--merge-lora")
    assert code == 0, err
    index = json.loads((merged / "model_index.json").read_text())
    assert index["boundary_ratio"] == 0.875
    assert index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    pipe = WanPipeline.from_pretrained(merged)
    pipe.set_progress_bar_config(disable=True)
    for name in ("transformer", "transformer_2"):
        assert not any("lora" in n for n, _ in getattr(pipe, name).named_parameters())
    for rec in records:
        embeds = pad_embeds(rec.prompt_embeds, MSL)[None]
        mine = sample_latents(ours, rec.noise[None], embeds, K)
        torch.testing.assert_close(_stock(pipe, rec), mine, rtol=1e-4, atol=1e-4)


def test_a_per_expert_lora_run_samples_and_evals_from_its_run_folder(
    tmp_path: Path, world: dict[str, Path], lora_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat on a mat\n")
    code, _, err = run_cli(
        capsys, "sample", "--run", lora_run, "--teacher", world["teacher"], "--prompts", prompts,
        "--out", tmp_path / "png",
    )  # fmt: skip
    assert code == 0, err
    assert (tmp_path / "png" / "0000.png").is_file()
    code, _, err = run_cli(
        capsys, "eval", "--run", lora_run, "--cache", world["cache"], "--split", "all",
        "--out", tmp_path / "eval",
    )  # fmt: skip
    assert code == 0, err
    assert (tmp_path / "eval" / "eval.json").is_file()


def test_per_expert_lora_bad_inputs_are_one_line_writing_nothing(
    tmp_path: Path, world: dict[str, Path], lora_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    before = _snapshot(lora_run)
    base = [*TRAIN, *LORA, f'student.init_from_teacher.path="{world["teacher"]}"']
    for change, said in (
        ("student.lora.rank=8", "the recipe asks for LoRA rank 8"),
        ("student.lora.rank=0", "the recipe asks for a full student"),
    ):
        code, _, err = run_cli(
            capsys, "train", "pipelines/tiny.toml", "--cache", world["cache"], "--out", lora_run,
            "--resume", "--steps", "12", "--set", "train.student.ffn_dim=32",
            *[f for s in [*base, change] for f in ("--set", f"train.{s}")],
        )  # fmt: skip
        assert code == 2 and said in _one_error(err)
    assert _snapshot(lora_run) == before

    other = tmp_path / "teacher"  # the same weights, another boundary_ratio
    shutil.copytree(world["teacher"], other)
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": 0.5}))
    out = tmp_path / "x"
    code, _, err = run_cli(
        capsys, "export", "--run", lora_run, "--teacher", other, "--out", out
    )  # fmt: skip
    assert code == 2
    line = _one_error(err)
    assert "boundary_ratio 0.5" in line and "split at 0.875" in line
    assert not out.exists()
