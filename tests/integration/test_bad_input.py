"""The bad-input matrix: every command, every way its input can be wrong.

Each case drives the real CLI (in-process through `wandistill.cli.main`, a representative few as
`python -m wandistill` subprocesses) and checks the contract of docs/troubleshooting.md:

- exit code 2 for a usage error (a path, a flag, a recipe key or value), 1 for a runtime failure;
- one `error:` line naming the input, a `fix:` line where there is one, no traceback;
- nothing previously written is lost or left half-written: the watched directories (the cache,
  an earlier run, the teacher) are byte-identical afterwards, no temp file is visible to readers,
  and an output directory the command would have created does not appear.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from wandistill.cli import main

from cachefixtures import SETTINGS, write_cache
from clirun import cli_env
from zygote import Zygote

REPO = Path(__file__).parents[2]
CPU_ONLY = not torch.cuda.is_available()


# ----------------------------------------------------------------------------- the world


@pytest.fixture(scope="module")
def world(tiny_teacher: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Everything the cases point at, built once: a tiny teacher and broken copies of it,
    prompt files, recipes, device maps, caches and a trained run."""
    from wandistill.config import load_recipe
    from wandistill.train import run

    root = tmp_path_factory.mktemp("world")
    teacher = tiny_teacher  # read only: the broken variants below are copies
    for name, edit in (
        ("t_notwan", lambda t: _edit_json(t / "model_index.json", _class_name="FluxPipeline")),
        ("t_nocfg", lambda t: (t / "transformer" / "config.json").unlink()),
        ("t_badjson", lambda t: (t / "model_index.json").write_text("{oops")),
    ):
        shutil.copytree(teacher, root / name)
        edit(root / name)
    files = {  # world key -> (file name, text)
        "prompts": ("p.txt", "a cat\na dog\n"),
        "empty": ("empty.txt", "\n  \n\n"),
        "csv": ("p.csv", "a,b\n"),
        "broken": ("broken.toml", "[precompute\nx = 1\n"),
        "badtype": ("badtype.toml", '[precompute.sampler]\nheight = "64"\n'),
        "unknown": ("unknown.toml", "[precompute.sampler]\nheigth = 64\n"),
        "negative": ("negative.toml", "[train]\nbatch_size = -4\n"),
        "badmap": ("badmap.json", "not json"),
        "partialmap": (
            "partialmap.json",
            json.dumps({"text_encoder": "cpu", "transformer": {"blocks.0": "cpu"}, "vae": "cpu"}),
        ),
        "wide": ("wide.json", json.dumps({"text_dim": 64})),
    }
    for name, text in files.values():
        (root / name).write_text(text)
    (root / "pdir.txt").mkdir()  # a directory named like a prompt file
    write_cache(root / "cache", range(6), shard_records=3)  # a cache of another (fake) teacher
    settings = {
        **SETTINGS,
        "holdout_fraction": 0.3,
        "scheduler": "UniPCMultistepScheduler",
        "scheduler_config": {},
    }
    write_cache(root / "hcache", range(12), shard_records=4, settings=settings)
    shutil.copytree(root / "hcache", root / "widecache")
    _edit_json(
        root / "widecache" / "manifest.json", dims={**_dims(root / "hcache"), "text_dim": 64}
    )
    shutil.copytree(root / "cache", root / "othercache")
    _edit_json(
        root / "othercache" / "manifest.json",
        teacher={**json.loads((root / "cache" / "manifest.json").read_text())["teacher"],
                 "fingerprint": "0" * 64},
    )  # fmt: skip
    sets = [
        f'cache="{root / "cache"}"',
        f'out="{root / "run"}"',
        "steps=2",
        "batch_size=2",
        'device="cpu"',
        "tensorboard=false",
        "checkpoint_every=1",
        "student.num_layers=1",
        "student.ffn_dim=32",
    ]
    run(load_recipe(None, sets, stage="train").train)
    (root / "emptydir").mkdir()
    out = {key: str(root / name) for key, (name, _) in files.items()}
    out["teacher"] = str(teacher)
    for name in ("t_notwan", "t_nocfg", "t_badjson", "cache", "hcache", "widecache",
                 "othercache", "run", "emptydir"):  # fmt: skip
        out[name] = str(root / name)
    out["pdir"] = str(root / "pdir.txt")
    out["student"] = str(root / "run" / "student")
    out["root"] = str(root)
    return out


