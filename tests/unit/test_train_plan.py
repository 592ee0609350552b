"""The train memory plan: exact parameter counts, per-rank figures of each way to train, which
fit, the command line (`plan --train`, `train --dry-run`) and the out-of-memory advice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from wandistill.cache.files import DimsBlock
from wandistill.config import TrainConfig, load_recipe
from wandistill.placement.devices import GiB
from wandistill.placement.inventory import Inventory
from wandistill.placement.train_plan import Choice, make_train_plan
from wandistill.placement.train_size import DEFAULT_LORA_TARGETS, StudentSize, TrainShape
from wandistill.runtime import dist
from wandistill.train import oom as train_oom

from clirun import run_cli

CONFIGS = Path(__file__).parents[2] / "wandistill" / "teacher" / "configs"
#: Wan's published 480p clip: 81 frames of 832x480 (32,760 tokens).
CLIP = TrainShape.from_video(num_frames=81, height=480, width=832)
TINY = {
    "num_layers": 2,
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "ffn_dim": 32,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 16,
    "freq_dim": 8,
}


def wan(name: str) -> dict:
    return json.loads((CONFIGS / name / "transformer" / "config.json").read_text())


def plan(config: dict, choice: Choice, gpus: int, gib: float = 80.0, **kw):
    return make_train_plan(config, choice, CLIP, Inventory.fake(gpus, gib, cpu_gib=1024), **kw)


# --------------------------------------------------------------------------- sizes


def test_parameter_counts_equal_the_built_student() -> None:
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(**TINY)
    size = StudentSize.from_config(TINY)
    assert size.params == sum(p.numel() for p in model.parameters())
    assert size.block_params == sum(p.numel() for p in model.blocks[0].parameters())


def test_largest_param_is_the_built_students_largest_tensor() -> None:
    from diffusers import WanTransformer3DModel

    for config in (TINY, {**TINY, "ffn_dim": 8, "text_dim": 64}, {**TINY, "text_dim": 2}):
        model = WanTransformer3DModel(**config)
        largest = max(p.numel() for p in model.parameters())
        assert StudentSize.from_config(config).largest_param == largest, config


def test_lora_adapter_count_equals_what_peft_adds() -> None:
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig, inject_adapter_in_model

    model = WanTransformer3DModel(**TINY)
    before = sum(p.numel() for p in model.parameters())
    inject_adapter_in_model(LoraConfig(r=4, target_modules=list(DEFAULT_LORA_TARGETS)), model)
    added = sum(p.numel() for p in model.parameters()) - before
    assert StudentSize.from_config(TINY, lora_rank=4).adapter_params == added
    only_q = StudentSize.from_config(TINY, lora_rank=4, targets=("to_q",))
    assert only_q.adapter_params == 4 * (16 + 16) * 2 * 2  # attn1 + attn2, two blocks


def test_published_wan_sizes_are_exact() -> None:
    assert StudentSize.from_config(wan("wan2.1-14b")).params == 14_288_491_584
    assert StudentSize.from_config(wan("wan2.1-1.3b")).params == 1_418_996_800


# --------------------------------------------------------------------------- figures


def test_wan14b_full_student_ddp_does_not_fit_80gb_and_fsdp_fits_8x80() -> None:
    c14 = wan("wan2.1-14b")
    params = StudentSize.from_config(c14).params
    ddp = plan(c14, Choice(bf16=True, checkpointing=True), gpus=1).requested
    assert (ddp.weights, ddp.gradients, ddp.optimizer, ddp.ema) == (
        4 * params,
        4 * params,
        8 * params,
        4 * params,
    )
    assert not ddp.fits and ddp.total > 200 * GiB  # ~16 bytes per parameter before activations
    fsdp = Choice(parallel="fsdp", param_dtype="bf16", bf16=True, checkpointing=True)
    sharded = plan(c14, fsdp, gpus=8).requested
    assert sharded.fits, sharded.why()
    assert sharded.optimizer == 8 * params // 8 and sharded.gradients == 4 * params // 8
    assert sharded.total < 80 * GiB < ddp.total


def test_wan14b_without_checkpointing_does_not_fit_even_sharded() -> None:
    fsdp = Choice(parallel="fsdp", param_dtype="bf16", bf16=True, checkpointing=False)
    row = plan(wan("wan2.1-14b"), fsdp, gpus=8).requested
    assert not row.fits and row.activations > row.activations_other


def test_wan13b_ddp_needs_more_than_24gb_and_fsdp_fits_8x24() -> None:
    c13 = wan("wan2.1-1.3b")
    ddp = Choice(bf16=True, checkpointing=True)
    assert not plan(c13, ddp, gpus=1, gib=24).requested.fits
    assert plan(c13, ddp, gpus=1, gib=80).requested.fits
    fsdp = Choice(parallel="fsdp", bf16=True, checkpointing=True)
    assert plan(c13, fsdp, gpus=8, gib=24).requested.fits


def test_fsdp_state_per_rank_is_close_to_a_nth_of_ddp() -> None:
    c13 = wan("wan2.1-1.3b")
    one = plan(c13, Choice(), gpus=1).requested
    eight = plan(c13, Choice(parallel="fsdp"), gpus=8).requested
    for part in ("gradients", "optimizer", "ema"):
        assert getattr(eight, part) == pytest.approx(getattr(one, part) / 8, rel=1e-6)


def test_lora_optimizer_state_is_the_adapters_size() -> None:
    c14 = wan("wan2.1-14b")
    row = plan(c14, Choice(lora_rank=64, checkpointing=True), gpus=1).requested
    adapter = StudentSize.from_config(c14, lora_rank=64).adapter_params
    assert row.optimizer == 8 * adapter and row.ema == 4 * adapter and row.gradients == 4 * adapter
    assert row.weights == 4 * (StudentSize.from_config(c14).params + adapter)


def test_fsdp_checkpoint_ram_is_two_files_of_the_limit_not_the_whole_shard(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """train/dcp.py writes a rank's shard in files of at most SHARD_FILE_BYTES and safetensors
    holds a file twice while writing it: 14B over 8 ranks needs 2 GiB of host RAM for it, not
    twice its 28 GB shard."""
    from wandistill.placement import train_plan

    c14 = wan("wan2.1-14b")
    size = StudentSize.from_config(c14)
    fsdp = Choice(parallel="fsdp", param_dtype="bf16", bf16=True, checkpointing=True)
    row = plan(c14, fsdp, gpus=8).requested
    assert 16 * size.params // 8 > 25 * GiB
    assert row.checkpoint == 2 * train_plan.SHARD_FILE_BYTES == 2 * GiB
    small = plan(TINY, Choice(parallel="fsdp"), gpus=2).requested  # one file, under the limit
    assert small.checkpoint == 2 * (16 * StudentSize.from_config(TINY).params // 2)
    ddp = plan(c14, Choice(bf16=True), gpus=1).requested  # DDP: AdamW's one file, unchanged
    assert ddp.checkpoint == 2 * 8 * size.params
    monkeypatch.setattr(train_plan, "SHARD_FILE_BYTES", 1 << 20)  # a tensor over the limit
    assert plan(c14, fsdp, gpus=8).requested.checkpoint == 2 * (4 * size.largest_param // 8)


def test_the_first_lever_that_fits_is_offered_with_its_flags() -> None:
    p = plan(wan("wan2.1-14b"), Choice(bf16=True, checkpointing=True), gpus=8)
    lever = p.next_lever()
    assert lever is not None and lever.fits and lever.choice.parallel == "fsdp"
    assert lever.choice.flags(p.requested.choice).startswith('--set train.parallel="fsdp"')


def test_per_expert_students_hold_two_students_states() -> None:
    c = wan("wan2.1-1.3b")
    one = plan(c, Choice(), gpus=1).requested
    two = plan(c, Choice(experts=2), gpus=1).requested
    assert two.optimizer == 2 * one.optimizer and two.activations == one.activations


# --------------------------------------------------------------------------- command line


def test_plan_train_prints_the_figures_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    machine = ["--gpus", "8", "--gpu-mem", "80GiB", "--cpu-mem", "1TiB"]
    sets = ["--set", 'train.mixed_precision="bf16"', "--set", "train.gradient_checkpointing=true"]
    code, out, err = run_cli(
        capsys, "plan", "--config", "wan2.1-14b", "--train", *machine, *sets, "--json"
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["params"] == 14_288_491_584 and data["world_size"] == 8
    assert data["requested"]["choice"]["parallel"] == "ddp" and not data["requested"]["fits"]
    fitting = [r for r in data["alternatives"] if r["fits"]]
    assert fitting and fitting[0]["choice"]["parallel"] == "fsdp"


def test_train_dry_run_prints_the_memory_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "train", "tiny", "--dry-run", "--cache", "")
    assert code == 0, err
    assert "train memory plan" in out and "per rank" in out and "* ddp" in out


def test_plan_for_a_machine_recipe_on_a_box_without_gpus(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A README example: the recipe's GPUs are planned for, never an IndexError."""
    monkeypatch.setattr(Inventory, "detect", classmethod(lambda cls, *a: Inventory.cpu_only()))
    code, out, err = run_cli(
        capsys, "plan", "wan2.1-14b_1x24gb", "--config", "wan2.1-14b", "--json"
    )
    assert code == 0, err
    assert "planned for the machine recipe wan2.1-14b_1x24gb describes" in " ".join(err.split())
    gpus = json.loads(out)["inventory"]["gpus"]
    assert len(gpus) == 1 and gpus[0][1] == 24 * GiB
    code, out, err = run_cli(
        capsys, "plan", "wan2.1-14b_1x24gb", "--config", "wan2.1-14b", "--train", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["inventory"].startswith("described by recipe wan2.1-14b_1x24gb")


def test_a_gpu_placement_on_a_box_without_gpus_is_planned_not_crashed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Inventory, "detect", classmethod(lambda cls, *a: Inventory.cpu_only()))
    code, out, err = run_cli(
        capsys, "plan", "--config", "wan2.1-1.3b", "--placement", "model-offload", "--json"
    )
    assert code == 0, err
    row = next(s for s in json.loads(out)["strategies"] if s["strategy"] == "model-offload")
    assert not row["fits"] and "has 0.0 GiB" in row["note"]


