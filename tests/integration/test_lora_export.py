"""A LoRA student end to end: precompute -> train (LoRA on the tiny teacher's transformer, K = 2)
-> export -> stock `WanPipeline.from_pretrained(TEACHER).load_lora_weights(EXPORT)` samples what
the project's own sampler samples; `--merge-lora` gives a pipeline that samples the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from clirun import run_cli as _cli
from zygote import Zygote

pytestmark = pytest.mark.slow

K = 2
PROMPTS = ["a cat on a mat", "a dog in the park", "a red car", "the sea at night"]
MSL = 32


@pytest.fixture(scope="module")
def worlds(
    tiny_teacher: Path, tiny_teacher_wan22: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Path]]:
    """The tiny Wan 2.1 and Wan 2.2 teachers, a cache of each (4 steps, all recorded), a LoRA
    run on each (on the Wan 2.2 teacher's high-noise expert, the student running every step)."""
    root = tmp_path_factory.mktemp("lora")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    teachers = {"wan21": tiny_teacher, "wan22": tiny_teacher_wan22}
    return {layout: _world(root / layout, prompts, teachers[layout]) for layout in teachers}


@pytest.fixture
def world(worlds: dict[str, dict[str, Path]]) -> dict[str, Path]:
    return worlds["wan21"]


def _world(root: Path, prompts: Path, teacher: Path) -> dict[str, Path]:
    from wandistill.config import load_recipe
    from wandistill.precompute.run import run as precompute
    from wandistill.train import run as train

    root.mkdir(parents=True)
    cache, out = root / "cache", root / "run"
    recipe = Path("pipelines/tiny.toml")
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
    ]
    precompute(load_recipe(recipe, sets, stage="precompute").precompute, quiet=True)
    sets = [
        f'cache="{cache}"',
        f'out="{out}"',
        "steps=8",
        "batch_size=4",
        "log_every=4",
        "checkpoint_every=8",
        "data_threads=1",
        'device="cpu"',
        "tensorboard=false",
        "optim.warmup_steps=0",
        "optim.lr=1e-2",
        "optim.ema_decay=0.5",
        f"student.num_inference_steps={K}",
        "student.num_layers=2",  # the teacher's sizes: a LoRA student is the teacher + adapters
        "student.ffn_dim=32",
        f'student.init_from_teacher.path="{teacher}"',
        "student.lora.rank=4",
        "student.lora.alpha=8",
        "loss.output=0.0",
        "loss.final_latent=0.0",
        "loss.perflow=1.0",
    ]
    train(load_recipe(recipe, sets, stage="train").train)
    return {"root": root, "teacher": teacher, "cache": cache, "run": out, "prompts": prompts}


def _export(capsys, world: dict[str, Path], out: Path, *flags: str) -> str:
    code, stdout, err = _cli(
        capsys,
        "export",
        "--run",
        str(world["run"]),
        "--teacher",
        str(world["teacher"]),
        "--out",
        str(out),
        *flags,
    )
    assert code == 0, err
    return stdout


def _records(world: dict[str, Path]) -> list:
    from wandistill.cache import open_cache

    with open_cache(world["cache"]) as store:
        return list(store.records())[:2]


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


def _ours(world: dict[str, Path], rec) -> torch.Tensor:
    """The project's sampler: the run's student (base + adapter) in `student_pipeline`."""
    from wandistill.cache.contract import pad_embeds
    from wandistill.student.folders import read_run
    from wandistill.student.sampler import sample_latents, student_pipeline

    finished = read_run(world["run"])
    pipe = student_pipeline(finished.load(), finished.schedule)
    return sample_latents(pipe, rec.noise[None], pad_embeds(rec.prompt_embeds, MSL)[None], K)


