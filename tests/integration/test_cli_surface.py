"""What a user sees and gets from a tiny run through the real CLI (a fresh process, COLUMNS=80,
stdout/stderr not a terminal): no library noise, summaries that fit 80 columns, outputs with
normal permissions, a run folder no model loader mistakes for a model, and a loss plot."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from wandistill.runtime.quiet import QUIET_ENV

pytestmark = pytest.mark.slow

TRAIN = ["--set", "batch_size=4", "--set", "log_every=1", "--set", "checkpoint_every=2"]
COMMANDS = {
    "make-tiny": ["teacher", "make-tiny", "t"],
    "precompute": ["precompute", "tiny", "--teacher", "t", "--prompts", "p.txt", "--out", "c"],
    "train": ["train", "tiny", "--cache", "c", "--out", "r", "--steps", "3", *TRAIN],
    "cache info": ["cache", "info", "c"],
    "cache verify": ["cache", "verify", "c"],
    "recipes": ["recipes"],
    "recipes copy": ["recipes", "copy", "tiny"],
    "plan": ["plan", "tiny", "--teacher", "t"],
    "export": ["export", "--run", "r", "--teacher", "t", "--out", "ex"],
}
OURS_80 = ("make-tiny", "cache info", "cache verify", "recipes", "recipes copy", "plan")
"""Commands whose every line this test holds to 80 columns (precompute's and train's progress and
summary lines, and export's message, are checked where those are written)."""
NOISE = (
    "Loading weights",
    "Loading pipeline components",
    "Writing model shards",
    "it/s]",
    "Warning:",
    "warnings.warn",
)

SCRIPT = """
import sys
from wandistill.cli import main
for name, args in {commands}.items():
    for stream in (sys.stdout, sys.stderr):
        print(f"@@ {{name}}", file=stream, flush=True)
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code
    print(f"@@ exit {{code}}", file=sys.stderr, flush=True)
"""


def _env() -> dict[str, str]:
    """The user's environment: none of the switches an in-process CLI call in this test process
    may have set, COLUMNS=80 and pipes (not a terminal) for stdout and stderr."""
    env = {k: v for k, v in os.environ.items() if k not in QUIET_ENV}
    return {**env, "COLUMNS": "80", "PYTHONPATH": str(Path.cwd())}


def _split(text: str) -> dict[str, list[str]]:
    parts: dict[str, list[str]] = {}
    name = ""
    for line in text.splitlines():
        if line.startswith("@@ ") and not line.startswith("@@ exit"):
            name = line[3:]
            parts[name] = []
        else:
            parts.setdefault(name, []).append(line)
    return parts


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Every command once, in one fresh process (one import of torch and diffusers), from a
    working folder with short relative paths, as a user would type them."""
    root = tmp_path_factory.mktemp("surface")
    (root / "p.txt").write_text("a cat\na dog\na red car\na boat at sea\n")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(commands=repr(COMMANDS))],
        cwd=root,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    err = _split(proc.stderr)
    codes = {n: [x for x in lines if x.startswith("@@ exit")] for n, lines in err.items()}
    failed = {n: err[n] for n, c in codes.items() if n and c != ["@@ exit 0"]}
    assert failed == {}
    return {"root": root, "out": _split(proc.stdout), "err": err}


def test_no_command_prints_library_progress_bars_or_warnings(world: dict) -> None:
    for name in COMMANDS:
        text = "\n".join(world["out"][name] + world["err"][name])
        assert [n for n in NOISE if n in text] == [], f"{name}:\n{text}"


def test_summaries_fit_80_columns(world: dict) -> None:
    for name in OURS_80:
        lines = world["out"][name] + [x for x in world["err"][name] if not x.startswith("@@")]
        assert lines, name
        assert [x for x in lines if len(x) > 80] == [], name


def test_verbose_shows_the_library_output_again(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "wandistill", "-v", "teacher", "make-tiny", str(tmp_path / "t")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Writing model shards" in proc.stderr  # the bar the quiet run above does not show


def test_outputs_get_the_modes_of_a_plain_mkdir_and_open(world: dict) -> None:
    """Files 0644 and folders 0755 under umask 022 (mkstemp/mkdtemp's 0600/0700 never leak)."""
    mask = os.umask(0o022)
    os.umask(mask)
    root: Path = world["root"]  # type: ignore[assignment]
    wrong = []
    for top in ("c", "r", "ex"):
        for path in [root / top, *(root / top).rglob("*")]:
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):  # export links the teacher's components
                continue
            want = (0o777 if stat.S_ISDIR(st.st_mode) else 0o666) & ~mask
            if stat.S_IMODE(st.st_mode) != want:
                wrong.append(f"{path.relative_to(root)} {oct(stat.S_IMODE(st.st_mode))}")
    assert wrong == []


def test_the_run_folder_is_not_a_model_folder_but_its_student_is(world: dict) -> None:
    from diffusers import WanTransformer3DModel

    run: Path = world["root"] / "r"  # type: ignore[operator]
    assert "train" in json.loads((run / "run.json").read_text())
    assert not (run / "config.json").exists()
    with pytest.raises(OSError, match="config.json"):
        WanTransformer3DModel.from_pretrained(run)
    assert WanTransformer3DModel.from_pretrained(run / "student").config.num_layers >= 1


def test_train_ends_with_a_loss_plot(world: dict) -> None:
    with Image.open(world["root"] / "r" / "loss.png") as img:  # type: ignore[operator]
        assert img.format == "PNG" and img.size[0] >= 600 and img.size[1] >= 300
