"""`train.parallel = "fsdp"` in one process (a 1-rank group): the wrapping, its options, and a
sharded checkpoint resumed exactly. Multi-rank runs: tests/integration/test_train_fsdp.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from wandistill.config import StudentConfig, TrainConfig, load_recipe
from wandistill.errors import ConfigError, WandistillError
from wandistill.runtime.dist import DistInfo
from wandistill.student import DistillModule, build_student, resolve_student_config
from wandistill.train import parallel, run
from wandistill.train.checkpoint import resolve_latest
from wandistill.train.metrics import read_metrics

from cachefixtures import DIMS_BLOCK, TEACHER, write_cache

# DistillModule returns views of the student's output; nothing modifies them in place.
pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")


ONE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)


def _model() -> DistillModule:
    student_config = resolve_student_config(
        StudentConfig(num_layers=2, num_attention_heads=2, attention_head_dim=8, ffn_dim=16),
        json.loads(json.dumps(TEACHER["transformer_config"])),
        DIMS_BLOCK,
    )
    student = build_student(student_config, seed=0)
    return DistillModule(student, {"blocks.1": "blocks.0"}, student_width=16, teacher_width=24)


def test_fsdp_shards_each_block_then_the_root_and_computes_blocks_in_bf16() -> None:
    model = _model()
    cfg = TrainConfig(parallel="fsdp")
    cfg.fsdp.param_dtype = "bf16"
    assert parallel.shard(model, cfg, ONE) == 1
    blocks = parallel.blocks(model.student)
    assert len(blocks) == 2 and all(isinstance(b, FSDPModule) for b in blocks)
    assert isinstance(model, FSDPModule) and not isinstance(model.student.proj_out, FSDPModule)
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in model.parameters())
    seen: dict[str, torch.dtype] = {}

    def tap(name: str):  # noqa: ANN202
        def hook(_module: torch.nn.Module, args: tuple) -> None:
            seen.setdefault(name, args[0].dtype)

        return hook

    model.student.blocks[0].attn1.to_q.register_forward_pre_hook(tap("block"))
    model.student.condition_embedder.register_forward_pre_hook(tap("timestep"))
    model.student.proj_out.register_forward_pre_hook(tap("head"))
    pred, feats = model(
        torch.randn(2, 16, 1, 4, 4), torch.tensor([999.0, 3.0]), torch.randn(2, 24, 32)
    )
    # The blocks run in bf16; the timestep conditioning and the head stay fp32; outputs fp32.
    assert seen == {"timestep": torch.float32, "block": torch.bfloat16, "head": torch.float32}
    assert pred.dtype == feats["blocks.1"].dtype == torch.float32
    (pred.square().mean() + feats["blocks.1"].square().mean()).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(isinstance(g, DTensor) and g.dtype == torch.float32 for g in grads)
    norm = parallel.full(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    assert not isinstance(norm, DTensor) and float(norm) > 0


def test_train_parallel_and_fsdp_options_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"train.parallel='zero' must be 'ddp' or 'fsdp'"):
        load_recipe(None, ['parallel="zero"'], stage="train")
    with pytest.raises(ConfigError, match=r"train.fsdp.param_dtype='fp16' must be"):
        load_recipe(None, ['fsdp.param_dtype="fp16"'], stage="train")
    with pytest.raises(ConfigError, match=r"did you mean train.fsdp.cpu_offload"):
        load_recipe(None, ["fsdp.cpu_ofload=true"], stage="train")


def _cfg(cache: Path, out: Path, *sets: str) -> TrainConfig:
    base = [
        f'cache="{cache}"',
        f'out="{out}"',
        "steps=8",
        "batch_size=2",
        "checkpoint_every=4",
        "log_every=1",
        "data_threads=1",
        'device="cpu"',
        "tensorboard=false",
        "optim.lr=1e-3",
        "optim.warmup_steps=2",
        'parallel="fsdp"',
        "student.num_layers=2",
        "student.num_attention_heads=2",
        "student.attention_head_dim=12",
        "student.ffn_dim=32",
    ]
    return load_recipe(None, [*base, *sets], stage="train").train


def test_one_process_fsdp_with_every_option_resumes_a_sharded_checkpoint_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 parameters, CPU offload, activation checkpointing, accumulation and feature taps:
    a crash after step 6, --resume from checkpoint 4, the very same weights and losses."""
    write_cache(tmp_path / "c", range(4))
    sets = (
        'fsdp.param_dtype="bf16"',
        "fsdp.cpu_offload=true",
        "gradient_checkpointing=true",
        "grad_accum=2",
        "loss.final_latent=0.5",
    )
    run(_cfg(tmp_path / "c", tmp_path / "whole", *sets))
    monkeypatch.setenv("WANDISTILL_FAULT", "train:step:6:0:raise")
    with pytest.raises(WandistillError, match="injected failure on rank 0 at train step 6"):
        run(_cfg(tmp_path / "c", tmp_path / "cut", *sets))
    monkeypatch.delenv("WANDISTILL_FAULT")
    latest = resolve_latest(tmp_path / "cut" / "checkpoints")
    assert latest is not None and latest.name == "checkpoint-4"
    assert sorted(p.name for p in latest.iterdir()) == [
        "optimizer.json",
        "rng.safetensors",
        "shards",
        "state.json",
    ]
    state = json.loads((latest / "state.json").read_text())
    assert state["meta"]["parallel"] == "fsdp" and state["meta"]["shards"] == 1
    assert "shards/shard-00001-model-00001-of-00001.safetensors" in state["files"]
    run(_cfg(tmp_path / "c", tmp_path / "cut", *sets), resume=True)
    for name in ("student", "student_ema"):
        a = (tmp_path / "whole" / name / "diffusion_pytorch_model.safetensors").read_bytes()
        b = (tmp_path / "cut" / name / "diffusion_pytorch_model.safetensors").read_bytes()
        assert a == b, name
    losses = [
        [(r["step"], r["loss"]) for r in read_metrics(tmp_path / o) if "loss" in r]
        for o in ("whole", "cut")
    ]
    assert losses[0] == losses[1] and len(losses[0]) == 8


