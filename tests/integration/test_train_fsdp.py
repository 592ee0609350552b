"""`train.parallel = "fsdp"`: FSDP2 on 2 gloo ranks trains what one process trains, and its
sharded checkpoints survive kill -9 and resume on another world size.

One uninterrupted run per world size is the reference every other run is compared with. Runs are
forked from the kill/resume tests' zygote (test_kill_resume.py: real processes, torchrun's
environment, SIGKILL from the fault-injection hook), started with unpickling made to raise
(tests/nopickle): FSDP2, DCP's safetensors storage and our collectives never unpickle.
Each test prints the largest weight difference it measured.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_kill_resume import Zygote, logs

from wandistill.train.checkpoint import resolve_latest
from wandistill.train.metrics import read_metrics

from cachefixtures import write_cache

pytestmark = [pytest.mark.dist, pytest.mark.slow]

REPO = Path(__file__).parents[2]
STEPS = 8
EVERY = 4
WEIGHTS = ("student", "student_ema")


@pytest.fixture(scope="module")
def zygote(zygote_nopickle: Zygote) -> Zygote:
    """The session's zygote with every way to unpickle made to raise in it and its children."""
    return zygote_nopickle


def argv(cache: Path, out: Path, ranks: int, *extra: str) -> list[str]:
    """The same run on 1 or 2 ranks: 4 samples per step either way (2 ranks x batch 1 x
    accumulation 2, or one process x batch 1 x accumulation 4), so FSDP's skipped gradient sync
    on micro-steps is in play; 18 samples, so 8 steps cross an epoch boundary."""
    return [
        "train",
        *("--cache", str(cache), "--out", str(out), "--steps", str(STEPS)),
        *("--set", "batch_size=1", "--set", f"grad_accum={4 // ranks}"),
        *("--set", f"checkpoint_every={EVERY}", "--set", "keep_checkpoints=2"),
        *("--set", "log_every=1", "--set", "loss.final_latent=0.5"),
        *("--set", "optim.warmup_steps=2", "--set", "optim.lr=1e-3"),
        *("--set", "student.num_layers=2", "--set", "student.num_attention_heads=2"),
        *("--set", "student.attention_head_dim=12", "--set", "student.ffn_dim=32"),
        *("--set", 'device="cpu"', "--set", "tensorboard=false", "--set", "data_threads=1"),
        *extra,
    ]


