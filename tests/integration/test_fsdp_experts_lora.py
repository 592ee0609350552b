"""FSDP2 with per-expert students, with and without LoRA, on the tiny Wan 2.2 teacher.

A per-expert LoRA student (one adapter per expert) trained by 2 gloo ranks under
`train.parallel = "fsdp"`, killed by -9 right after its step-2 checkpoint and resumed on 2 ranks,
and (a copy) resumed on 1 process, gives the adapters of one uninterrupted process without FSDP
on the same samples; its sharded checkpoints hold only adapter tensors, and
its export in the stock teacher pipeline (`load_lora_weights`, the second expert with
`load_into_transformer_2=True`) equals the project's sampler. A full per-expert student trained by
2 FSDP ranks exports the folders the unsharded export writes, and they load. Runs are forked from
the kill/resume tests' zygote, with unpickling made to raise. Each test prints the largest weight
difference it measured.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from test_kill_resume import Zygote, logs
from test_train_fsdp import zygote  # noqa: F401  (the no-pickle zygote fixture)

from wandistill.train.metrics import read_metrics

from clirun import run_cli

pytestmark = [pytest.mark.dist, pytest.mark.slow]

K = 2
MSL = 32
STEPS = 4
EVERY = 2
PROMPTS = ["a cat on a mat", "a dog in the park", "a red car", "the sea at night"]
LORA_FILE = "pytorch_lora_weights.safetensors"
WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def world(tiny_teacher_wan22: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Wan 2.2 teacher and a cache of it (4 steps, all recorded, 4 records)."""
    from wandistill.config import load_recipe
    from wandistill.precompute.run import run as precompute

    root = tmp_path_factory.mktemp("fsdp_experts")
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
    precompute(load_recipe(Path("pipelines/tiny.toml"), sets, stage="precompute").precompute)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return {"root": root, "teacher": teacher, "cache": root / "cache"}


def argv(w: dict[str, Path], out: Path, ranks: int, *extra: str, lora: bool = True) -> list[str]:
    """The same run on 1 or 2 ranks: 4 samples per step either way (batch 1 x accumulation
    4 // ranks), 4 records, so 4 steps cross epoch boundaries; micro-batches of one sample leave
    an expert idle on a rank."""
    sets = [
        "batch_size=1",
        f"grad_accum={4 // ranks}",
        f"checkpoint_every={EVERY}",
        "keep_checkpoints=2",
        "log_every=1",
        "data_threads=1",
        'device="cpu"',
        "tensorboard=false",
        "optim.warmup_steps=0",
        "optim.ema_decay=0.5",
        f"student.num_inference_steps={K}",
        'student.experts="per-expert"',
        "loss.output=0.0",
        "loss.final_latent=0.0",
        "loss.perflow=1.0",
        f'student.init_from_teacher.path="{w["teacher"]}"',
        "student.ffn_dim=32",
        "student.num_layers=2",
    ]
    if lora:
        sets += ["student.lora.rank=4", "student.lora.alpha=8", "optim.lr=1e-2"]
    else:
        sets += ["optim.lr=1e-3"]
    return [
        "train",
        "pipelines/tiny.toml",
        *("--cache", str(w["cache"]), "--out", str(out), "--steps", str(STEPS)),
        *(x for s in sets for x in ("--set", s)),
        *extra,
    ]


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _tensors(out: Path, name: str) -> dict[str, torch.Tensor]:
    """Every tensor of <out>/<name>/ (both experts' files), keyed by expert and tensor name."""
    found = {}
    for path in sorted((out / name).rglob("*.safetensors")):
        for key, t in load_file(path).items():
            found[f"{path.parent.name}/{key}"] = t
    return found


def assert_same_weights(a: Path, b: Path, what: str, *, atol: float) -> float:
    """The same folders, tensor for tensor within `atol` (float reduction order aside)."""
    worst = 0.0
    for name in ("student", "student_ema"):
        assert _files(a / name) == _files(b / name), what
        ta, tb = _tensors(a, name), _tensors(b, name)
        assert ta.keys() == tb.keys() and ta, what
        for key in ta:
            torch.testing.assert_close(ta[key], tb[key], rtol=1e-4, atol=atol, msg=f"{what} {key}")
            worst = max(worst, float((ta[key] - tb[key]).abs().max()))
    for name in ("student", "student_ema"):  # the same LoRA configs, as diffusers reads them
        for path in sorted((a / name).rglob(f"*{LORA_FILE}")):
            other = b / path.relative_to(a)
            with safe_open(path, "pt") as fa, safe_open(other, "pt") as fb:
                assert fa.metadata() == fb.metadata(), what
    rows = [{r["step"]: r["loss"] for r in read_metrics(o) if "loss" in r} for o in (a, b)]
    assert sorted(rows[0]) == sorted(rows[1]) == list(range(1, STEPS + 1)), what
    for step, loss in rows[0].items():
        assert loss == pytest.approx(rows[1][step], rel=1e-4), f"{what} step {step}"
    print(f"{what}: max |weight difference| {worst:.3g}")
    return worst


