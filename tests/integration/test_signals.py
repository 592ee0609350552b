"""SIGTERM and Ctrl-C (SIGINT): a clean stop that keeps the work done and says how to resume.

precompute drops the batch being computed, flushes the open shard (its complete records are
committed), never marks the cache complete, prints "stopped by SIGTERM after N records; re-run
the same command to resume" and exits 143 (SIGINT: 130). train saves a checkpoint at the step it
stopped at, prints "stopped by SIGTERM at step N; resume with --resume" and exits the same way.
Under torchrun every precompute rank flushes its own shards, every train rank stops at the same
step, and nothing waits forever in a collective.

Single-process runs are forks of a zygote that imported everything once (tests/zygote.py): real
processes that really get the signal, without seconds of imports each; the torchrun runs that
are signalled are real torchrun jobs (their references and plain resumes are forks too).
Deterministic stops come from the test hook (`WANDISTILL_FAULT=...:term`: the process sends
itself a real SIGTERM at an exact point); the others come from outside, as soon as a progress
marker shows up on disk. Every stop is then resumed and compared with an uninterrupted
run: the same record bytes, the same student weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import wandistill
from wandistill.cache.manifest import load_committed, read_manifest
from wandistill.cache.wds.reader import WebDatasetSource
from wandistill.config import load_recipe
from wandistill.train.checkpoint import resolve_latest

from cachefixtures import write_cache
from zygote import Zygote, alive

REPO = Path(__file__).parents[2]
HANG_GUARD_S = 300.0  # only detects a hang; never a measure of speed
N_PROMPTS = 40


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDISTILL_")}
    return {**env, "OMP_NUM_THREADS": "1", "COLUMNS": "120", "PYTHONUNBUFFERED": "1", **extra}


def _torchrun(*args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "wandistill",
        *args,
    ]


class Job:
    """A command in its own session, output in files (so a test can watch them while it runs)."""

    def __init__(self, cmd: list[str], log: Path, **env: str) -> None:
        self.log = log
        self._out = open(log.with_suffix(".out"), "w")  # noqa: SIM115 - closed in wait()
        self._err = open(log.with_suffix(".err"), "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=_env(**env),
            stdout=self._out,
            stderr=self._err,
            start_new_session=True,
        )

    @property
    def err(self) -> str:
        return self.log.with_suffix(".err").read_text(errors="replace")

    @property
    def out(self) -> str:
        return self.log.with_suffix(".out").read_text(errors="replace")

    def wait_for(self, ready: Callable[[], bool]) -> None:
        """Poll a progress marker on disk while the run goes on."""
        deadline = time.monotonic() + HANG_GUARD_S
        while not ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the run ended before the marker showed up:\n{self.err[-3000:]}")
            time.sleep(0.005)

    def signal_when(self, ready: Callable[[], bool], sig: int) -> None:
        self.wait_for(ready)
        self.proc.send_signal(sig)

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            pytest.fail(f"hung for {HANG_GUARD_S:.0f} s:\n{self.err[-3000:]}")
        finally:
            self._out.close()
            self._err.close()


class Forked:
    """`wandistill ARGV` forked from the module's zygote (tests/zygote.py): a real process with
    its own pid, signals, exit code and output files, without seconds of imports per run."""

    def __init__(self, z: Zygote, argv: list[str], log: Path, **env: str) -> None:
        self.log, self._z = log, z
        self._pids = z.start(argv, log, split=True, **env)
        self.pid = self._pids[0]

    @property
    def err(self) -> str:
        return Path(f"{self.log}.0.err").read_text(errors="replace")

    @property
    def out(self) -> str:
        return Path(f"{self.log}.0").read_text(errors="replace")

    def running_after(self, seconds: float) -> bool:
        """Wait up to `seconds` for the process to end; True if it still runs."""
        deadline = time.monotonic() + seconds
        while alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.005)
        return alive(self.pid)

    def wait_for(self, ready: Callable[[], bool]) -> None:
        """Poll a progress marker on disk while the run goes on."""
        deadline = time.monotonic() + HANG_GUARD_S
        while not ready():
            if not alive(self.pid) or time.monotonic() > deadline:
                pytest.fail(f"the run ended before the marker showed up:\n{self.err[-3000:]}")
            time.sleep(0.005)

    def signal_when(self, ready: Callable[[], bool], sig: int) -> None:
        self.wait_for(ready)
        os.kill(self.pid, sig)

    def wait(self) -> int:
        return self._z.wait(self._pids)[0]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """In-process runs use one thread, like the OMP_NUM_THREADS=1 subprocesses (same bits)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def rank_traceback(err: str) -> bool:
    """True if any traceback frame is wandistill code (torchrun's own frames do not count)."""
    pkg = str(Path(wandistill.__file__).parent)
    return any(ln.lstrip().startswith("File ") and pkg in ln for ln in err.splitlines())


