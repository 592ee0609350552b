"""The command line's way into `precompute`: join the torchrun job, then import the stage.

`job.join` needs only torch.distributed; the stage (`run.run`: diffusers, transformers,
accelerate, webdataset, zarr) is imported after it, so a rank launched by hand whose peer never
comes says so within seconds. Kept apart from `job` so the stage can use `job`'s identity and
joining without an import circle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wandistill.config import PrecomputeConfig
from wandistill.precompute import job
from wandistill.runtime import dist

if TYPE_CHECKING:
    from wandistill.precompute.finish import Summary
    from wandistill.precompute.parts import Part


def launch(cfg: PrecomputeConfig, *, part: Part | None = None) -> Summary:
    """Join the job, then import and run the stage (see the module docstring)."""
    info = job.join(job.for_part(cfg, part))
    with dist.leaving_on_error(info):
        from wandistill.precompute.run import run

        return run(cfg, part=part)
