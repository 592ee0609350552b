"""The built wheel, installed into a fresh venv, runs `wandistill demo` outside the repository.

The venv reuses this environment's dependencies (torch & co.) through a .pth file and gets only
the wheel itself (`--no-deps --no-index`): nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).parents[2]
SOURCES = ("wandistill", "pipelines", "pyproject.toml", "README.md")
"""What the build reads. It runs on a copy: an in-tree build leaves build/ and *.egg-info."""


def _env() -> dict[str, str]:
    """This environment without PYTHONPATH, which would put the source tree before the wheel."""
    drop = ("PYTHONPATH", "PYTHONHOME", "WANDISTILL_DEBUG")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _run(cmd: list[str | Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=900
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("build")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info")
    for name in SOURCES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, root / "src" / name, ignore=ignore)
        else:
            shutil.copy2(src, root / "src" / name)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    proc = _run([*pip, "-w", root / "dist", root / "src"], cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (built,) = (root / "dist").glob("wandistill-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel; dependencies come from this one's site-packages."""
    env = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    query = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = Path(_run([python, "-c", query], cwd=env).stdout.strip())
    (purelib / "_deps_from_test_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    install = ["install", "--no-deps", "--no-index", "--ignore-installed", wheel]
    proc = _run([sys.executable, "-m", "pip", "--python", python, *install], cwd=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return env


def test_the_wheel_holds_every_module_data_file_and_recipe(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    package = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "wandistill").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    recipes = {f"wandistill/recipes/{p.name}" for p in (REPO / "pipelines").glob("*.*")}
    assert not (package | recipes) - names, sorted((package | recipes) - names)
    assert "wandistill/recipes/tiny.toml" in names


CHEAP = [  # the demo's recipe at toy sizes: 4 teacher steps, a K = 2 student, 2 training steps
    "precompute.sampler.num_inference_steps=4",
    "precompute.sampler.height=32",
    "precompute.sampler.width=32",
    "train.student.num_inference_steps=2",
    "train.steps=2",
    "train.batch_size=8",
    "train.checkpoint_every=2",
    "train.data_threads=1",
    'train.device="cpu"',
]


def test_the_installed_wheel_runs_the_demo_from_an_empty_directory(
    venv: Path, tmp_path: Path
) -> None:
    code = "import wandistill.recipes as r; print(r.__file__)"
    where = _run([venv / "bin" / "python", "-c", code], cwd=tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout + where.stderr

    # The demo's own content may change; it must run end to end from the wheel. Made cheap: a
    # random tiny teacher (the trained one costs a minute of CPU; its build has its own tests),
    # given prompts, few steps.
    cli = venv / "bin" / "wandistill"
    assert _run([cli, "teacher", "make-tiny", "teacher"], cwd=tmp_path).returncode == 0
    (tmp_path / "prompts.txt").write_text("".join(f"a cat number {i}\n" for i in range(40)))
    sets = [*CHEAP, 'precompute.prompts="prompts.txt"']
    demo = _run(
        [cli, "demo", "--teacher", "teacher", *(x for s in sets for x in ("--set", s))],
        cwd=tmp_path,
    )
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-3000:]
    made = tmp_path / "cache" / "demo"  # the default --root is relative to the cwd
    assert made.is_dir() and any(made.iterdir())


def test_the_installed_wheel_lists_and_copies_shipped_recipes(venv: Path, tmp_path: Path) -> None:
    listed = _run([venv / "bin" / "wandistill", "recipes"], cwd=tmp_path)
    assert listed.returncode == 0 and "wan2.2-a14b_1x24gb" in listed.stdout, listed.stderr
    copied = _run([venv / "bin" / "wandistill", "recipes", "copy", "tiny"], cwd=tmp_path)
    assert copied.returncode == 0, copied.stderr
    assert (tmp_path / "tiny.toml").read_bytes() == (REPO / "pipelines" / "tiny.toml").read_bytes()
