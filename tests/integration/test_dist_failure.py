"""One rank failing under torchrun (raising, or SIGKILLed): the job comes down, the disk resumes.

The contract (docs/distributed.md): a rank that raises prints its one-line error and exits at
once; torchrun then SIGTERMs the others, which stop cleanly (precompute: each flushes its own
shards; train: a peer lost mid-collective is one line, never a wait), so every rank is gone
within 60 s of the failure, and the output on disk resumes (1 process or 2) to exactly the result
of an uninterrupted run. Failures are injected at exact points with `WANDISTILL_FAULT`
(wandistill/runtime/failures.py) and train's `WANDISTILL_FAULT`. 2 gloo ranks on CPU.

torchrun's agent and its ranks are forks of the session's zygote (tests/zygote.py: real
processes running torch.distributed.run and `-m wandistill`, the signals torchrun sends forwarded
to them); test_signals.py and test_train_dist.py start torchrun and its ranks afresh.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import wandistill
from wandistill.cache.manifest import load_committed, read_manifest
from wandistill.cache.wds.reader import WebDatasetSource
from wandistill.config import load_recipe
from wandistill.train.checkpoint import resolve_latest

from cachefixtures import write_cache
from zygote import Zygote, fork_pid

pytestmark = [pytest.mark.dist, pytest.mark.slow]

REPO = Path(__file__).parents[2]
HANG_GUARD_S = 300.0  # startup included; only detects a hang
EXIT_WITHIN_S = 60.0  # the contract: every rank gone this long after the first one failed


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDISTILL_")}
    return {**env, "OMP_NUM_THREADS": "1", "COLUMNS": "120", "PYTHONUNBUFFERED": "1", **extra}


def _torchrun(python: str, *args: str) -> list[str]:
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "wandistill",
        *args,
    ]


def _children(pid: int) -> set[int]:
    try:
        return {int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except (FileNotFoundError, ProcessLookupError):
        return set()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):  # gone (even mid-read)
        return False


class Job:
    """torchrun in its own session; stderr in a file; knows its ranks' pids."""

    def __init__(self, zygote: Zygote, args: list[str], log: Path, **env: str) -> None:
        self.log = log
        self._err = open(log, "w")  # noqa: SIM115 - closed in the wait methods
        self._pidfile = log.with_name(log.name + ".pid")
        self.proc = subprocess.Popen(
            _torchrun(zygote.python, *args),
            cwd=REPO,
            env=zygote.env(_env(ZYGOTE_PID_FILE=str(self._pidfile), **env)),
            stdout=subprocess.DEVNULL,
            stderr=self._err,
            start_new_session=True,
        )

    @property
    def err(self) -> str:
        return self.log.read_text(errors="replace")

    def _hung(self, why: str) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._err.close()
        pytest.fail(f"{why}:\n{self.err[-3000:]}")

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            self._hung(f"torchrun hung for {HANG_GUARD_S:.0f} s")
            raise
        finally:
            self._err.close()

    def wait_failure(self) -> int:
        """Wait until a rank has exited, then give every other rank EXIT_WITHIN_S to be gone."""
        deadline = time.monotonic() + HANG_GUARD_S
        agent = fork_pid(self._pidfile, self.proc)  # torchrun's agent: the ranks' parent
        ranks: set[int] = set()
        while len(ranks) < 2 and self.proc.poll() is None and agent is not None:
            ranks |= _children(agent)
            time.sleep(0.01)
        while all(_alive(p) for p in ranks) and self.proc.poll() is None:
            if time.monotonic() > deadline:
                self._hung("no rank failed")
            time.sleep(0.01)
        try:
            return self.proc.wait(timeout=EXIT_WITHIN_S)  # a bounded wait, not a timing
        except subprocess.TimeoutExpired:
            self._hung(f"ranks still running {EXIT_WITHIN_S:.0f} s after one failed")
            raise
        finally:
            self._err.close()


def other_rank_ended_cleanly(err: str, rank: int) -> bool:
    """The rank printed its one line (a stop, or a lost peer), or torchrun's SIGTERM ended it
    after it had put its own handlers back on the way out (torchrun then reports -15)."""
    return (
        f"(rank {rank} of 2)" in err
        or f"rank {rank}: " in err
        or re.search(rf"rank\s*: {rank} \(local_rank: {rank}\)\s*exitcode\s*: -15", err) is not None
    )


def rank_traceback(err: str) -> bool:
    """True if any traceback frame is wandistill code (torchrun's own frames do not count)."""
    pkg = str(Path(wandistill.__file__).parent)
    return any(ln.lstrip().startswith("File ") and pkg in ln for ln in err.splitlines())


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # like the OMP_NUM_THREADS=1 ranks: the same bits
    try:
        yield
    finally:
        torch.set_num_threads(n)


# --------------------------------------------------------------------------- precompute

N_PROMPTS = 16


def _pre_sets(pre: dict, cache: Path) -> list[str]:
    return [
        f'teacher.path="{pre["teacher"]}"',
        f'prompts="{pre["prompts"]}"',
        f'cache.path="{cache}"',
        "previews=0",
        "sampler.batch_size=2",
        "cache.shard_records=3",
        "sampler.height=32",
        "sampler.width=32",
        "sampler.num_inference_steps=4",
    ]


def _pre_args(sets: list[str]) -> list[str]:
    return ["precompute", "pipelines/tiny.toml", *(x for s in sets for x in ("--set", s))]


