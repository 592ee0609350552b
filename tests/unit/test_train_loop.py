"""`wandistill train` in one process: outputs, exact resume, objectives, failures, follow mode."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from wandistill.cache import CacheWriter
from wandistill.cache.contract import field_specs
from wandistill.cache.manifest import read_manifest
from wandistill.config import TrainConfig, load_recipe
from wandistill.errors import CacheError, UsageError, WandistillError
from wandistill.train import run
from wandistill.train.checkpoint import list_checkpoints, resolve_latest
from wandistill.train.metrics import read_metrics

from cachefixtures import DIMS, SETTINGS, TEACHER, make_record, write_cache

SIZES = (
    "student.num_layers=1",
    "student.num_attention_heads=2",
    "student.attention_head_dim=12",
    "student.ffn_dim=32",
)
PERF = {"time", "samples_per_s", "step_time_s", "data_wait_frac", "peak_rss_bytes"}


def _cfg(cache: Path, out: Path, *sets: str) -> TrainConfig:
    base = [
        f'cache="{cache}"',
        f'out="{out}"',
        "steps=8",
        "batch_size=2",
        "checkpoint_every=4",
        "log_every=2",
        "data_threads=2",
        'device="cpu"',
        "tensorboard=false",
        "optim.lr=1e-3",
        "optim.warmup_steps=2",
        *SIZES,
    ]
    return load_recipe(None, [*base, *sets], stage="train").train


def _losses(out: Path) -> list[dict]:
    return [
        {k: v for k, v in row.items() if k not in PERF}
        for row in read_metrics(out)
        if "loss" in row
    ]


def test_a_run_writes_checkpoints_metrics_and_a_student_diffusers_loads(tmp_path: Path) -> None:
    from diffusers import WanTransformer3DModel

    write_cache(tmp_path / "c", range(6))
    r = run(_cfg(tmp_path / "c", tmp_path / "run"))
    assert r.steps == 8 and r.is_main and not r.corrupt
    root = tmp_path / "run" / "checkpoints"
    assert [s for s, _ in list_checkpoints(root)] == [4, 8]  # keep_checkpoints = 2
    assert resolve_latest(root) == root / "checkpoint-8"
    rows = read_metrics(tmp_path / "run")
    assert rows[0]["event"] == "start" and rows[-1]["event"] == "end"
    logged = [row for row in rows if "loss" in row]
    assert [row["step"] for row in logged] == [2, 4, 6, 8]
    for key in ("loss_output", "lr", "grad_norm", "samples_per_s", "data_wait_frac"):
        assert all(key in row for row in logged), key
    assert all(0.0 <= row["data_wait_frac"] <= 1.0 for row in logged)
    student = WanTransformer3DModel.from_pretrained(r.student)
    ema = WanTransformer3DModel.from_pretrained(r.student_ema)
    saved = load_file(root / "checkpoint-8" / "student.safetensors")
    saved_ema = load_file(root / "checkpoint-8" / "ema.safetensors")
    assert student.config.num_layers == 1 and student.config.text_dim == DIMS["text_dim"]
    for name, value in student.state_dict().items():
        assert torch.equal(value, saved[name])
        assert torch.equal(ema.state_dict()[name], saved_ema[name])
    assert not torch.equal(student.proj_out.weight, ema.proj_out.weight)


def test_resume_after_a_crash_gives_the_same_weights_and_losses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_cache(tmp_path / "c", range(5))
    sets = ("steps=10", "log_every=1", "loss.final_latent=0.5")
    run(_cfg(tmp_path / "c", tmp_path / "whole", *sets))
    monkeypatch.setenv(
        "WANDISTILL_FAULT", "train:step:7:0:raise"
    )  # dies after step 7; last checkpoint: 4
    with pytest.raises(WandistillError, match="injected failure on rank 0 at train step 7"):
        run(_cfg(tmp_path / "c", tmp_path / "cut", *sets))
    monkeypatch.delenv("WANDISTILL_FAULT")
    assert resolve_latest(tmp_path / "cut" / "checkpoints").name == "checkpoint-4"
    run(_cfg(tmp_path / "c", tmp_path / "cut", *sets), resume=True)
    for name in ("student", "student_ema"):
        a = (tmp_path / "whole" / name / "diffusion_pytorch_model.safetensors").read_bytes()
        b = (tmp_path / "cut" / name / "diffusion_pytorch_model.safetensors").read_bytes()
        assert a == b, name
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "whole")


def test_an_out_dir_with_checkpoints_needs_resume(tmp_path: Path) -> None:
    write_cache(tmp_path / "c", range(4))
    run(_cfg(tmp_path / "c", tmp_path / "run", "steps=4"))
    with pytest.raises(UsageError, match="pass --resume"):
        run(_cfg(tmp_path / "c", tmp_path / "run", "steps=4"))
    r = run(_cfg(tmp_path / "c", tmp_path / "run", "steps=6"), resume=True)  # extend the run
    assert r.steps == 6 and r.start_step == 4
    text = " ".join(r.lines())
    assert "trained 6 steps: 2 steps this run, 6 total" in text, text
    assert all(len(line) <= 80 for line in r.lines() if str(tmp_path) not in line), r.lines()


def _feature_cache(path: Path, n: int) -> None:
    writer = CacheWriter(
        path,
        backend="webdataset",
        teacher=TEACHER,
        settings=SETTINGS,
        dims=DIMS,
        fields=field_specs(
            latent_dtype=torch.float32, embed_dtype=torch.bfloat16, features=["blocks.1"]
        ),
        shared={"sigmas": torch.linspace(1, 0, 5)},
        shard_records=4,
    )
    g = torch.Generator().manual_seed(5)
    for i in range(n):
        rec = make_record(i)
        rec.features = {"blocks.1": torch.randn(3, 4, 24, generator=g)}  # S x tokens x width
        writer.write(rec)
    writer.close(finalize=True, complete=True)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_every_objective_with_bf16_and_checkpointing_logs_each_term(tmp_path: Path) -> None:
    _feature_cache(tmp_path / "c", 4)
    cfg = _cfg(
        tmp_path / "c",
        tmp_path / "run",
        "steps=4",
        "grad_accum=2",
        'mixed_precision="bf16"',
        "gradient_checkpointing=true",
        "student.attention_head_dim=8",  # width 16: the projection maps 16 -> 24
        "loss.final_latent=0.5",
        "loss.feature=0.1",
        'loss.feature_map={"blocks.1" = "blocks.0"}',
    )
    run(cfg)
    rows = [row for row in read_metrics(tmp_path / "run") if "loss" in row]
    assert {"loss_output", "loss_final_latent", "loss_feature"} <= set(rows[-1])
    assert all(torch.isfinite(torch.tensor(row["loss"])) for row in rows)
    ckpt = resolve_latest(tmp_path / "run" / "checkpoints")
    proj = load_file(ckpt / "projections.safetensors")
    assert proj["projections.blocks__1.weight"].shape == (24, 16)


def test_a_feature_the_cache_lacks_is_refused_before_any_work(tmp_path: Path) -> None:
    write_cache(tmp_path / "c", range(4))
    cfg = _cfg(
        tmp_path / "c",
        tmp_path / "run",
        "loss.feature=0.1",
        'loss.feature_map={"blocks.9" = "blocks.0"}',
    )
    with pytest.raises(UsageError, match="blocks.9"):
        run(cfg)
    assert not (tmp_path / "run").exists()


def test_a_student_that_does_not_fit_the_cache_stops_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from wandistill.cli import main

    write_cache(tmp_path / "c", range(4))
    conf = tmp_path / "student.json"
    conf.write_text(json.dumps({"text_dim": 64, "in_channels": 4, "out_channels": 4}))
    cfg = _cfg(tmp_path / "c", tmp_path / "run", f'student.config_file="{conf}"')
    with pytest.raises(UsageError, match="text_dim=64.*text_dim=32"):
        run(cfg)
    assert not (tmp_path / "run").exists()
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "train",
                "--cache",
                str(tmp_path / "c"),
                "--out",
                str(tmp_path / "run"),
                "--set",
                f'student.config_file="{conf}"',
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "latent_channels=16" in err and "Traceback" not in err


def test_out_of_memory_is_one_error_with_figures_and_levers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_cache(tmp_path / "c", range(4))
    monkeypatch.setenv("WANDISTILL_FAULT", "train:step:2:0:oom")
    with pytest.raises(WandistillError) as info:
        run(_cfg(tmp_path / "c", tmp_path / "run"))
    text = str(info.value)
    assert "out of memory" in text and "batch_size=2" in text and "params" in text
    assert "--set train.batch_size=1 --set train.grad_accum=2" in text
    assert "gradient_checkpointing=true" in text and "bf16" in text


def _corrupt_one_record(cache: Path) -> tuple[str, str]:
    entry = read_manifest(cache).shards[0]
    path = cache / entry.file
    data = bytearray(path.read_bytes())
    data[entry.offsets[1][0] : entry.offsets[1][0] + 8] = b"\xff" * 8
    path.write_bytes(bytes(data))
    return entry.name, entry.keys[1]


def test_a_corrupt_record_fails_naming_shard_and_key_unless_skipped(tmp_path: Path) -> None:
    write_cache(tmp_path / "c", range(4))
    shard, key = _corrupt_one_record(tmp_path / "c")
    with pytest.raises(CacheError, match=f"corrupt record {key} in shard {shard}") as info:
        run(_cfg(tmp_path / "c", tmp_path / "a"))
    assert "--skip-corrupt" in str(info.value)
    r = run(_cfg(tmp_path / "c", tmp_path / "b"), skip_corrupt=True)
    assert r.steps == 8 and r.corrupt and all(key in m for m in r.corrupt)
    assert read_metrics(tmp_path / "b")[-1]["corrupt"] == len(r.corrupt)


def test_follow_mode_waits_for_the_cache_trains_as_it_grows_and_stops_when_complete(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "c"
    cfg = _cfg(cache, tmp_path / "run", "steps=100", "checkpoint_every=2")
    cfg.follow_poll_interval = 0.05
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(_capture(run, cfg, follow=True)))
    thread.start()  # before precompute has created the cache
    write_cache(cache, range(4), finalize=False, complete=False)  # 12 samples: 6 batches of 2
    deadline = time.monotonic() + 120  # a hang guard, not a timing assertion
    root = tmp_path / "run" / "checkpoints"
    while time.monotonic() < deadline and not (root / "checkpoint-6").is_dir():
        time.sleep(0.05)
    assert (root / "checkpoint-6").is_dir() and thread.is_alive(), result
    write_cache(cache, range(4, 7), rank=1, finalize=False, complete=False)  # 9 more samples
    write_cache(cache, [], rank=0, finalize=True, complete=True)
    thread.join(120)
    assert not thread.is_alive()
    (r,) = result
    assert not isinstance(r, BaseException), r
    assert r.steps == 10  # (12 + 9) // 2: all data, then stop well before steps=100
    state = json.loads((resolve_latest(root) / "state.json").read_text())
    assert state["step"] == 10 and len(state["reader"]["generations"]) >= 2


def _capture(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn's result, or the exception it raised (for calls made on another thread)."""
    try:
        return fn(*args, **kwargs)
    except BaseException as e:  # surfaced by the caller
        return e