def handlers() -> tuple[object, object]:
    return signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)


# --------------------------------------------------------------------------- precompute


def _pre_sets(teacher: Path, prompts: Path, cache: Path) -> list[str]:
    return [
        f'teacher.path="{teacher}"',
        f'prompts="{prompts}"',
        f'cache.path="{cache}"',
        "previews=0",
        "sampler.batch_size=2",
        "cache.shard_records=3",
        "sampler.height=32",
        "sampler.width=32",
        "sampler.num_inference_steps=8",
    ]


def _pre_argv(sets: list[str]) -> list[str]:
    return ["precompute", "pipelines/tiny.toml", *(x for s in sets for x in ("--set", s))]


def _pre_inprocess(sets: list[str]):  # noqa: ANN202 - the precompute Summary
    from wandistill.precompute.run import run

    cfg = load_recipe(REPO / "pipelines" / "tiny.toml", sets, stage="precompute").precompute
    with one_thread():
        return run(cfg, quiet=True)


def _records(cache: Path) -> tuple[list[str], dict[str, bytes]]:
    m = load_committed(cache)
    src = WebDatasetSource(cache)
    try:
        keys = [k for s in m.shards for k in s.keys]
        return keys, {k: src.read_blob(e, i) for e in m.shards for i, k in enumerate(e.keys)}
    finally:
        src.close()