def _dims(cache: Path) -> dict[str, Any]:
    return json.loads((cache / "manifest.json").read_text())["dims"]


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    if "header_sha256" in data:  # a manifest: as if written so (the seal refuses a hand edit)
        from wandistill.cache.manifest import header_digests

        data["header_sha256"] = header_digests(data)
    path.write_text(json.dumps(data))


def snapshot(*dirs: str | Path) -> dict[str, str]:
    """Every file (hidden ones included) under dirs -> sha256 of its bytes."""
    out: dict[str, str] = {}
    for d in dirs:
        for p in sorted(Path(d).rglob("*")):
            if p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
            elif p.is_dir():
                out[str(p) + "/"] = "dir"
    return out


def visible_temps(*dirs: str | Path) -> list[str]:
    """Temp files a reader could mistake for data: anything `.tmp` not hidden by a dot."""
    return [
        str(p)
        for d in dirs
        if Path(d).exists()
        for p in Path(d).rglob("*.tmp")
        if not any(part.startswith(".") for part in p.relative_to(d).parts)
    ]


def _cli(capsys: pytest.CaptureFixture[str], args: list[str]) -> tuple[int, str, str]:
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(("error:", "Error:"))]


# ----------------------------------------------------------------------------- the matrix


@dataclass(frozen=True)
class Case:
    id: str
    args: list[str]
    code: int
    message: str
    """A substring of the error (whitespace-normalised), with {placeholders} from the world."""
    watch: tuple[str, ...] = ()
    """World directories that must be byte-identical afterwards."""
    absent: tuple[str, ...] = ("out",)
    """Paths under {tmp} the failed command must not have created."""
    fix: bool = True
    """Whether a `fix:` line is expected."""
    skip: str = ""
    marks: tuple[Any, ...] = field(default=())


PRE = ["precompute", "--teacher", "{teacher}", "--prompts", "{prompts}", "--out", "{tmp}/out"]
TRAIN = ["train", "--cache", "{cache}", "--out", "{tmp}/out"]
EVAL = ["eval", "--cache", "{hcache}", "--student", "{student}", "--out", "{tmp}/out"]
SAMPLE = ["sample", "--teacher", "{teacher}", "--prompts", "{prompts}", "--out", "{tmp}/out"]
NO_GPU = "" if CPU_ONLY else "needs a machine without CUDA"


def _with(base: list[str], flag: str, value: str) -> list[str]:
    args = list(base)
    args[args.index(flag) + 1] = value
    return args


