"""Output folders through the real commands: whose folder it is, one writer, failures that leave
nothing in the way. The refusals run in-process through `wandistill.cli.main`; the concurrent and
killed writers are real processes (with unpickling made to raise in them, see tests/nopickle),
forked from the session's no-pickle zygote (tests/zygote.py, conftest.zygote_nopickle)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from wandistill.cache import open_cache
from wandistill.cli import main
from wandistill.io.outputs import LOCK, MARKER, claim

from clirun import cli_env, run_cli
from zygote import HANG_GUARD_S, Zygote, fork_pid, kill_and_wait, logs

REPO = Path(__file__).parents[2]
N_PROMPTS = 6
FAST = ["--set", "sampler.height=32", "--set", "sampler.width=32", "--set",
        "sampler.num_inference_steps=2", "--set", "sampler.max_sequence_length=16", "--set",
        "sampler.batch_size=2", "--set", "cache.shard_records=2"]  # fmt: skip
STUDENT = ["--set", "student.num_layers=1", "--set", "student.ffn_dim=32", "--set",
           "batch_size=2", "--set", 'device="cpu"', "--set", "tensorboard=false"]  # fmt: skip


def _cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """`run_cli` with stdout's whitespace folded (wrapped summaries read as one line)."""
    code, out, err = run_cli(capsys, *args)
    return code, " ".join(out.split()), err