@pytest.fixture(scope="module")
def lora_runs(zygote: Zygote, world: dict[str, Path]) -> dict[str, Path]:  # noqa: F811
    """One process without FSDP (the baseline); 2 FSDP ranks killed after checkpoint 2 and
    resumed on 2 ranks; a copy of the killed run resumed on 1 process (FSDP, 1 shard)."""
    root = world["root"]
    one, two, down = root / "lora_one", root / "lora_fsdp2", root / "lora_down"
    assert zygote.run(argv(world, one, 1), root / "one.log") == [0], logs(root / "one.log")
    kill = {"WANDISTILL_FAULT": f"train:saved:{EVERY}:*"}
    fsdp = ("--parallel", "fsdp")
    codes = zygote.run(argv(world, two, 2, *fsdp), root / "k.log", nproc=2, **kill)
    assert codes == [-signal.SIGKILL] * 2, logs(root / "k.log", 2)
    assert "in 2 shards, 1/2 per rank" in logs(root / "k.log", 2)
    shutil.copytree(two, down)
    codes = zygote.run(argv(world, two, 2, *fsdp, "--resume"), root / "r2.log", nproc=2)
    assert codes == [0, 0], logs(root / "r2.log", 2)
    codes = zygote.run(argv(world, down, 1, *fsdp, "--resume"), root / "r1.log")
    assert codes == [0], logs(root / "r1.log")
    for log, n in (("r2.log", 2), ("r1.log", 1)):
        assert "resumed from" in logs(root / log, n)
    return {"one": one, "fsdp2": two, "down": down}


def test_fsdp_per_expert_lora_on_2_ranks_and_resumed_on_1_trains_what_one_process_trains(
    lora_runs: dict[str, Path],
) -> None:
    for name in ("student", "student_ema"):
        assert _files(lora_runs["one"] / name) == [
            "experts.json",
            "transformer",
            f"transformer/{LORA_FILE}",
            "transformer_2",
            f"transformer_2/{LORA_FILE}",
        ]
        for run in lora_runs.values():
            marker = json.loads((run / name / "experts.json").read_text())
            assert marker["boundary_ratio"] == 0.875
    assert_same_weights(
        lora_runs["fsdp2"], lora_runs["one"], "per-expert LoRA, FSDP 2 ranks (kill -9, resume "
        "on 2) vs 1 process", atol=1e-5,
    )  # fmt: skip
    assert_same_weights(
        lora_runs["down"], lora_runs["one"], "per-expert LoRA, FSDP 2 ranks -> resume on 1 "
        "process vs 1 process", atol=1e-5,
    )  # fmt: skip
    moved = _tensors(lora_runs["one"], "student")  # B starts at 0: training moved every B
    assert all(t.abs().max() > 0 for k, t in moved.items() if "lora_B" in k)


def test_fsdp_checkpoints_of_a_lora_student_hold_only_its_adapters(
    lora_runs: dict[str, Path],
) -> None:
    from wandistill.train.checkpoint import resolve_latest

    latest = resolve_latest(lora_runs["fsdp2"] / "checkpoints")
    assert latest is not None
    keys: set[str] = set()
    for shard in sorted((latest / "shards").iterdir()):
        with safe_open(shard, "pt") as f:
            keys |= set(f.keys())
    own = {k for k in keys if not k.startswith("optimizer.")}
    parts = {k.split(".")[0] for k in own}
    assert parts == {"student", "ema"}, parts
    assert all(".lora_" in k for k in own), sorted(k for k in own if ".lora_" not in k)[:3]
    n_student = sum(1 for k in own if k.startswith("student."))
    for expert in ("transformer.", "transformer_2."):
        assert any(k.startswith(f"student.{expert}") for k in own)
    indices = {int(k.split(".")[2]) for k in keys if k.startswith("optimizer.state.")}
    assert indices == set(range(n_student))  # AdamW moments of the adapters only


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


