"""Every rank exits: a rank that never arrives, or ranks that run different configurations.

torchrun starts 2 gloo ranks on CPU. A rank is made to never arrive with the test hook
`WANDISTILL_FAULT=dist:init:0:<rank>:hang` (it sleeps before joining); the other rank must
exit on its own within `WANDISTILL_DIST_TIMEOUT` (5 s here), naming the missing rank. Different
configurations per rank come from a two-line launcher (`torchrun --no-python python -c ...`) that
gives each rank its own argv; every rank must exit naming the differing keys. Each test prints
the seconds from start until the rank exited (figures in docs/reliability.md); the bounded waits
only detect a hang, they time nothing. torchrun and its ranks are forks of the session's zygote
(tests/zygote.py): real processes, without each paying seconds of imports.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

import wandistill

from cachefixtures import write_cache
from zygote import Zygote

pytestmark = [pytest.mark.dist, pytest.mark.slow]

REPO = Path(__file__).parents[2]
TIMEOUT_S = 5
HANG_GUARD_S = 240.0

LAUNCH = (
    "import json, os, sys, time; from wandistill.cli import main; "
    "print(f'start {time.time():.3f}', file=sys.stderr, flush=True); "
    "argv = json.loads(os.environ['ARGV_BY_RANK'])[int(os.environ['RANK'])]; "
    "code = 0\n"
    "try:\n    main(argv)\nexcept SystemExit as e:\n    code = e.code\n"
    "print(f'rank {os.environ[\"RANK\"]} exit {code} at {time.time():.3f}', file=sys.stderr, "
    "flush=True); sys.exit(code)"
)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDISTILL_")}
    return {
        **env,
        "OMP_NUM_THREADS": "1",
        "COLUMNS": "200",
        "PYTHONUNBUFFERED": "1",
        "WANDISTILL_DIST_TIMEOUT": str(TIMEOUT_S),
        **extra,
    }


def torchrun(zygote: Zygote, argvs: list[list[str]], log: Path, **env: str) -> tuple[int, str]:
    """Run one argv per rank under torchrun (2 ranks); (exit code, stderr of every rank)."""
    cmd = [
        zygote.python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--no-python",
        zygote.python,
        "-c",
        LAUNCH,
    ]
    with open(log, "w") as err:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=zygote.env(_env(ARGV_BY_RANK=json.dumps(argvs), **env)),
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"a rank hung:\n{log.read_text()[-3000:]}")
    return code, log.read_text(errors="replace")


def rank_traceback(err: str) -> bool:
    """True if any traceback frame is wandistill code (torchrun's own frames do not count)."""
    pkg = str(Path(wandistill.__file__).parent)
    return any(ln.lstrip().startswith("File ") and pkg in ln for ln in err.splitlines())


def exit_seconds(err: str, rank: int) -> float:
    """Seconds from the first rank's start to this rank's exit line (printed for the docs)."""
    starts = [float(x) for x in re.findall(r"start (\d+\.\d+)", err)]
    end = re.search(rf"rank {rank} exit \S+ at (\d+\.\d+)", err)
    assert starts and end, err[-3000:]
    return float(end.group(1)) - min(starts)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dist-timeouts") / "cache"
    write_cache(path, range(4))
    return path


def train_argv(cache: Path, out: Path, *extra: str) -> list[str]:
    sets = [
        f'cache="{cache}"',
        f'out="{out}"',
        "steps=2",
        "batch_size=1",
        "student.num_layers=1",
        "student.num_attention_heads=2",
        "student.attention_head_dim=12",
        "student.ffn_dim=32",
        'device="cpu"',
        "tensorboard=false",
        "data_threads=1",
        *extra,
    ]
    return ["train", *(x for s in sets for x in ("--set", s))]


def test_a_rank_that_never_arrives_is_named_by_the_others_within_the_timeout(
    zygote: Zygote, cache: Path, tmp_path: Path
) -> None:
    missing = 1  # under torchrun the agent hosts the store: rank 0 missing is the same path
    argv = train_argv(cache, tmp_path / "run")
    code, err = torchrun(
        zygote, [argv, argv], tmp_path / "err", WANDISTILL_FAULT=f"dist:init:0:{missing}:hang"
    )
    other = 1 - missing
    assert code != 0
    line = re.search(rf"error: rank {other} of 2: .*", err)
    assert line, err[-3000:]
    assert f"rank {missing}" in line.group(0) and f"{TIMEOUT_S} s" in line.group(0), line.group(0)
    assert not rank_traceback(err), err[-3000:]
    hang = float(re.search(r"hangs at dist init 0 \(t=(\d+\.\d+)\)", err).group(1))
    end = float(re.search(rf"rank {other} exit \S+ at (\d+\.\d+)", err).group(1))
    print(
        f"rank {missing} never arrives: rank {other} exited {end - hang:.1f} s after rank "
        f"{missing} stopped short of joining (timeout {TIMEOUT_S} s): {line.group(0)}"
    )
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_ranks_with_different_configurations_all_exit_naming_the_keys(
    zygote: Zygote, cache: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    argvs = [train_argv(cache, out), train_argv(cache, out, "optim.lr=0.001", "seed=3")]
    code, err = torchrun(zygote, argvs, tmp_path / "err")
    assert code != 0
    for rank in (0, 1):
        line = re.search(rf"error: rank {rank} of 2: the ranks run different configurations.*", err)
        assert line, err[-3000:]
        text = line.group(0)
        assert "train.optim.lr: rank 0 0.0001, rank 1 0.001" in text, text
        assert "train.seed: rank 0 0, rank 1 3" in text, text
        assert not rank_traceback(err)
        print(f"rank {rank} exited after {exit_seconds(err, rank):.1f} s: {text}")
    assert not (out / "checkpoints").exists()


def test_precompute_ranks_with_different_sampler_settings_all_exit(
    zygote: Zygote, tiny_teacher: Path, tmp_path: Path
) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\nthree\n")
    base = [
        "precompute",
        "pipelines/tiny.toml",
        "--teacher",
        str(tiny_teacher),
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "cache"),
        "--set",
        "previews=0",
    ]
    code, err = torchrun(
        zygote, [base, [*base, "--set", "sampler.guidance_scale=3.0"]], tmp_path / "err"
    )
    assert code != 0
    for rank in (0, 1):
        assert re.search(
            rf"rank {rank} of 2: the ranks run different configurations; differing keys: "
            r"precompute.sampler.guidance_scale: rank 0 5.0, rank 1 3.0",
            err,
        ), err[-3000:]
    assert not (tmp_path / "cache" / "shards").exists()
    assert not rank_traceback(err)
    print(
        f"precompute: ranks exited after {exit_seconds(err, 0):.1f} / {exit_seconds(err, 1):.1f} s"
    )


def test_a_rank_that_hangs_mid_training_is_named_when_the_collective_times_out(
    zygote: Zygote, cache: Path, tmp_path: Path
) -> None:
    argv = train_argv(cache, tmp_path / "run", "steps=6", "checkpoint_every=2")
    code, err = torchrun(
        zygote, [argv, argv], tmp_path / "err", WANDISTILL_FAULT="train:step:3:1:hang"
    )
    assert code != 0
    line = re.search(r"error: rank 0: a collective failed, rank 1 did not answer.*", err)
    assert line, err[-3000:]
    assert not rank_traceback(err)
    assert (tmp_path / "run" / "checkpoints" / "checkpoint-2").is_dir()
    hang = float(re.search(r"hangs at train step 3 \(t=(\d+\.\d+)\)", err).group(1))
    end = float(re.search(r"rank 0 exit \S+ at (\d+\.\d+)", err).group(1))
    print(
        f"rank 1 hangs after step 3: rank 0 exited {end - hang:.1f} s after the hang began "
        f"(timeout {TIMEOUT_S} s): {line.group(0)[:160]}"
    )


def test_a_rank_that_hangs_mid_precompute_is_named_by_the_rank_waiting_at_the_end(
    zygote: Zygote, tiny_teacher: Path, tmp_path: Path
) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(6)))
    argv = [
        "precompute",
        "pipelines/tiny.toml",
        "--teacher",
        str(tiny_teacher),
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "cache"),
        "--set",
        "previews=0",
        "--set",
        "sampler.batch_size=1",
        "--set",
        "sampler.height=32",
        "--set",
        "sampler.width=32",
        "--set",
        "sampler.num_inference_steps=2",
    ]
    code, err = torchrun(
        zygote, [argv, argv], tmp_path / "err", WANDISTILL_FAULT="precompute:record:1:1:hang"
    )
    assert code != 0
    line = re.search(r"error: rank 0 of 2: rank 1 has not finished \(precompute-done\).*", err)
    assert line, err[-3000:]
    assert not rank_traceback(err)
    hang = float(re.search(r"hangs at precompute record 1 \(t=(\d+\.\d+)\)", err).group(1))
    end = float(re.search(r"rank 0 exit \S+ at (\d+\.\d+)", err).group(1))
    print(
        f"rank 1 hangs after its first record: rank 0 exited {end - hang:.1f} s after the "
        f"hang began, having finished its own work (timeout {TIMEOUT_S} s)"
    )


def test_a_nan_loss_on_one_rank_stops_every_rank_at_that_step(
    zygote: Zygote, cache: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    argv = train_argv(cache, out, "steps=6", "checkpoint_every=2")
    code, err = torchrun(
        zygote, [argv, argv], tmp_path / "err", WANDISTILL_FAULT="train:loss:3:1:nan"
    )
    assert code != 0
    for rank in (0, 1):
        assert re.search(rf"rank {rank} exit 1 at", err), err[-3000:]
    lines = re.findall(r"error: non-finite loss at step 3 \(.*rank 1: [^;]*loss=nan.*", err)
    assert len(lines) == 2 and "checkpoint-2" in lines[0], err[-3000:]
    assert not rank_traceback(err)
    assert sorted(p.name for p in (out / "checkpoints").glob("checkpoint-*")) == ["checkpoint-2"]
    assert not (out / "student").exists()