def test_a_shard_is_written_in_files_of_at_most_the_limit_and_resumes_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host RAM while a checkpoint is written is bounded by the file size (safetensors builds a
    file in memory): a rank's shard goes into files of at most SHARD_FILE_BYTES, a tensor larger
    than that alone, and a run resumed from them continues as if never stopped."""
    from safetensors import safe_open

    from wandistill.train import dcp

    limit = 4096
    monkeypatch.setattr(dcp, "SHARD_FILE_BYTES", limit)
    write_cache(tmp_path / "c", range(4))
    run(_cfg(tmp_path / "c", tmp_path / "whole"))
    monkeypatch.setenv("WANDISTILL_FAULT", "train:step:6:0:raise")
    with pytest.raises(WandistillError, match="injected failure on rank 0 at train step 6"):
        run(_cfg(tmp_path / "c", tmp_path / "cut"))
    monkeypatch.delenv("WANDISTILL_FAULT")
    shards = sorted((tmp_path / "cut/checkpoints/checkpoint-4/shards").iterdir())
    assert len(shards) > 3
    n = len(shards)
    assert shards[-1].name == f"shard-00001-model-{n:05d}-of-{n:05d}.safetensors"
    for f in shards:
        with safe_open(f, "pt") as fh:
            nbytes = [fh.get_tensor(k).nbytes for k in fh.keys()]  # noqa: SIM118
        assert sum(nbytes) <= limit or len(nbytes) == 1, (f.name, nbytes)
    state = json.loads((tmp_path / "cut/checkpoints/checkpoint-4/state.json").read_text())
    assert sorted(n for n in state["files"] if n.startswith("shards/")) == [
        f"shards/{f.name}" for f in shards
    ]
    run(_cfg(tmp_path / "c", tmp_path / "cut"), resume=True)
    for name in ("student", "student_ema"):
        a = (tmp_path / "whole" / name / "diffusion_pytorch_model.safetensors").read_bytes()
        b = (tmp_path / "cut" / name / "diffusion_pytorch_model.safetensors").read_bytes()
        assert a == b, name


def test_a_changed_or_stray_shard_is_refused_naming_the_file(tmp_path: Path) -> None:
    write_cache(tmp_path / "c", range(4))
    run(_cfg(tmp_path / "c", tmp_path / "run", "steps=4"))
    shards = tmp_path / "run/checkpoints/checkpoint-4/shards"
    shard = shards / "shard-00001-model-00001-of-00001.safetensors"
    good = shard.read_bytes()
    stray = shards / "shard-00002-model-00001-of-00001.safetensors"
    stray.write_bytes(good)  # a file no rank of this checkpoint wrote would be read as a shard
    with pytest.raises(WandistillError, match=r"holds 2 files, state.json lists 1.*shard-00002"):
        run(_cfg(tmp_path / "c", tmp_path / "run", "steps=6"), resume=True)
    stray.unlink()
    shard.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    with pytest.raises(WandistillError, match=r"shard-00001.*fails its crc32c check"):
        run(_cfg(tmp_path / "c", tmp_path / "run", "steps=6"), resume=True)


def test_fsdp_shards_every_block_of_both_experts_and_runs_an_idle_sharded_expert() -> None:
    """A per-expert pair has no `_no_split_modules` of its own: its experts' blocks are each
    sharded. Without gradients an idle sharded expert still runs (its all-gather is a
    collective every rank must join); its output is not used."""
    from wandistill.student.experts import ExpertPair

    pair = ExpertPair(_model().student, _model().student, 0.875, 1000)
    with torch.no_grad():  # experts that predict differently
        pair.transformer_2.proj_out.weight.normal_(generator=torch.Generator().manual_seed(3))
    model = DistillModule(pair, {}, student_width=16, teacher_width=24)
    before = pair(**_pair_inputs())[0].detach()
    parallel.shard(model, TrainConfig(parallel="fsdp"), ONE)
    found = parallel.blocks(pair)
    assert [b for b in found if b in set(pair.transformer.blocks)] == list(pair.transformer.blocks)
    assert [b for b in found if b in set(pair.transformer_2.blocks)] == list(
        pair.transformer_2.blocks
    )
    assert len(found) == 4 and all(isinstance(b, FSDPModule) for b in found)
    calls: list[str] = []
    for name in ("transformer", "transformer_2"):
        getattr(pair, name).register_forward_hook(lambda *_, n=name: calls.append(n))
    with torch.no_grad():  # through the FSDP root, as training calls it
        out = model(*_pair_inputs().values())[0]
    assert calls == ["transformer", "transformer_2"]  # t = 999 only: transformer_2 idle, run
    torch.testing.assert_close(out, before, rtol=1e-5, atol=1e-6)


def _pair_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(2, 16, 1, 4, 4, generator=g),
        "timestep": torch.tensor([999.0, 950.0]),
        "encoder_hidden_states": torch.randn(2, 5, 32, generator=g),
    }