@pytest.fixture(scope="module")
def pre(tiny_teacher: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("signals-precompute")
    prompts = root / "prompts.txt"
    prompts.write_text("".join(f"a small scene number {i}\n" for i in range(N_PROMPTS)))
    teacher = tiny_teacher
    _pre_inprocess(_pre_sets(teacher, prompts, root / "reference"))
    keys, blobs = _records(root / "reference")
    assert len(keys) == len(set(keys)) == N_PROMPTS
    return {"teacher": teacher, "prompts": prompts, "reference": blobs}


def _stopped_cache_is_resumable(pre: dict, cache: Path, committed: int) -> None:
    """The stopped run left `committed` records, no open shard; a rerun completes it exactly."""
    assert not read_manifest(cache).complete
    assert not list((cache / "shards").glob(".*.tmp")), "the open shard was not flushed"
    keys, blobs = _records(cache)
    assert len(keys) == len(set(keys)) == committed
    assert all(blobs[k] == pre["reference"][k] for k in keys)
    before = handlers()
    summary = _pre_inprocess(_pre_sets(pre["teacher"], pre["prompts"], cache))
    assert handlers() == before, "precompute must restore the signal handlers it replaced"
    assert summary.records_written == N_PROMPTS - committed
    keys, blobs = _records(cache)
    assert read_manifest(cache).complete and len(keys) == len(set(keys)) == N_PROMPTS
    assert blobs == pre["reference"]


def test_precompute_sigterm_flushes_the_open_shard_and_a_rerun_completes(
    zygote: Zygote, pre: dict, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    # SIGTERM while record 4 is written: batch 2 (records 3-4) completes, the shard holding
    # record 4 is flushed with that one record, and the run stops with 4 records committed.
    job = Forked(
        zygote,
        _pre_argv(_pre_sets(pre["teacher"], pre["prompts"], cache)),
        tmp_path / "run",
        WANDISTILL_FAULT="precompute:record:4::term",
    )
    assert job.wait() == 143, job.err[-3000:]
    assert "stopped by SIGTERM after 4 records; re-run the same command to resume" in job.err
    assert "Traceback" not in job.err
    journal = json.loads((cache / "journal" / "rank-00000.json").read_text())
    assert [s["records"] for s in journal["shards"]] == [3, 1]
    _stopped_cache_is_resumable(pre, cache, 4)


def _journals(cache: Path) -> int:
    n = 0
    for p in (cache / "journal").glob("rank-*.json"):
        with contextlib.suppress(json.JSONDecodeError, FileNotFoundError):
            n += len(json.loads(p.read_text())["shards"])
    return n


@pytest.mark.slow
def test_precompute_ctrl_c_from_outside_stops_cleanly(
    zygote: Zygote, pre: dict, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    argv = _pre_argv(_pre_sets(pre["teacher"], pre["prompts"], cache))
    job = Forked(zygote, argv, tmp_path / "r")
    job.signal_when(lambda: _journals(cache) >= 1, signal.SIGINT)
    assert job.wait() == 130, job.err[-3000:]
    m = re.search(r"stopped by SIGINT after (\d+) records; re-run the same command", job.err)
    assert m, job.err[-3000:]
    assert "Traceback" not in job.err
    _stopped_cache_is_resumable(pre, cache, int(m.group(1)))


@pytest.mark.slow
@pytest.mark.dist
def test_precompute_sigterm_to_torchrun_stops_every_rank_cleanly(pre: dict, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    job = Job(
        _torchrun(*_pre_argv(_pre_sets(pre["teacher"], pre["prompts"], cache))), tmp_path / "r"
    )
    job.signal_when(lambda: _journals(cache) >= 1, signal.SIGTERM)  # torchrun forwards it
    assert job.wait() != 0
    stops = re.findall(r"stopped by SIGTERM after (\d+) records \(rank (\d) of 2\)", job.err)
    assert sorted(r for _, r in stops) == ["0", "1"], job.err[-3000:]
    assert not rank_traceback(job.err)  # torchrun prints its own SignalException traceback
    _stopped_cache_is_resumable(pre, cache, sum(int(n) for n, _ in stops))


# --------------------------------------------------------------------------- train

SMALL = [
    "batch_size=2",
    "log_every=1",
    "loss.final_latent=0.5",
    "optim.warmup_steps=2",
    "student.num_layers=1",
    "student.num_attention_heads=2",
    "student.attention_head_dim=12",
    "student.ffn_dim=32",
    'device="cpu"',
    "tensorboard=false",
    "data_threads=1",
]
WEIGHTS = [f"{d}/diffusion_pytorch_model.safetensors" for d in ("student", "student_ema")]


def _train_sets(cache: Path, out: Path, steps: int, every: int) -> list[str]:
    return [
        f'cache="{cache}"',
        f'out="{out}"',
        f"steps={steps}",
        f"checkpoint_every={every}",
        *SMALL,
    ]


def _train_argv(sets: list[str], *extra: str) -> list[str]:
    return ["train", *(x for s in sets for x in ("--set", s)), *extra]


def _train_inprocess(sets: list[str], *, resume: bool = False) -> None:
    from wandistill.train import run

    with one_thread():
        run(load_recipe(None, sets, stage="train").train, resume=resume)


def _latest(out: Path) -> str | None:
    latest = resolve_latest(out / "checkpoints")
    return latest.name if latest else None


def _same_weights(a: Path, b: Path) -> bool:
    return all((a / w).read_bytes() == (b / w).read_bytes() for w in WEIGHTS)


def _metrics_row(out: Path, step: int) -> Callable[[], bool]:
    def ready() -> bool:
        try:
            return f'"step": {step}, "epoch"' in (out / "metrics.jsonl").read_text()
        except FileNotFoundError:
            return False

    return ready


def test_train_sigterm_saves_a_checkpoint_and_resume_matches(
    zygote: Zygote, tmp_path: Path
) -> None:
    write_cache(tmp_path / "c", range(6))
    _train_inprocess(_train_sets(tmp_path / "c", tmp_path / "ref", 10, 4))
    out = tmp_path / "run"
    sets = _train_sets(tmp_path / "c", out, 10, 4)
    job = Forked(zygote, _train_argv(sets), tmp_path / "run", WANDISTILL_FAULT="train:step:5::term")
    assert job.wait() == 143, job.err[-3000:]
    assert "stopped by SIGTERM at step 5; resume with --resume" in job.err
    assert "Traceback" not in job.err
    assert _latest(out) == "checkpoint-5"  # not a checkpoint_every step: saved by the stop
    assert not (out / "student").exists()
    before = handlers()
    _train_inprocess(sets, resume=True)
    assert handlers() == before, "train must restore the signal handlers it replaced"
    assert _same_weights(out, tmp_path / "ref")


@pytest.mark.slow
def test_train_ctrl_c_from_outside_stops_at_a_step_and_resume_matches(
    zygote: Zygote, tmp_path: Path
) -> None:
    write_cache(tmp_path / "c", range(6))
    _train_inprocess(_train_sets(tmp_path / "c", tmp_path / "ref", 150, 50))
    out = tmp_path / "run"
    sets = _train_sets(tmp_path / "c", out, 150, 50)
    job = Forked(zygote, _train_argv(sets), tmp_path / "run")
    job.signal_when(_metrics_row(out, 3), signal.SIGINT)
    assert job.wait() == 130, job.err[-3000:]
    m = re.search(r"stopped by SIGINT at step (\d+); resume with --resume", job.err)
    assert m, job.err[-3000:]
    assert _latest(out) == f"checkpoint-{m.group(1)}"
    _train_inprocess(sets, resume=True)
    assert _same_weights(out, tmp_path / "ref")


@pytest.mark.slow
@pytest.mark.dist
def test_train_under_torchrun_every_rank_stops_at_the_same_step(
    zygote: Zygote, tmp_path: Path
) -> None:
    write_cache(tmp_path / "c", range(8))
    # The reference and the final resume get no signal: torchrun and its ranks are forks of the
    # zygote there; the two runs that are stopped are real torchrun jobs.
    ref_sets = _train_sets(tmp_path / "c", tmp_path / "ref", 60, 20)
    ref = zygote.torchrun(["-m", "wandistill", *_train_argv(ref_sets)], env=_env())
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = tmp_path / "run"
    sets = _train_sets(tmp_path / "c", out, 60, 20)

    # Only rank 1 gets SIGTERM (after step 4): the ranks agree, both save step 4 and stop.
    one = Job(
        _torchrun(*_train_argv(sets)),
        tmp_path / "one",
        WANDISTILL_FAULT="train:step:4:1:term",
    )
    assert one.wait() != 0
    for rank in (0, 1):
        assert f"stopped by SIGTERM at step 4 (rank {rank} of 2); resume with --resume" in one.err
    assert _latest(out) == "checkpoint-4"

    # SIGTERM to torchrun itself, which forwards it to both ranks, wherever they are.
    two = Job(_torchrun(*_train_argv(sets, "--resume")), tmp_path / "two")
    two.signal_when(_metrics_row(out, 8), signal.SIGTERM)
    assert two.wait() != 0
    steps = re.findall(r"stopped by SIGTERM at step (\d+) \(rank (\d) of 2\)", two.err)
    assert sorted(r for _, r in steps) == ["0", "1"], two.err[-3000:]
    assert len({s for s, _ in steps}) == 1, f"the ranks stopped at different steps: {steps}"
    assert _latest(out) == f"checkpoint-{steps[0][0]}"

    last = zygote.torchrun(["-m", "wandistill", *_train_argv(sets, "--resume")], env=_env())
    assert last.returncode == 0, last.stderr[-3000:]
    assert _same_weights(out, tmp_path / "ref")


@pytest.mark.slow
def test_train_follow_waiting_for_data_stops_on_a_second_ctrl_c(
    zygote: Zygote, tmp_path: Path
) -> None:
    cache = tmp_path / "c"
    write_cache(cache, [], finalize=False, complete=False)  # no records yet: train waits
    out = tmp_path / "run"
    sets = [*_train_sets(cache, out, 50, 50), "follow_poll_interval=0.05"]
    job = Forked(zygote, _train_argv(sets, "--follow"), tmp_path / "run")
    metrics = out / "metrics.jsonl"
    job.wait_for(lambda: metrics.is_file() and "start" in metrics.read_text())
    # A Ctrl-C asks for a stop at the next step, which does not come while --follow waits for
    # data; Ctrl-C again stops it at once. A person's Ctrl-Cs, a second apart:
    for _ in range(10):
        if not job.running_after(1.0):
            break
        os.kill(job.pid, signal.SIGINT)
    code = job.wait()
    assert code in (130, -signal.SIGINT), job.err[-3000:]  # a shell shows both as 130
    assert "Traceback" not in job.err
    assert "stopped by SIGINT" not in job.err  # it was waiting: no step, so no clean stop