# --------------------------------------------------------------------------- out of memory


def test_train_oom_names_the_next_lever_with_the_plans_figures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    machine = Inventory.fake(8, 80.0, cpu_gib=1024)  # the inventory `plan` prices on
    monkeypatch.setattr(train_oom, "_inventory", lambda info: machine)
    cfg = load_recipe(None, ['train.mixed_precision="bf16"'], stage="train").train
    info = dist.DistInfo(
        rank=0, world_size=8, local_rank=0, device=torch.device("cpu"), backend=None
    )
    dims = DimsBlock(latent_shape=[16, CLIP.latent_frames, CLIP.latent_height, CLIP.latent_width])
    e = torch.OutOfMemoryError("CUDA out of memory")
    err = train_oom.oom_error(
        cfg, info, 14_288_491_584, e, student_config=wan("wan2.1-14b"), dims=dims
    )
    expected = plan(wan("wan2.1-14b"), Choice(bf16=True), gpus=8)
    lever = expected.next_lever()
    assert lever is not None
    assert f"{expected.requested.total / GiB:.1f} GiB per rank" in err.fix
    assert f"next lever: {lever.choice.flags(expected.requested.choice)}" in err.fix
    assert f"{lever.total / GiB:.1f} GiB of" in err.fix


def test_train_oom_without_a_known_student_keeps_the_generic_levers() -> None:
    info = dist.DistInfo(
        rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None
    )
    err = train_oom.oom_error(TrainConfig(), info, 1000, MemoryError())
    assert "next lever" not in err.fix and "gradient_checkpointing=true" in err.fix


def test_the_train_loop_passes_its_student_and_cache_to_the_oom_advice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from wandistill.train.loop import explain_failure

    monkeypatch.setattr(train_oom, "_inventory", lambda info: Inventory.fake(1, 24.0))
    student = torch.nn.Linear(4, 4)
    dims = DimsBlock(latent_shape=[16, CLIP.latent_frames, CLIP.latent_height, CLIP.latent_width])
    t = SimpleNamespace(
        model=SimpleNamespace(student=student),
        plan=SimpleNamespace(
            student_config=wan("wan2.1-1.3b"), manifest=SimpleNamespace(dims=dims)
        ),
    )
    info = dist.DistInfo(
        rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None
    )
    err = explain_failure(torch.OutOfMemoryError("CUDA out of memory"), TrainConfig(), info, t)
    assert err is not None and "the memory plan puts this run at" in err.fix
    assert "next lever: " in err.fix