CASES = [
    # precompute: paths
    Case("pre-teacher-missing", _with(PRE, "--teacher", "{tmp}/nope"), 2,
         "teacher folder '{tmp}/nope' does not exist"),
    Case("pre-teacher-not-wan", _with(PRE, "--teacher", "{t_notwan}"), 2,
         "is a FluxPipeline, not a WanPipeline folder", watch=("t_notwan",)),
    Case("pre-teacher-incomplete", _with(PRE, "--teacher", "{t_nocfg}"), 2,
         "teacher folder is missing '{t_nocfg}/transformer/config.json'"),
    Case("pre-teacher-bad-json", _with(PRE, "--teacher", "{t_badjson}"), 2,
         "teacher file '{t_badjson}/model_index.json': not valid JSON", fix=False),
    Case("pre-prompts-missing", _with(PRE, "--prompts", "{tmp}/nope.txt"), 2,
         "prompt file '{tmp}/nope.txt' does not exist"),
    Case("pre-prompts-is-dir", _with(PRE, "--prompts", "{pdir}"), 2,
         "prompt file '{pdir}' is a directory"),
    Case("pre-prompts-empty", _with(PRE, "--prompts", "{empty}"), 2,
         "prompt file '{empty}' has no usable prompt (3 lines: 3 empty"),
    Case("pre-prompts-suffix", _with(PRE, "--prompts", "{csv}"), 2,
         "prompt file '{csv}' must end in .txt or .jsonl"),
    Case("pre-out-under-a-file", _with(PRE, "--out", "{prompts}/sub"), 2,
         "cannot create cache directory '{prompts}/sub': Not a directory"),
    # precompute: recipes and flags
    Case("pre-recipe-missing", [*PRE, "{tmp}/nope.toml"], 2,
         "recipe '{tmp}/nope.toml' does not exist"),
    Case("pre-recipe-not-toml", [*PRE, "{broken}"], 2,
         "recipe '{broken}' is not valid TOML", fix=False),
    Case("pre-toml-wrong-type", [*PRE, "{badtype}"], 2,
         "precompute.sampler.height='64' must be int, got str", fix=False),
    Case("pre-toml-unknown-key", [*PRE, "{unknown}"], 2,
         "unknown key 'precompute.sampler.heigth': did you mean precompute.sampler.height?",
         fix=False),
    Case("pre-height-negative", [*PRE, "--set", "sampler.height=-16"], 2,
         "sampler.height=-16 must be >= 16 (allowed: [16, 8192])", fix=False),
    Case("pre-height-not-vae-multiple", [*PRE, "--set", "sampler.height=40"], 2,
         "sampler.height=40 must be a positive multiple of 16", fix=False),
    Case("pre-frames-not-4k+1", [*PRE, "--set", "sampler.num_frames=80"], 2,
         "sampler.num_frames=80 must be 4k+1", fix=False),
    Case("pre-steps-zero", [*PRE, "--set", "sampler.num_inference_steps=0"], 2,
         "sampler.num_inference_steps=0 must be positive", fix=False),
    Case("pre-shard-records-zero", [*PRE, "--set", "cache.shard_records=0"], 2,
         "cache.shard_records=0 must be positive", fix=False),
    Case("pre-record-steps-out-of-range", [*PRE, "--set", "sampler.record_steps=[0, 99]"], 2,
         "sampler.record_steps=[0, 99] must lie in [0, 50)", fix=False),
    Case("pre-set-without-equals", [*PRE, "--set", "sampler.height"], 2,
         "--set 'sampler.height' must look like section.key=value", fix=False),
    Case("pre-dtype", [*PRE, "--dtype", "fp8"], 2, "--dtype 'fp8' must be one of fp32, fp16, bf16"),
    Case("pre-backend", [*PRE, "--backend", "lmdb"], 2,
         "--backend 'lmdb' must be one of webdataset, zarr"),
    Case("pre-set-dtype", [*PRE, "--set", 'teacher.dtype="fp8"'], 2,
         "teacher.dtype='fp8' must be one of", fix=False),
    Case("pre-cuda-on-cpu", [*PRE, "--placement", "cuda"], 2,
         "placement 'cuda' needs CUDA GPUs but none is visible", skip=NO_GPU),
    Case("pre-balanced-on-cpu", [*PRE, "--placement", "balanced"], 2,
         "placement 'balanced' needs CUDA GPUs but none is visible", skip=NO_GPU),
    Case("pre-device-map-missing", [*PRE, "--placement", "{tmp}/nomap.json"], 2,
         "device map '{tmp}/nomap.json' does not exist"),
    Case("pre-device-map-not-json", [*PRE, "--placement", "{badmap}"], 2,
         "device map '{badmap}' is not valid JSON", fix=False),
    Case("pre-cache-of-another-teacher", _with(PRE, "--out", "{cache}"), 2,
         "cache '{cache}' was written with a different teacher", watch=("cache",)),
    # train
    Case("train-cache-missing", _with(TRAIN, "--cache", "{tmp}/nope"), 2,
         "cache path '{tmp}/nope' does not exist"),
    Case("train-cache-not-a-cache", _with(TRAIN, "--cache", "{emptydir}"), 2,
         "'{emptydir}' is not a wandistill cache (no manifest.json)"),
    Case("train-no-out", TRAIN[:3], 2, "train needs an output directory"),
    Case("train-out-is-a-file", _with(TRAIN, "--out", "{prompts}"), 2,
         "--out '{prompts}' cannot be a directory: '{prompts}' is a file"),
    Case("train-steps-zero", [*TRAIN, "--steps", "0"], 2, "train.steps=0 must be positive",
         fix=False),
    Case("train-steps-not-int", [*TRAIN, "--steps", "abc"], 2, "Invalid value for '--steps'",
         fix=False),
    Case("train-negative-batch-in-toml", [*TRAIN, "{negative}"], 2,
         "train.batch_size=-4 must be positive", fix=False),
    Case("train-lr-negative", [*TRAIN, "--set", "optim.lr=-1"], 2, "optim.lr=-1.0 must be positive",
         fix=False),
    Case("train-unknown-key", [*TRAIN, "--set", "optim.learning_rate=1"], 2,
         "unknown key 'train.optim.learning_rate'", fix=False),
    Case("train-odd-head-dim", [*TRAIN, "--set", "student.attention_head_dim=7"], 2,
         "student.attention_head_dim=7 must be even", fix=False),
    Case("train-student-dims-vs-cache", [*TRAIN, "--set", 'student.config_file="{wide}"'], 2,
         "student text_dim=64 but the cache '{cache}' has prompt embeddings with text_dim=32",
         watch=("cache",), fix=False),
    Case("train-student-config-missing", [*TRAIN, "--set", 'student.config_file="{tmp}/no.json"'],
         2, "student.config_file '{tmp}/no.json' does not exist"),
    Case("train-feature-not-recorded",
         [*TRAIN, "--set", "loss.feature=1.0",
          "--set", 'loss.feature_map={{"blocks.1"="blocks.0"}}'],
         2, "loss.feature_map names teacher feature 'blocks.1', but the cache recorded no features",
         fix=False),
    Case("train-cuda-on-cpu", [*TRAIN, "--set", 'device="cuda"'], 2,
         "CUDA was asked for but this machine has no usable GPU", skip=NO_GPU),
    Case("train-batch-larger-than-cache", [*TRAIN, "--set", "batch_size=64"], 1,
         "cache '{cache}' has 18 training samples, fewer than one global batch", watch=("cache",),
         absent=()),
    Case("train-earlier-run-without-resume", _with(TRAIN, "--out", "{run}"), 2,
         "--out '{run}' holds checkpoints of an earlier run; pass --resume", watch=("run", "cache"),
         fix=False),
    Case("train-resume-cache-of-another-teacher",
         [*_with(_with(TRAIN, "--out", "{run}"), "--cache", "{othercache}"), "--resume",
          "--set", "student.num_layers=1", "--set", "student.ffn_dim=32",
          "--set", "batch_size=2"], 2,
         "was trained on a cache of another teacher", watch=("run", "othercache")),
    # eval
    Case("eval-student-missing", _with(EVAL, "--student", "{tmp}/nope"), 2,
         "student '{tmp}/nope' does not exist"),
    Case("eval-student-not-a-model", _with(EVAL, "--student", "{emptydir}"), 2,
         "--student '{emptydir}' is not a student folder (config.json + safetensors)"),
    Case("eval-cache-missing", _with(EVAL, "--cache", "{tmp}/nope"), 2,
         "cache path '{tmp}/nope' does not exist"),
    Case("eval-student-dims-vs-cache", _with(EVAL, "--cache", "{widecache}"), 2,
         "(text_dim 32, in_channels 16) does not fit cache '{widecache}' (text_dim 64",
         watch=("widecache", "run")),
    Case("eval-no-holdout", _with(EVAL, "--cache", "{cache}"), 2,
         "cache '{cache}' has no held-out records (holdout_fraction = 0)"),
    Case("eval-split", [*EVAL, "--split", "bogus"], 2, "--split 'bogus' must be holdout or all",
         fix=False),
    Case("eval-steps-zero", [*EVAL, "--steps", "0"], 2, "--steps 0 must be positive", fix=False),
    Case("eval-steps-negative", [*EVAL, "--steps", "-3"], 2, "--steps -3 must be positive",
         fix=False),
    Case("eval-max-records-zero", [*EVAL, "--max-records", "0"], 2,
         "--max-records 0 must be positive", fix=False),
    Case("eval-teacher-not-a-teacher", [*EVAL, "--teacher", "{cache}"], 2,
         "teacher '{cache}' is not a diffusers folder (no model_index.json)"),
    Case("eval-out-is-a-file", _with(EVAL, "--out", "{prompts}"), 2,
         "--out '{prompts}' cannot be a directory"),
    # sample
    Case("sample-teacher-missing", _with(SAMPLE, "--teacher", "{tmp}/nope"), 2,
         "teacher folder '{tmp}/nope' does not exist"),
    Case("sample-prompts-empty", _with(SAMPLE, "--prompts", "{empty}"), 2,
         "prompt file '{empty}' has no usable prompt"),
    Case("sample-height", [*SAMPLE, "--height", "33"], 2, "--height=33 must be a positive multiple",
         fix=False),
    Case("sample-steps-zero", [*SAMPLE, "--steps", "0"], 2, "--steps=0 must be positive",
         fix=False),
    Case("sample-limit-zero", [*SAMPLE, "--limit", "0"], 2, "--limit 0 must be positive",
         fix=False),
    Case("sample-max-sequence-length-zero", [*SAMPLE, "--max-sequence-length", "0"], 2,
         "--max-sequence-length=0 must be positive", fix=False),
    Case("sample-student-missing", [*SAMPLE, "--student", "{tmp}/nope"], 2,
         "student '{tmp}/nope' does not exist"),
    Case("sample-out-is-a-file", _with(SAMPLE, "--out", "{prompts}"), 2,
         "--out '{prompts}' cannot be a directory"),
    # plan
    Case("plan-teacher-and-config", ["plan", "--teacher", "{teacher}", "--config", "wan2.1-14b"],
         2, "--teacher and --config both given"),
    Case("plan-unknown-config", ["plan", "--config", "wan9"], 2,
         "--config 'wan9' is not a known teacher config"),
    Case("plan-no-teacher", ["plan"], 2, "no teacher to plan"),
    Case("plan-teacher-missing", ["plan", "--teacher", "{tmp}/nope"], 2,
         "teacher folder '{tmp}/nope' does not exist"),
    Case("plan-bad-placement", ["plan", "--teacher", "{teacher}", "--placement", "gpu7"], 2,
         "teacher.placement='gpu7' must be one of", fix=False),
    # cache, teacher, demo, click
    Case("cache-info-missing", ["cache", "info", "{tmp}/nope"], 2,
         "cache path '{tmp}/nope' does not"),
    Case("cache-verify-not-a-cache", ["cache", "verify", "{emptydir}"], 2,
         "'{emptydir}' is not a wandistill cache"),
    Case("make-tiny-exists", ["teacher", "make-tiny", "{teacher}"], 2, "already holds a teacher",
         watch=("teacher",)),
    Case("make-tiny-under-a-file", ["teacher", "make-tiny", "{prompts}/t"], 2,
         "cannot create teacher folder '{prompts}/t': '{prompts}' is a file"),
    Case("make-trained-exists", ["teacher", "make-trained", "{teacher}"], 2,
         "already holds a teacher", watch=("teacher",)),
    Case("make-trained-not-a-teacher", ["teacher", "make-trained", "{cache}"], 2,
         "{cache} exists and is not a diffusers teacher folder", watch=("cache",)),
    Case("make-trained-on-a-file", ["teacher", "make-trained", "{prompts}"], 2,
         "cannot create teacher folder '{prompts}': '{prompts}' is a file"),
    Case("make-trained-under-a-file", ["teacher", "make-trained", "{prompts}/t"], 2,
         "cannot create teacher folder '{prompts}/t': '{prompts}' is a file"),
    Case("make-trained-zero-steps", ["teacher", "make-trained", "{tmp}/t", "--steps", "0"], 2,
         "--steps 0 must be positive", absent=("t",), fix=False),
    Case("demo-recipe-missing", ["demo", "--recipe", "{tmp}/nope.toml", "--root", "{tmp}/out"], 2,
         "recipe '{tmp}/nope.toml' does not exist"),
    Case("unknown-command", ["cache", "infoo", "x"], 2, "No such command", fix=False),
    Case("unknown-flag", ["train", "--stepz", "3"], 2, "No such option", fix=False),
]  # fmt: skip


