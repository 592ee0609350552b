"""What the command line imports before it does anything slow (issue 25: no silent wait).

`--help`, parsing a recipe, and a torchrun rank up to the moment it joins the job must not
import the model and cache libraries (seconds each on a busy machine): a rank launched by hand
whose peer never comes must say so within seconds. Each check runs in a fresh interpreter and
reads `sys.modules`: a fact about the import graph, not a timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
LIBRARIES = ("diffusers", "transformers", "accelerate", "peft", "webdataset", "zarr")
"""Never imported before the job is joined."""

SPY = """
import json, sys
LIBS = %r
def loaded():
    return sorted(m for m in LIBS if m in sys.modules)
%s
print("LOADED " + json.dumps(loaded()))
"""


def _loaded(body: str, libs: tuple[str, ...], **env: str) -> list[str]:
    """Run `body` in a fresh interpreter; the `libs` it had imported when it printed."""
    p = subprocess.run(
        [sys.executable, "-c", SPY % (libs, body)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((s for s in p.stdout.splitlines() if s.startswith("LOADED ")), None)
    assert line is not None, f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    return json.loads(line.removeprefix("LOADED "))


def test_importing_the_cli_loads_no_model_cache_or_tensor_library() -> None:
    assert _loaded("import wandistill.cli", (*LIBRARIES, "torch")) == []


def test_help_loads_no_model_cache_or_tensor_library() -> None:
    body = """
from wandistill.cli import main
for argv in (["--help"], ["train", "--help"], ["precompute", "--help"], ["launch", "--help"]):
    try:
        main(argv)
    except SystemExit as e:
        assert not e.code, (argv, e.code)
"""
    assert _loaded(body, (*LIBRARIES, "torch")) == []


def test_parsing_and_checking_recipes_loads_no_model_cache_or_tensor_library() -> None:
    body = """
from wandistill.config import load_recipe, shipped_recipe_names, to_dict
for name in shipped_recipe_names():
    for stage in ("precompute", "train"):
        to_dict(getattr(load_recipe(name, [], stage=stage), stage))
load_recipe("tiny", ['train.cache=["/c/a", "/c/b"]', "train.cache_weights=[2, 1]"], stage="train")
"""
    assert _loaded(body, (*LIBRARIES, "torch")) == []


@pytest.mark.parametrize("stage", ["train", "precompute"])
def test_a_torchrun_rank_joins_the_job_before_importing_the_stage(
    stage: str, tmp_path: Path, tiny_teacher: Path
) -> None:
    """A rank of a 2-rank job with no peer, stopped where it would wait for the peer (the
    rendezvous): by then only torch is loaded, not the libraries of the stage."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    args = {
        "train": ["train", "tiny", "--cache", str(tmp_path / "c"), "--out", str(tmp_path / "r")],
        "precompute": [
            "precompute",
            "tiny",
            "--teacher",
            str(tiny_teacher),
            "--prompts",
            str(prompts),
            "--out",
            str(tmp_path / "c"),
        ],
    }[stage]
    body = f"""
import wandistill.runtime.dist
def at_rendezvous(*args, **kwargs):
    print("LOADED " + json.dumps(loaded()))
    sys.exit(0)
wandistill.runtime.dist._join = at_rendezvous
from wandistill.cli import main
main({args!r})
"""
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    assert _loaded(body, (*LIBRARIES, "torch"), MASTER_PORT="29599", **env) == ["torch"]
