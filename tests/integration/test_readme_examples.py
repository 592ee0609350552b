"""Every command block a user is told to copy runs as written: the README's "Examples" block
and docs/distributed.md's single-machine blocks, line by line, in order, in an empty folder,
with `/tmp/` rewritten to a scratch folder and nothing else. OMP_NUM_THREADS is left as the
user's shell has it (unset), so torchrun's one-thread ranks meet a one-process cache, as they
do for a person following the README.

bash runs each line as written; the `wandistill` and `torchrun` it finds, and the `python`
torchrun starts each rank with, are forks of the session's zygote (tests/zygote.py): the same
code in real processes, without each paying seconds of imports. What that leaves out, the
console script and a fresh interpreter's start-up, test_wheel_demo (`wandistill demo` from an
installed wheel) and test_startup_imports run for real."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from docblocks import ROOT, commands, distributed_single_machine, readme_examples  # noqa: E402

from zygote import Zygote  # noqa: E402

pytestmark = pytest.mark.slow


def _env(zygote: Zygote) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env["COLUMNS"] = "80"
    return zygote.env(env)


def _run_in_order(zygote: Zygote, lines: list[str], cwd: Path) -> dict[str, str]:
    """Each line's output (stdout + stderr), after asserting it exited 0 without a traceback."""
    outputs: dict[str, str] = {}
    for line in lines:
        p = subprocess.run(
            ["bash", "-c", f"set -o pipefail; {line}"],
            cwd=cwd,
            env=_env(zygote),
            capture_output=True,
            text=True,
            timeout=300,
        )
        text = p.stdout + p.stderr
        assert p.returncode == 0, f"{line}\nexit {p.returncode}\n{text}"
        assert "Traceback" not in text, f"{line}\n{text}"
        outputs[line] = text
    return outputs


def test_the_readme_examples_run_as_written_in_an_empty_folder(
    zygote: Zygote, tmp_path: Path
) -> None:
    (cwd := tmp_path / "empty").mkdir()
    (scratch := tmp_path / "tmp").mkdir()
    said = " ".join(_run_in_order(zygote, commands(readme_examples(), scratch), cwd).values())
    said = " ".join(said.split())
    if (os.cpu_count() or 1) > 1:  # the 1-process cache has more threads than a torchrun rank
        assert re.search(r"precompute: \d+ intra-op threads per process \(was 1\)", said), said
    assert "(--limit 4; pass --limit 32 for all)" in said  # sample says what it left out
    assert (scratch / "pipeline" / "model_index.json").is_file()
    assert (scratch / "eval" / "eval.json").is_file()
    assert len(list((scratch / "png").glob("*.png"))) >= 4


def test_distributed_md_single_machine_blocks_run_as_written(
    zygote: Zygote, tmp_path: Path
) -> None:
    (cwd := tmp_path / "empty").mkdir()
    (scratch := tmp_path / "tmp").mkdir()
    lines = [c for b in distributed_single_machine() for c in commands(b, scratch)]
    _run_in_order(zygote, lines, cwd)