def _pre(teacher: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return ["precompute", "--teacher", str(teacher), "--prompts", str(prompts), "--out", str(out),
            *FAST, *extra]  # fmt: skip


@pytest.fixture(scope="module")
def world(tiny_teacher: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny teacher, a cache and a run made by the commands, a user's folder, a link into
    the teacher."""
    root = tmp_path_factory.mktemp("own")
    teacher = tiny_teacher
    prompts = root / "p.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(N_PROMPTS)))
    for args in (
        _pre(teacher, prompts, root / "cache"),
        ["train", "--cache", str(root / "cache"), "--out", str(root / "run"), "--steps", "2",
         *STUDENT],
    ):  # fmt: skip
        try:
            main(args)
        except SystemExit as e:
            assert not e.code, args
    (root / "mine").mkdir()
    (root / "mine" / "notes.txt").write_text("my notes")
    (root / "links").mkdir()
    (root / "links" / "teacher").symlink_to(teacher)
    names = ("cache", "run", "mine", "links")
    return {"root": root, "prompts": prompts, "teacher": teacher, **{n: root / n for n in names}}


def snapshot(*dirs: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for d in dirs:
        for p in sorted(d.rglob("*")):
            if p.is_file() and not p.is_symlink():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# --------------------------------------------------------------------------- whose folder


@dataclass(frozen=True)
class Case:
    id: str
    args: list[str]
    message: str
    target: str


PRE = ["precompute", "--teacher", "{teacher}", "--prompts", "{prompts}", *FAST, "--out"]
TRAIN = ["train", "--cache", "{cache}", "--steps", "1", *STUDENT, "--out"]
EVAL = ["eval", "--cache", "{cache}", "--student", "{run}/student", "--split", "all", "--out"]
SAMPLE = ["sample", "--teacher", "{teacher}", "--prompts", "{prompts}", "--steps", "1", "--out"]
CASES = [
    Case("pre-into-teacher", [*PRE, "{teacher}"], "is --teacher", "{teacher}"),
    Case("pre-inside-teacher", [*PRE, "{teacher}/cache"], "is inside --teacher", "{teacher}/cache"),
    Case("pre-into-a-component", [*PRE, "{teacher}/transformer"], "is inside --teacher",
         "{teacher}/transformer"),
    Case("pre-link-into-teacher", [*PRE, "{links}/teacher/sub"], "is inside --teacher",
         "{teacher}/sub"),
    Case("pre-into-a-run", [*PRE, "{run}"], "is a wandistill run folder, not a cache folder",
         "{run}"),
    Case("pre-into-a-student", [*PRE, "{run}/student"], "is a model folder (it holds config.json",
         "{run}/student"),
    Case("pre-into-a-user-folder", [*PRE, "{mine}"],
         "is not empty and was not written by wandistill (holds notes.txt)", "{mine}"),
    Case("train-into-the-cache", [*TRAIN, "{cache}"], "is --cache", "{cache}"),
    Case("train-inside-the-cache", [*TRAIN, "{cache}/run"], "is inside --cache", "{cache}/run"),
    Case("train-around-the-cache", [*TRAIN, "{root}"], "contains --cache", "{root}"),
    Case("train-over-a-model-config", [*TRAIN, "{teacher}/transformer"],
         "is inside the model folder", "{teacher}/transformer"),
    Case("train-into-a-linked-teacher", [*TRAIN, "{links}/teacher"], "is a model folder",
         "{teacher}"),
    Case("train-into-a-user-folder", [*TRAIN, "{mine}"], "was not written by wandistill",
         "{mine}"),
    Case("eval-into-the-student", [*EVAL, "{run}/student"], "is --student", "{run}/student"),
    Case("eval-inside-the-cache", [*EVAL, "{cache}/eval"], "is inside --cache", "{cache}/eval"),
    Case("eval-into-a-run", [*EVAL, "{run}"], "contains --student", "{run}"),
    Case("sample-into-the-teacher-vae", [*SAMPLE, "{teacher}/vae"], "is inside --teacher",
         "{teacher}/vae"),
    Case("sample-into-a-cache", [*SAMPLE, "{cache}"], "is a wandistill cache folder", "{cache}"),
    Case("sample-into-a-student", [*SAMPLE, "{run}/student"], "is a model folder",
         "{run}/student"),
]  # fmt: skip


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_outputs_that_are_not_the_commands_own_are_refused_in_one_line(
    case: Case, world: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    args = [a.format(**world) for a in case.args]
    target = Path(case.target.format(**world))
    existed = target.exists()
    before = snapshot(world["teacher"], world["cache"], world["run"], world["mine"])
    code, _, err = _cli(capsys, *args)
    text = " ".join(err.split())
    assert code == 2 and "Traceback" not in err, err
    assert case.message in text and args[-1] in text, err
    assert len([x for x in err.splitlines() if x.startswith("error:")]) == 1 and "fix:" in err
    assert snapshot(world["teacher"], world["cache"], world["run"], world["mine"]) == before
    assert target.exists() == existed


# --------------------------------------------------------------------------- one writer


def _env() -> dict[str, str]:
    # The spawned writer computes with this process's thread count: the numerics it records must
    # match the in-process runs that resume or contend for the same cache.
    threads = str(torch.get_num_threads())
    env = cli_env(threads=threads, COLUMNS="200")
    env["PYTHONPATH"] = f"{REPO / 'tests' / 'nopickle'}{os.pathsep}{REPO}"
    env["WANDISTILL_TEST_NO_PICKLE"] = "1"  # these processes also prove no pickle is loaded
    return env


def _spawn(zygote: Zygote, args: list[str], hook: str, log: Path) -> int:
    """`wandistill ARGS` forked from the no-pickle zygote with the test hook `hook`; its pid."""
    env = {k: v for k, v in _env().items() if k not in ("PYTHONPATH", "WANDISTILL_TEST_NO_PICKLE")}
    (pid,) = zygote.start([str(a) for a in args], log, split=True, **env, WANDISTILL_FAULT=hook)
    return pid


def _wait_stopped(pid: int) -> None:
    """Block until the process SIGSTOPs itself (its hook) or dies (a hang guard, no timing)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while (state := _state(pid)) not in ("T", "Z", None) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state == "T", f"child ended first (state {state})"


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0]
    except (FileNotFoundError, ProcessLookupError, IndexError):  # gone (even mid-read)
        return None


def _keys(cache: Path) -> list[str]:
    with open_cache(cache) as store:
        assert store.verify() == []
        return [k for e in store.entries for k in e.keys]


@pytest.mark.slow  # a real process holds the cache
def test_a_second_precompute_is_refused_at_once_and_the_first_completes(
    zygote_nopickle: Zygote,
    world: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cache = tmp_path / "c"
    args = _pre(world["teacher"], world["prompts"], cache)
    log = tmp_path / "first.log"
    first = _spawn(zygote_nopickle, args, "precompute:record:3:0:stop", log)  # frozen, holding
    try:
        _wait_stopped(first)
        code, _, err = _cli(capsys, *args)
        text = " ".join(err.split())
        assert code == 2 and "Traceback" not in err, err
        assert f"--out '{cache}' is in use by another wandistill process" in text
        assert f"pid {first}" in text and "started " in text and "host " in text
    finally:
        os.kill(first, signal.SIGCONT)
        (returncode,) = zygote_nopickle.wait([first])
    assert returncode == 0, logs(log)
    assert sorted(_keys(cache)) == sorted(set(_keys(cache))) and len(_keys(cache)) == N_PROMPTS
    code, out, err = _cli(capsys, *args)  # the first is done: the folder is free again
    assert code == 0 and ": 0 records written" in out, err


@pytest.mark.slow  # a real process is killed
def test_after_a_kill_9_mid_shard_the_next_run_owns_the_cache_and_clears_the_temps(
    zygote_nopickle: Zygote,
    world: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cache = tmp_path / "c"
    args = _pre(world["teacher"], world["prompts"], cache)
    killed = _spawn(zygote_nopickle, args, "precompute:record:3:0:kill", tmp_path / "k.log")
    assert zygote_nopickle.wait([killed]) == [-signal.SIGKILL], logs(tmp_path / "k.log")
    assert list(cache.rglob(".*.tmp")) and (cache / LOCK).exists()  # the dead writer's leftovers
    code, out, err = _cli(capsys, *args)
    assert code == 0 and "Traceback" not in err, err
    assert not list(cache.rglob("*.tmp")) and not list(cache.rglob("*.partial"))
    assert len(_keys(cache)) == len(set(_keys(cache))) == N_PROMPTS


_HOLD = """
import sys
from wandistill.io.outputs import claim
folder = claim(sys.argv[1], "run")
print("holding", flush=True)
sys.stdin.readline()
"""


def test_a_second_train_into_a_live_run_is_refused_and_proceeds_once_it_is_gone(
    zygote_nopickle: Zygote,
    world: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = tmp_path / "run"
    shutil.copytree(world["run"], run)
    pidfile = tmp_path / "holder.pid"
    holder = subprocess.Popen(
        [zygote_nopickle.python, "-c", _HOLD, str(run)],
        env=zygote_nopickle.env({**_env(), "ZYGOTE_PID_FILE": str(pidfile)}),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    args = ["train", "--cache", world["cache"], "--out", run, "--resume", "--steps", "3", *STUDENT]
    holds = fork_pid(pidfile, holder)  # the process that claims the run: the shim's fork
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        before = snapshot(run)
        code, _, err = _cli(capsys, *args)
        assert code == 2 and f"pid {holds}" in " ".join(err.split()), err
        assert snapshot(run) == before
    finally:
        if holds is not None:
            kill_and_wait(holds)  # its lock is free before the retry below, not when the shim ends
        holder.kill()
        holder.wait(timeout=60)
    code, out, err = _cli(capsys, *args)
    assert code == 0 and "trained 3 steps" in out, err


# --------------------------------------------------------------------------- failures, old folders


def test_a_precompute_that_failed_before_its_first_record_leaves_a_folder_the_fix_reuses(
    world: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first run's teacher was the wrong one and failed once the cache was open; the
    corrected command (another teacher, another guidance) must not meet a stale header."""
    from wandistill.teacher.tiny import make_tiny_teacher

    other = make_tiny_teacher(tmp_path / "other", seed=1)
    cache = tmp_path / "c"
    monkeypatch.setenv("WANDISTILL_FAULT", "precompute:record:0:0:raise")
    code, _, err = _cli(capsys, *_pre(world["teacher"], world["prompts"], cache))
    assert code == 1 and "injected failure" in err
    assert (cache / "manifest.json").is_file()  # the writer had opened the cache
    monkeypatch.delenv("WANDISTILL_FAULT")
    fixed = _pre(other, world["prompts"], cache, "--set", "sampler.guidance_scale=3.0")
    code, out, err = _cli(capsys, *fixed)
    assert code == 0 and f"{N_PROMPTS} records written" in out, err
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["settings"]["guidance_scale"] == 3.0 and manifest["complete"]
    assert len(_keys(cache)) == N_PROMPTS


def test_caches_and_runs_of_earlier_versions_keep_working(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache, run = tmp_path / "cache", tmp_path / "run"
    shutil.copytree(world["cache"], cache)
    shutil.copytree(world["run"], run)
    for folder in (cache, run):  # as earlier versions left them: no marker, no lock
        (folder / MARKER).unlink()
        (folder / LOCK).unlink()
    (run / "run.json").rename(run / "config.json")  # ... the settings under the older name
    (run / "loss.png").unlink()
    code, out, err = _cli(capsys, *_pre(world["teacher"], world["prompts"], cache))
    assert code == 0 and ": 0 records written" in out, err
    args = ["train", "--cache", cache, "--out", run, "--resume", "--steps", "3", *STUDENT]
    code, out, err = _cli(capsys, *args)
    assert code == 0 and "trained 3 steps" in out, err
    for folder, purpose in ((cache, "cache"), (run, "run")):
        assert json.loads((folder / MARKER).read_text())["purpose"] == purpose
    assert (run / "run.json").is_file() and not (run / "config.json").exists()


@pytest.mark.slow
@pytest.mark.dist
def test_every_rank_of_a_torchrun_job_refused_a_live_cache_exits(
    zygote_nopickle: Zygote, world: dict[str, Path], tmp_path: Path
) -> None:
    """torchrun's agent is a fresh interpreter (it unpickles its rendezvous state); its ranks
    are forks of the no-pickle zygote (`PYTHON_EXEC`)."""
    cache = tmp_path / "c"
    args = _pre(world["teacher"], world["prompts"], cache)
    with claim(cache, "cache"):  # a live writer: this process
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
             "-m", "wandistill", *args],
            env=zygote_nopickle.env(_env()), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    lines = [x for x in proc.stderr.splitlines() if "is in use by another wandistill" in x]
    assert proc.returncode != 0 and len(lines) == 2, proc.stderr[-3000:]
    assert all(f"pid {os.getpid()}" in x for x in lines)
    assert f'File "{REPO / "wandistill"}' not in proc.stderr  # no rank traceback (torchrun's
    # launcher prints its own ChildFailedError traceback whenever a worker exits non-zero)
    assert not (cache / "manifest.json").exists()