def weights(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {n: load_file(out / n / "diffusion_pytorch_model.safetensors") for n in WEIGHTS}


def max_diff(a: Path, b: Path) -> float:
    wa, wb = weights(a), weights(b)
    assert {n: set(w) for n, w in wa.items()} == {n: set(w) for n, w in wb.items()}
    return max(float((wa[n][k] - wb[n][k]).abs().max()) for n in WEIGHTS for k in wa[n])


def assert_same_run(a: Path, b: Path, what: str) -> float:
    """Equal weights (float reordering aside) and the same loss at every step."""
    wa, wb = weights(a), weights(b)
    for n in WEIGHTS:
        for k in wa[n]:
            torch.testing.assert_close(wa[n][k], wb[n][k], rtol=1e-4, atol=1e-5, msg=f"{what} {k}")
    rows = [{r["step"]: r["loss"] for r in read_metrics(o) if "loss" in r} for o in (a, b)]
    assert sorted(rows[0]) == sorted(rows[1]) == list(range(1, STEPS + 1)), what
    for step, loss in rows[0].items():
        assert loss == pytest.approx(rows[1][step], rel=1e-4), f"{what} step {step}"
    diff = max_diff(a, b)
    print(f"{what}: max |weight difference| {diff:.3g}")
    return diff


def run(z: Zygote, args: list[str], log: Path, ranks: int, **env: str) -> list[int]:
    return z.run(args, log, nproc=ranks, **env)


@pytest.fixture(scope="module")
def refs(zygote: Zygote, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Uninterrupted runs: one process without FSDP (the baseline), and FSDP on 2 ranks."""
    root = tmp_path_factory.mktemp("fsdp")
    write_cache(root / "cache", range(6))
    outs = {"cache": root / "cache", "one": root / "one", "fsdp2": root / "fsdp2"}
    codes = run(zygote, argv(outs["cache"], outs["one"], 1), root / "one.log", 1)
    assert codes == [0], logs(root / "one.log")
    args = argv(outs["cache"], outs["fsdp2"], 2, "--parallel", "fsdp")
    codes = run(zygote, args, root / "fsdp2.log", 2)
    assert codes == [0, 0], logs(root / "fsdp2.log", 2)
    assert "in 2 shards, 1/2 per rank" in logs(root / "fsdp2.log", 2)
    return outs


def latest_step(out: Path) -> int:
    latest = resolve_latest(out / "checkpoints")
    return int(latest.name.split("-")[1]) if latest else 0


def test_fsdp_on_2_ranks_trains_what_one_process_trains(refs: dict[str, Path]) -> None:
    diff = assert_same_run(refs["fsdp2"], refs["one"], "FSDP2 2 ranks vs 1 process (DDP path)")
    assert diff < 1e-5
    shards = sorted(
        p.name for p in (resolve_latest(refs["fsdp2"] / "checkpoints") / "shards").iterdir()
    )
    assert shards == [f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)]


def test_kill_9_while_a_sharded_checkpoint_is_written_then_resume(
    zygote: Zygote, refs: dict[str, Path], tmp_path: Path
) -> None:
    """Rank 1 dies after writing its shard of checkpoint 8, before it is published: the
    checkpoint is never used; --resume on 2 ranks continues from checkpoint 4."""
    out = tmp_path / "run"
    args = argv(refs["cache"], out, 2, "--parallel", "fsdp")
    codes = run(zygote, args, tmp_path / "k.log", 2, WANDISTILL_FAULT="train:shard:8:1")
    assert codes[1] == -signal.SIGKILL, (codes, logs(tmp_path / "k.log", 2))
    assert latest_step(out) == EVERY and not (out / "student").exists()
    assert list((out / "checkpoints").glob(".checkpoint-8.*"))  # the unpublished one
    codes = run(zygote, [*args, "--resume"], tmp_path / "r.log", 2)
    assert codes == [0, 0], logs(tmp_path / "r.log", 2)
    assert "resumed from" in logs(tmp_path / "r.log", 2)
    diff = assert_same_run(out, refs["fsdp2"], "kill -9 in checkpoint 8, resume on 2 ranks")
    assert diff == 0.0  # the same ranks, the same reductions: bit for bit


def test_resume_a_2_rank_checkpoint_on_1_process_and_back(
    zygote: Zygote, refs: dict[str, Path], tmp_path: Path
) -> None:
    """2 -> 1: killed (every rank) right after checkpoint 4, resumed on one process. 1 -> 2:
    one process killed after checkpoint 4, resumed on 2 ranks, this time with CPU offload and
    activation checkpointing (neither changes the numbers in fp32). Both continue the run."""
    down, up = tmp_path / "down", tmp_path / "up"
    kill = {"WANDISTILL_FAULT": f"train:saved:{EVERY}:*"}
    codes = run(
        zygote, argv(refs["cache"], down, 2, "--parallel", "fsdp"), tmp_path / "d.log", 2, **kill
    )
    assert codes == [-signal.SIGKILL] * 2, logs(tmp_path / "d.log", 2)
    codes = run(
        zygote,
        argv(refs["cache"], down, 1, "--parallel", "fsdp", "--resume"),
        tmp_path / "d1.log",
        1,
    )
    assert codes == [0], logs(tmp_path / "d1.log")
    assert_same_run(down, refs["fsdp2"], "2 ranks -> resume on 1 process")

    lean = ("--parallel", "fsdp", "--set", "fsdp.cpu_offload=true")
    lean += ("--set", "gradient_checkpointing=true")
    codes = run(zygote, argv(refs["cache"], up, 1, *lean), tmp_path / "u.log", 1, **kill)
    assert codes == [-signal.SIGKILL], logs(tmp_path / "u.log")
    said = logs(tmp_path / "u.log")
    assert "fsdp on 1 process: 1 shard" in said, said  # bad input: runs, and says so
    assert "cpu_offload on" in said
    assert latest_step(up) == EVERY
    codes = run(zygote, argv(refs["cache"], up, 2, *lean, "--resume"), tmp_path / "u2.log", 2)
    assert codes == [0, 0], logs(tmp_path / "u2.log", 2)
    assert_same_run(up, refs["fsdp2"], "1 process -> resume on 2 ranks")
    assert_same_run(up, refs["one"], "1 process -> 2 ranks vs the 1-process baseline")


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
    }


def test_resume_that_changes_the_parallel_mode_is_refused_writing_nothing(
    zygote: Zygote, refs: dict[str, Path], tmp_path: Path
) -> None:
    for out, mode, saved in ((refs["fsdp2"], "ddp", "fsdp"), (refs["one"], "fsdp", "ddp")):
        before = _tree(out)
        args = argv(refs["cache"], out, 1, "--parallel", mode, "--resume")
        log = tmp_path / f"{mode}.log"
        assert run(zygote, args, log, 1) == [2], logs(log)
        said = logs(log)
        errors = [line for line in said.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in said, said
        assert f"train.parallel={saved!r}, this run has {mode!r}" in errors[0]
        assert f"resume with --parallel {saved}" in errors[0]
        assert _tree(out) == before
