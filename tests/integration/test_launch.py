"""`wandistill launch`: a refused 2-rank precompute ends with the rank's one error, no traceback.

Raw torchrun prints its ChildFailedError traceback after any rank exits non-zero (issue 28 item
3); `wandistill launch` runs the same job with the same flags and exits as the failing rank did.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from wandistill.config import load_recipe
from wandistill.precompute.run import run

from zygote import Zygote

pytestmark = [pytest.mark.dist, pytest.mark.slow]

REPO = Path(__file__).parents[2]
SETS = (
    "previews=0",
    "sampler.height=32",
    "sampler.width=32",
    "sampler.num_inference_steps=4",
    "cache.holdout_fraction=0.0",
)


def test_a_refused_two_rank_precompute_prints_one_error_and_no_traceback(
    zygote: Zygote, tmp_path: Path, tiny_teacher: Path
) -> None:
    """`wandistill launch`, torchrun's agent in it and the ranks are forks of the session's
    zygote (tests/zygote.py): the same code in real processes."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na dog\n")
    cache = tmp_path / "cache"
    paths = [f'teacher.path="{tiny_teacher}"', f'prompts="{prompts}"', f'cache.path="{cache}"']
    run(load_recipe("tiny", [*paths, *SETS], stage="precompute").precompute, quiet=True)
    sets = [x for s in (*SETS, "sampler.guidance_scale=3.0") for x in ("--set", s)]
    args = ["--teacher", str(tiny_teacher), "--prompts", str(prompts), "--out", str(cache)]
    job = subprocess.run(
        [zygote.python, "-m", "wandistill", "launch", "--standalone", "--nproc_per_node=2"]
        + ["precompute", "tiny", *args, *sets],
        cwd=REPO,
        env=zygote.env({**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in job.stderr.splitlines() if line.startswith("error:")]
    assert job.returncode == 2, job.stderr[-3000:]  # the rank's own exit code (a usage error)
    assert len(errors) == 1 and "written with a different" in errors[0], job.stderr
    assert "settings.guidance_scale: cache has 5.0, this run has 3.0" in job.stderr
    assert "Traceback" not in job.stderr and "ChildFailedError" not in job.stderr, job.stderr
    assert "fix:" in job.stderr