def test_export_of_an_fsdp_per_expert_lora_run_in_the_stock_pipeline_equals_the_sampler(
    tmp_path: Path,
    world: dict[str, Path],
    lora_runs: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    import diffusers
    from diffusers import WanPipeline

    from wandistill.cache import open_cache
    from wandistill.cache.contract import pad_embeds
    from wandistill.student.folders import read_run
    from wandistill.student.sampler import sample_latents, student_pipeline

    run = lora_runs["fsdp2"]
    out = tmp_path / "lora"
    args = ["export", "--run", run, "--teacher", world["teacher"], "--out", out]
    code, said, err = run_cli(capsys, *args)
    assert code == 0, err
    assert "load_into_transformer_2=True" in said
    marker = json.loads((out / "wandistill_export.json").read_text())
    assert marker["format"] == "wandistill-lora" and marker["boundary_ratio"] == 0.875
    pipe = WanPipeline.from_pretrained(world["teacher"])
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = getattr(diffusers, marker["scheduler_class"]).from_pretrained(
        out, subfolder="scheduler"
    )
    pipe.load_lora_weights(out / "transformer")
    pipe.load_lora_weights(out / "transformer_2", load_into_transformer_2=True)
    student = read_run(run)
    ours = student_pipeline(student.load(), student.schedule)
    with open_cache(world["cache"]) as store:
        records = list(store.records())[:2]
    worst = 0.0
    for rec in records:
        theirs = _stock(pipe, rec)
        mine = sample_latents(ours, rec.noise[None], pad_embeds(rec.prompt_embeds, MSL)[None], K)
        torch.testing.assert_close(theirs, mine, rtol=0, atol=1e-5)
        worst = max(worst, float((theirs - mine).abs().max()))
    print(f"stock WanPipeline + load_lora_weights vs the project's sampler: max {worst:.3g}")


def test_fsdp_full_per_expert_students_export_the_unsharded_folders_and_they_load(
    zygote: Zygote,  # noqa: F811
    world: dict[str, Path],
    tmp_path: Path,
) -> None:
    """2 FSDP ranks and one process without FSDP: the same folders (config.json byte for
    byte), the same weights within float tolerance, each expert loading as a diffusers model."""
    from diffusers import WanTransformer3DModel

    from wandistill.student.folders import read_run

    outs = {"fsdp2": tmp_path / "fsdp2", "one": tmp_path / "one"}
    for key, ranks, extra in (("fsdp2", 2, ("--parallel", "fsdp")), ("one", 1, ())):
        args = argv(world, outs[key], ranks, *extra, "--steps", "2", lora=False)
        codes = zygote.run(args, tmp_path / f"{key}.log", nproc=ranks)
        assert codes == [0] * ranks, logs(tmp_path / f"{key}.log", ranks)
    out = outs["fsdp2"]
    worst = 0.0
    for name in ("student", "student_ema"):
        assert (
            _files(out / name)
            == _files(outs["one"] / name)
            == [
                "experts.json",
                "transformer",
                "transformer/config.json",
                f"transformer/{WEIGHTS}",
                "transformer_2",
                "transformer_2/config.json",
                f"transformer_2/{WEIGHTS}",
            ]
        )
        for f in ("experts.json", "transformer/config.json", "transformer_2/config.json"):
            assert (out / name / f).read_bytes() == (outs["one"] / name / f).read_bytes()
        moved = {}
        for expert in ("transformer", "transformer_2"):
            mine = WanTransformer3DModel.from_pretrained(out / name / expert).state_dict()
            ref = load_file(outs["one"] / name / expert / WEIGHTS)
            base = load_file(world["teacher"] / expert / WEIGHTS)
            assert mine.keys() == ref.keys() == base.keys()  # both blocks, every tensor whole
            for k in mine:
                torch.testing.assert_close(mine[k], ref[k], rtol=1e-4, atol=1e-5, msg=k)
                worst = max(worst, float((mine[k] - ref[k]).abs().max()))
            moved[expert] = max(float((mine[k] - base[k]).abs().max()) for k in mine)
        assert all(d > 0 for d in moved.values()), moved  # both experts trained
    print(f"full per-expert, FSDP 2 ranks vs 1 process: max |weight difference| {worst:.3g}")
    assert type(read_run(out).load()).__name__ == "ExpertPair"


def test_fsdp_lora_of_one_student_exports_the_unsharded_lora_file(
    zygote: Zygote,  # noqa: F811
    world: dict[str, Path],
    tmp_path: Path,
) -> None:
    """`student.experts = "one"` with LoRA: 2 FSDP ranks write the one LoRA file (adapter
    gathered alone) that one process without FSDP writes, equal within float tolerance."""
    outs = {"fsdp2": tmp_path / "fsdp2", "one": tmp_path / "one"}
    for key, ranks, extra in (("fsdp2", 2, ("--parallel", "fsdp")), ("one", 1, ())):
        args = argv(world, outs[key], ranks, *extra, "--set", 'student.experts="one"')
        codes = zygote.run(args, tmp_path / f"{key}.log", nproc=ranks)
        assert codes == [0] * ranks, logs(tmp_path / f"{key}.log", ranks)
    for name in ("student", "student_ema"):
        assert _files(outs["fsdp2"] / name) == [LORA_FILE]
    assert_same_weights(
        outs["fsdp2"], outs["one"], "LoRA (one student), FSDP 2 ranks vs 1 process", atol=1e-5
    )