@pytest.mark.parametrize("layout", ["wan21", "wan22"])
def test_the_lora_file_in_stock_wan_pipeline_equals_the_projects_sampler(
    tmp_path: Path,
    worlds: dict[str, dict[str, Path]],
    layout: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import diffusers
    from diffusers import WanPipeline

    world = worlds[layout]
    out = tmp_path / "lora"
    said = _export(capsys, world, out)
    assert "load_lora_weights" in said and f"num_inference_steps={K}" in said
    marker = json.loads((out / "wandistill_export.json").read_text())
    assert marker["format"] == "wandistill-lora" and marker["lora"]["rank"] == 4
    assert {p.name for p in out.iterdir()} >= {"pytorch_lora_weights.safetensors", "scheduler"}
    assert not (out / "model_index.json").exists()

    # Wan 2.2: the student runs every step, so the second expert and the boundary go (the
    # export's usage lines say so).
    wan22 = {"transformer_2": None, "boundary_ratio": None} if layout == "wan22" else {}
    assert marker["wan22_teacher"] == (layout == "wan22")
    assert ("transformer_2=None, boundary_ratio=None" in marker["usage"]) == bool(wan22)
    pipe = WanPipeline.from_pretrained(world["teacher"], **wan22)
    pipe.set_progress_bar_config(disable=True)
    scheduler_class = getattr(diffusers, marker["scheduler_class"])
    pipe.scheduler = scheduler_class.from_pretrained(out, subfolder="scheduler")
    records = _records(world)
    plain = [_stock(pipe, rec) for rec in records]  # the teacher at K steps, no LoRA
    pipe.load_lora_weights(out)
    for rec, base in zip(records, plain, strict=True):
        theirs = _stock(pipe, rec)
        mine = _ours(world, rec)
        # Same weights, adapter and scheduler; the prompt went through the text encoder here
        # and came from the cache there (bit-identical on CPU, float32 rounding at most).
        torch.testing.assert_close(theirs, mine, rtol=0, atol=1e-5)
        assert (theirs - base).abs().max() > 1e-3  # the adapter changed what the teacher does


def test_merge_lora_exports_a_pipeline_that_samples_like_the_lora(
    tmp_path: Path, world: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from diffusers import WanPipeline

    out = tmp_path / "merged"
    _export(capsys, world, out, "--merge-lora")
    pipe = WanPipeline.from_pretrained(out)
    pipe.set_progress_bar_config(disable=True)
    names = [n for n, _ in pipe.transformer.named_parameters()]
    assert not any("lora" in n for n in names)  # a plain transformer, adapter merged in
    for rec in _records(world):
        # merged W + s*BA vs the unmerged x W + s*(x A) B: float32 reordering only
        torch.testing.assert_close(_stock(pipe, rec), _ours(world, rec), rtol=1e-4, atol=1e-4)


def test_a_lora_export_refuses_a_teacher_with_another_transformer_writing_nothing(
    tmp_path: Path, world: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    other = tmp_path / "other"
    shutil.copytree(world["teacher"], other)  # the same encoder and VAE, another transformer
    weights = other / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    tensors["proj_out.bias"] = tensors["proj_out.bias"] + 1.0
    save_file(tensors, weights, metadata={"format": "pt"})
    out = tmp_path / "x"
    code, _, err = _cli(
        capsys, "export", "--run", str(world["run"]), "--teacher", str(other), "--out", str(out)
    )
    assert code != 0 and "its transformer is not the one the LoRA" in err
    assert "Traceback" not in err and not out.exists()


@pytest.mark.dist
def test_two_ddp_ranks_train_the_same_adapter_as_one_rank_with_twice_the_accumulation(
    zygote: Zygote, tmp_path: Path, world: dict[str, Path]
) -> None:
    """Under DDP only the adapters are DDP's parameters (the frozen base has no gradient to
    reduce): 2 gloo ranks x batch 2 equal 1 rank x batch 2 x accumulation 2 (torchrun's agent
    and ranks forked from the session's zygote)."""
    import os

    from safetensors.torch import load_file

    from wandistill.config import load_recipe
    from wandistill.train import run

    sets = [
        "steps=3",
        "batch_size=2",
        "checkpoint_every=3",
        "data_threads=1",
        'device="cpu"',
        "tensorboard=false",
        "optim.lr=1e-2",
        "student.num_layers=2",
        "student.ffn_dim=32",
        f'student.init_from_teacher.path="{world["teacher"]}"',
        "student.lora.rank=2",
        "student.lora.dropout=0.0",
        f'cache="{world["cache"]}"',
    ]
    args = ["-m", "wandistill", "train", "pipelines/tiny.toml", "--out", str(tmp_path / "ddp")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WANDISTILL_FAULT", None)
    proc = zygote.torchrun([*args, *[a for s in sets for a in ("--set", s)]], env=env)
    err = proc.stderr
    assert proc.returncode == 0, err[-3000:]
    one = [*sets, f'out="{tmp_path / "one"}"', "grad_accum=2"]
    run(load_recipe(Path("pipelines/tiny.toml"), one, stage="train").train)
    for name in ("student", "student_ema"):
        a = load_file(tmp_path / "ddp" / name / "pytorch_lora_weights.safetensors")
        b = load_file(tmp_path / "one" / name / "pytorch_lora_weights.safetensors")
        assert a.keys() == b.keys() and any("lora_B" in k for k in a)
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)


def test_sample_runs_a_lora_run_and_refuses_a_lora_export_in_one_line(
    tmp_path: Path, world: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = world["prompts"]
    common = ["--prompts", str(prompts), "--limit", "1", "--seed", "7"]
    args = ["sample", "--run", str(world["run"]), "--teacher", str(world["teacher"])]
    code, _, err = _cli(capsys, *args, "--out", str(tmp_path / "png"), *common)
    assert code == 0, err
    assert (tmp_path / "png" / "0000.png").is_file()  # the base + adapter, through --run
    _export(capsys, world, tmp_path / "lora")
    args = ["sample", "--export", str(tmp_path / "lora"), "--out", str(tmp_path / "x")]
    code, _, err = _cli(capsys, *args, *common)
    assert code == 2 and "is a LoRA export" in err and "--merge-lora" in err
    assert "Traceback" not in err and not (tmp_path / "x").exists()
