"""The train room: DDP student distillation that streams the cache and never loads the teacher.

`run(cfg, resume=, follow=, skip_corrupt=)` is the whole stage (see `loop.py`); checkpoints,
metrics, EMA, optimizer and export live in their own modules. Nothing here imports
`wandistill.teacher` (a test scans for it). The command line calls `entry.launch`, which joins a
torchrun job before importing the training stack; `run` and `TrainResult` load on first use
(`wandistill.runtime.lazy`).
"""

from typing import TYPE_CHECKING

from wandistill.runtime.lazy import exports

if TYPE_CHECKING:
    from wandistill.train.loop import TrainResult, run

__all__ = ["TrainResult", "run"]
__getattr__, __dir__ = exports(
    __name__, {"TrainResult": "wandistill.train.loop", "run": "wandistill.train.loop"}
)