def _pre_inprocess(sets: list[str]) -> None:
    from wandistill.precompute.run import run

    with one_thread():
        run(load_recipe(REPO / "pipelines" / "tiny.toml", sets, stage="precompute").precompute)


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
    root = tmp_path_factory.mktemp("dist-failure-precompute")
    prompts = root / "prompts.txt"
    prompts.write_text("".join(f"a scene for rank failures {i}\n" for i in range(N_PROMPTS)))
    pre = {"teacher": tiny_teacher, "prompts": prompts}
    _pre_inprocess(_pre_sets(pre, root / "reference"))
    pre["reference"] = _records(root / "reference")[1]
    return pre


def _failed_cache_resumes(zygote: Zygote, pre: dict, cache: Path, *, ranks: int, log: Path) -> None:
    """Not complete, what is committed is right; a rerun with `ranks` processes completes it."""
    assert not read_manifest(cache).complete
    keys, blobs = _records(cache)
    assert len(keys) == len(set(keys)) and all(blobs[k] == pre["reference"][k] for k in keys)
    if ranks == 1:
        _pre_inprocess(_pre_sets(pre, cache))
    else:
        rerun = Job(zygote, _pre_args(_pre_sets(pre, cache)), log)
        assert rerun.wait() == 0, rerun.err[-3000:]
    keys, blobs = _records(cache)
    assert read_manifest(cache).complete and len(keys) == len(set(keys)) == N_PROMPTS
    assert blobs == pre["reference"]


def test_precompute_rank_raising_stops_every_rank_and_one_process_resumes(
    zygote: Zygote, pre: dict, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    job = Job(
        zygote,
        _pre_args(_pre_sets(pre, cache)),
        tmp_path / "run.err",
        WANDISTILL_FAULT="precompute:record:3:1:raise",
    )
    assert job.wait_failure() != 0
    err = job.err
    assert err.count("error: injected failure on rank 1 at precompute record 3") == 1, err[-3000:]
    # Rank 0 was SIGTERMed by torchrun (or saw rank 1 vanish at the final barrier): one line.
    assert other_rank_ended_cleanly(err, 0), err[-3000:]
    assert not rank_traceback(err)
    _failed_cache_resumes(zygote, pre, cache, ranks=1, log=tmp_path / "rerun.err")


def test_precompute_rank_killed_stops_every_rank_and_two_ranks_resume(
    zygote: Zygote, pre: dict, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    job = Job(
        zygote,
        _pre_args(_pre_sets(pre, cache)),
        tmp_path / "run.err",
        WANDISTILL_FAULT="precompute:record:4:0:kill",
    )
    assert job.wait_failure() != 0
    err = job.err
    assert "Signal 9 (SIGKILL) received by PID" in err or "exitcode  : -9" in err, err[-3000:]
    assert other_rank_ended_cleanly(err, 1), err[-3000:]
    assert not rank_traceback(err)
    _failed_cache_resumes(zygote, pre, cache, ranks=2, log=tmp_path / "rerun.err")


# --------------------------------------------------------------------------- train

STEPS = 12
SETS = [
    f"steps={STEPS}",
    "checkpoint_every=3",
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


def _train_args(cache: Path, out: Path, *extra: str) -> list[str]:
    sets = [f'cache="{cache}"', f'out="{out}"', *SETS]
    return ["train", *(x for s in sets for x in ("--set", s)), *extra]


def _latest(out: Path) -> str | None:
    latest = resolve_latest(out / "checkpoints")
    return latest.name if latest else None


def test_train_rank_raising_then_rank_killed_each_stop_the_job_and_resume_matches(
    zygote: Zygote, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    write_cache(cache, range(8))  # 24 samples: 6 global batches of 4 per epoch
    ref = Job(zygote, _train_args(cache, tmp_path / "ref"), tmp_path / "ref.err")
    assert ref.wait() == 0, ref.err[-3000:]
    out = tmp_path / "run"

    # Rank 1 raises after step 5: rank 0 is left in a collective, says so in one line, exits.
    one = Job(
        zygote,
        _train_args(cache, out),
        tmp_path / "one.err",
        WANDISTILL_FAULT="train:step:5:1:raise",
    )
    assert one.wait_failure() != 0
    assert one.err.count("error: injected failure on rank 1 at train step 5") == 1, one.err[-3000:]
    assert other_rank_ended_cleanly(one.err, 0), one.err[-3000:]
    assert not rank_traceback(one.err)
    assert _latest(out) == "checkpoint-3" and not (out / "student").exists()

    # Resumed, rank 0 is SIGKILLed after step 8: rank 1 and torchrun come down too.
    two = Job(
        zygote,
        _train_args(cache, out, "--resume"),
        tmp_path / "two.err",
        WANDISTILL_FAULT="train:step:8:0:kill",
    )
    assert two.wait_failure() != 0
    assert "Signal 9 (SIGKILL) received by PID" in two.err or "exitcode  : -9" in two.err
    assert other_rank_ended_cleanly(two.err, 1), two.err[-3000:]
    assert not rank_traceback(two.err)
    assert _latest(out) == "checkpoint-6" and not (out / "student").exists()

    last = Job(zygote, _train_args(cache, out, "--resume"), tmp_path / "last.err")
    assert last.wait() == 0, last.err[-3000:]
    for w in WEIGHTS:
        assert (out / w).read_bytes() == (tmp_path / "ref" / w).read_bytes(), w