def _fill(text: str, world: dict[str, str], tmp: Path) -> str:
    return text.format(**world, tmp=tmp)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_bad_input(
    case: Case, world: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if case.skip:
        pytest.skip(case.skip)
    args = [_fill(a, world, tmp_path) for a in case.args]
    watched = [world[w] for w in case.watch]
    before = snapshot(*watched)
    code, _, err = _cli(capsys, args)
    text = " ".join(err.split())
    assert code == case.code, err
    assert "Traceback" not in err
    assert _fill(case.message, world, tmp_path) in text, err
    assert len(_error_lines(err)) == 1, err
    assert err.count("fix:") == 1, err  # every error, click's usage errors included
    assert snapshot(*watched) == before  # nothing written earlier changed
    assert not visible_temps(*watched)
    for name in case.absent:
        assert not (tmp_path / name).exists(), f"{name} was created by a failed command"


def test_the_matrix_covers_every_command_with_at_least_30_cases() -> None:
    commands = {c.args[0] if c.args[0] not in ("cache", "teacher") else " ".join(c.args[:2])
                for c in CASES}  # fmt: skip
    assert {
        "precompute",
        "train",
        "eval",
        "sample",
        "plan",
        "demo",
        "teacher make-tiny",
        "teacher make-trained",
    } <= commands
    assert {"cache info", "cache verify"} <= commands
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)


