"""The command line's way into `train`: join the torchrun job, then import the training stack.

`job.join` needs only torch.distributed; the training stack (`loop.run`: diffusers, peft,
webdataset, zarr) is imported after it. Kept apart from `job`, which `loop` itself uses, so
there is no import circle.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from wandistill.config import TrainConfig
from wandistill.runtime import dist
from wandistill.train import job

if TYPE_CHECKING:
    from wandistill.train.loop import TrainResult


def launch(
    cfg: TrainConfig, *, resume: bool = False, follow: bool = False, skip_corrupt: bool = False
) -> TrainResult:
    """Join the job, then import and run the training stack (see the module docstring)."""
    info = job.join(cfg, resume=resume, follow=follow, skip_corrupt=skip_corrupt)
    with dist.leaving_on_error(info):
        from wandistill.train import run  # loop.run, loaded now

        return run(cfg, resume=resume, follow=follow, skip_corrupt=skip_corrupt)


def finished_at(cfg: TrainConfig) -> int | None:
    """The step of a finished run in `cfg.out` that is already at or past `cfg.steps` (a total),
    else None. Re-running a finished command with --resume is then a no-op that names the way
    on. The recipe is still checked against the run first (a resume that changes the parallel
    mode, the LoRA or the cache is refused as always); a run killed after its last checkpoint
    but before its student was written (no sampling.json) is not finished: `run` completes it.
    The checkpoint's step is looked at first: the training stack is imported only for a run
    that may be finished."""
    from wandistill.train import checkpoint as ckpt_io

    out = Path(cfg.out)
    latest = ckpt_io.resolve_latest(out / "checkpoints")
    at = ckpt_io.step_of(latest) if latest is not None else None
    if at is None or at < cfg.steps:
        return None
    from wandistill.train.export import SAMPLING
    from wandistill.train.inputs import validate

    if not (out / SAMPLING).is_file():
        return None
    validate(cfg, resume=True).close()  # the checks only: nothing is read after them
    return at
