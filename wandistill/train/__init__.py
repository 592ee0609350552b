"""The train room: DDP student distillation that streams the cache and never loads the teacher.

`run(cfg, resume=, follow=, skip_corrupt=)` is the whole stage (see `loop.py`); checkpoints,
metrics, EMA, optimizer and export live in their own modules. Nothing here imports
`wandistill.teacher` (a test scans for it).
"""

from wandistill.train.loop import TrainResult, run

__all__ = ["TrainResult", "run"]