def test_a_device_map_missing_modules_fails_clearly_and_leaves_a_valid_cache(
    world: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The map is only checked when the transformer loads (after the text encoder ran), so the
    cache directory exists by then: it must be a valid, empty cache that a fixed run reuses."""
    from wandistill.cache.manifest import read_manifest

    args = _with(PRE, "--out", "{tmp}/c") + ["--placement", "{partialmap}"]
    code, _, err = _cli(capsys, [_fill(a, world, tmp_path) for a in args])
    assert code == 2 and "Traceback" not in err and len(_error_lines(err)) == 1
    assert "the device map for transformer does not cover every weight" in " ".join(err.split())
    m = read_manifest(tmp_path / "c")
    assert m.num_records == 0 and not m.complete
    assert not visible_temps(tmp_path / "c")
    assert not list((tmp_path / "c" / "shards").iterdir())


# ----------------------------------------------------------------------------- disk full


def _enospc(*_: Any, **__: Any) -> Any:
    raise OSError(errno.ENOSPC, "No space left on device")


class _FullFile(io.BytesIO):
    """A file on a full disk: write() fails as the OS's does, naming no file."""

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def _full_disk_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
    if "w" not in mode:
        return open(path, mode, *args, **kwargs)
    Path(path).touch()
    return _FullFile()


def _pre_args(world: dict[str, str], prompts: Path, cache: Path) -> list[str]:
    return [
        "precompute", "--teacher", world["teacher"], "--prompts", str(prompts), "--out",
        str(cache), "--set", "sampler.height=32", "--set", "sampler.width=32", "--set",
        "sampler.num_inference_steps=2", "--set", "sampler.max_sequence_length=16", "--set",
        "cache.shard_records=2", "--set", "sampler.batch_size=2",
    ]  # fmt: skip


@pytest.mark.parametrize("where", ["tar-write", "journal-write"])
def test_disk_full_in_precompute_keeps_every_committed_shard(
    world: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    import wandistill.cache.journal as jn
    import wandistill.cache.wds.writer as wds
    from wandistill.cache import open_cache

    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(4)))
    cache = tmp_path / "c"
    first = tmp_path / "first.txt"
    first.write_text("prompt 0\nprompt 1\n")
    assert _cli(capsys, _pre_args(world, first, cache))[0] == 0  # one committed shard
    before = snapshot(cache)
    if where == "tar-write":
        monkeypatch.setattr(wds._HashingFile, "write", _enospc)
    else:
        monkeypatch.setattr(jn, "write_journal_chunks", _enospc)
    code, _, err = _cli(capsys, _pre_args(world, prompts, cache))
    text = " ".join(err.split())
    assert code == 1 and "Traceback" not in err and len(_error_lines(err)) == 1, err
    assert f"error: disk full while writing {cache}" in text and "re-run to resume" in text
    after = snapshot(cache)
    assert {k: v for k, v in after.items() if k in before} == before  # committed: untouched
    assert not [p for p in after if p.endswith(".tmp")]  # the open shard's temp is gone
    with open_cache(cache) as store:
        assert len(store) == 2 and store.verify() == []
    monkeypatch.undo()
    code, out, err = _cli(capsys, _pre_args(world, prompts, cache))  # space is back: resume
    assert code == 0 and "2 records written" in " ".join(out.split()), err
    with open_cache(cache) as store:
        keys = [k for e in store.entries for k in e.keys]
        assert len(keys) == len(set(keys)) == 4 and store.verify() == []


