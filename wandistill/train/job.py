"""Joining the torchrun job for `train`, with torch.distributed only (no training stack).

`entry.launch` (the command line) joins here before it imports the training stack, so a rank
launched by hand whose peer never comes says so within seconds of starting (`dist._join`'s
`waiting:` line), instead of after the imports; `loop.run`'s own join then finds the job
joined. In-process callers may call `loop.run` directly: it joins itself.
"""

from __future__ import annotations

from wandistill.config import TrainConfig, to_dict
from wandistill.runtime import dist


def join(
    cfg: TrainConfig, *, resume: bool = False, follow: bool = False, skip_corrupt: bool = False
) -> dist.DistInfo:
    """This rank in the job (`dist.init`): every rank must run the same config and flags."""
    flags = {"resume": resume, "follow": follow, "skip_corrupt": skip_corrupt}
    return dist.init(
        cfg.device,
        timeout_s=cfg.dist_timeout,
        config={"train": to_dict(cfg), "flags": flags},
        cpu_backend=cfg.parallel == "fsdp" and cfg.fsdp.cpu_offload,
    )