def test_disk_full_in_train_keeps_the_previous_checkpoint(
    world: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import wandistill.train.checkpoint as ckpt

    out = tmp_path / "run"
    shutil.copytree(world["run"], out)
    before = snapshot(out / "checkpoints")
    monkeypatch.setattr(ckpt, "open", _full_disk_open, raising=False)  # checkpoint files only
    sets = ["student.num_layers=1", "student.ffn_dim=32", "batch_size=2", 'device="cpu"',
            "tensorboard=false", "checkpoint_every=1"]  # fmt: skip
    args = [*_with(TRAIN, "--out", str(out)), "--resume", "--steps", "4"]
    args += [x for s in sets for x in ("--set", s)]
    code, _, err = _cli(capsys, [_fill(a, world, tmp_path) for a in args])
    assert code == 1 and "Traceback" not in err and len(_error_lines(err)) == 1, err
    assert "disk full while writing" in err and "re-run to resume" in err
    assert f"{out / 'checkpoints'}{os.sep}" in err and "student.safetensors" in err, err
    assert snapshot(out / "checkpoints") == before  # checkpoint-2 and `latest` intact
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith("checkpoint-3")]


# ----------------------------------------------------------------------------- subprocesses


def _unprivileged() -> list[str] | None:
    """A command prefix that drops root (so permission bits bind), or None if impossible."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.fixture
def public(world: dict[str, str]) -> Iterator[Path]:
    """A world-readable scratch directory (pytest's tmp dirs are 0700) with its own teacher."""
    d = Path(tempfile.mkdtemp(prefix="wandistill-bad-input-"))
    try:
        d.chmod(0o755)
        shutil.copytree(world["teacher"], d / "teacher")
        (d / "p.txt").write_text("a cat\n")
        for p in d.rglob("*"):
            p.chmod(0o755 if p.is_dir() else 0o644)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _wandistill(
    prefix: list[str], *args: str, cwd: Path, zygote: Zygote | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m wandistill ARGS` in a real process: a fresh interpreter (under `prefix`: as
    another user), or a fork of the session's zygote (tests/zygote.py) when one is given."""
    env = cli_env(HOME=str(cwd), PYTHONPATH=str(REPO), COLUMNS="200")
    env.pop("WANDISTILL_DEBUG", None)
    python = sys.executable if zygote is None else zygote.python
    env = env if zygote is None else zygote.env(env)
    return subprocess.run(
        [*prefix, python, "-m", "wandistill", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", ["unreadable-prompts", "read-only-cache-dir", "read-only-run-dir"])
def test_permission_errors_as_a_user_are_usage_errors(
    public: Path, world: dict[str, str], case: str
) -> None:
    prefix = _unprivileged()
    if prefix is None:
        pytest.skip("running as root without setpriv: permission bits cannot bind")
    ro = public / "ro"
    ro.mkdir()
    if case == "unreadable-prompts":
        (public / "p.txt").chmod(0)
        args = ["precompute", "--teacher", str(public / "teacher"), "--prompts",
                str(public / "p.txt"), "--out", str(public / "c")]  # fmt: skip
        message = f"prompt file '{public / 'p.txt'}' cannot be read (Permission denied)"
    elif case == "read-only-cache-dir":
        args = ["precompute", "--teacher", str(public / "teacher"), "--prompts",
                str(public / "p.txt"), "--out", str(ro / "c")]  # fmt: skip
        message = f"cannot create cache directory '{ro / 'c'}': Permission denied"
    else:
        shutil.copytree(world["cache"], public / "cache")
        for p in [public / "cache", *(public / "cache").rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        args = ["train", "--cache", str(public / "cache"), "--out", str(ro / "run"), "--set",
                'device="cpu"', "--set", "student.num_layers=1", "--steps", "1"]  # fmt: skip
        message = f"cannot create run directory '{ro / 'run'}': Permission denied"
    ro.chmod(0o555)
    before = snapshot(public / "teacher")
    proc = _wandistill(prefix, *args, cwd=public)
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and message in err and "fix:" in err
    assert len(_error_lines(proc.stderr)) == 1
    assert not list(ro.iterdir()) and snapshot(public / "teacher") == before


@pytest.mark.slow
def test_debug_shows_the_traceback_and_plain_runs_do_not(
    zygote: Zygote, world: dict[str, str], tmp_path: Path
) -> None:
    args = ["cache", "verify", str(tmp_path / "nope")]
    plain = _wandistill([], *args, cwd=tmp_path, zygote=zygote)
    debug = _wandistill([], "--debug", *args, cwd=tmp_path, zygote=zygote)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    assert plain.stderr.startswith("error: cache path")
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "UsageError" in debug.stderr


@pytest.mark.slow
def test_a_corrupt_cache_through_the_console_script(
    zygote: Zygote, world: dict[str, str], tmp_path: Path
) -> None:
    """Runtime failure (exit 1) end to end: verify names shard and record; train refuses."""
    cache = tmp_path / "cache"
    shutil.copytree(world["cache"], cache)
    m = json.loads((cache / "manifest.json").read_text())
    entry = m["shards"][1]
    path = cache / entry["file"]
    data = bytearray(path.read_bytes())
    data[entry["offsets"][0][0] + entry["offsets"][0][1] - 5] ^= 0xFF  # last tensor's data
    path.write_bytes(bytes(data))
    verify = _wandistill([], "cache", "verify", str(cache), cwd=tmp_path, zygote=zygote)
    assert verify.returncode == 1 and "Traceback" not in verify.stderr
    assert f"BAD shard {entry['name']} record {entry['keys'][0]}: " in verify.stderr
    train = _wandistill([], "train", "--cache", str(cache), "--out", str(tmp_path / "run"),
                        "--set", 'device="cpu"', "--set", "student.num_layers=1", "--set",
                        "batch_size=6", "--steps", "3", cwd=tmp_path, zygote=zygote)  # fmt: skip
    assert train.returncode == 1 and "Traceback" not in train.stderr, train.stderr
    (line,) = _error_lines(train.stderr)
    assert f"corrupt record {entry['keys'][0]} in shard {entry['name']}" in line
