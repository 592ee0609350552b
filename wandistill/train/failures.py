"""Failure handling of the loop: out-of-memory advice, collective failures, a test hook.

`WANDISTILL_FAIL_AT=<rank>:<step>[:error|oom|hang]` makes that rank fail right after finishing
that optimizer step: `error` raises a runtime error, `oom` a (fake) out-of-memory error, `hang`
blocks forever (for kill -9 tests). Only tests set it; it costs one dict lookup per step.
"""

from __future__ import annotations

import os
import re
import time

import torch

from wandistill.config import TrainConfig
from wandistill.dist import DistInfo, unresponsive_ranks
from wandistill.errors import WandistillError

FAIL_ENV = "WANDISTILL_FAIL_AT"


def injected_failure(rank: int, step: int) -> None:
    spec = os.environ.get(FAIL_ENV)
    if not spec:
        return
    parts = spec.split(":")
    if int(parts[0]) != rank or int(parts[1]) != step:
        return
    kind = parts[2] if len(parts) > 2 else "error"
    if kind == "hang":
        while True:
            time.sleep(3600)
    if kind == "oom":
        raise torch.OutOfMemoryError(f"injected out-of-memory on rank {rank} at step {step}")
    raise WandistillError(f"injected failure on rank {rank} at step {step} ({FAIL_ENV}={spec})")


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e)
    )


_PEER_LOST = ("gloo", "nccl", "connection reset", "connection closed", "broken pipe")


def is_collective_failure(e: BaseException) -> bool:
    """A collective that failed because a peer went away (gloo raises a plain RuntimeError)."""
    text = str(e).lower()
    return isinstance(e, torch.distributed.DistError) or (
        isinstance(e, RuntimeError) and any(m in text for m in _PEER_LOST)
    )


def oom_error(
    cfg: TrainConfig, info: DistInfo, num_params: int, e: BaseException
) -> WandistillError:
    """One message with the figures and the levers, in the order to try them."""
    dev = info.device
    figures = [f"rank {info.rank} on {dev}", f"student {num_params / 1e6:.1f}M params"]
    if dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
        figures += [
            f"peak allocated {torch.cuda.max_memory_allocated(dev) / 2**30:.2f} GiB",
            f"of {total / 2**30:.2f} GiB",
        ]
    figures += [
        f"batch_size={cfg.batch_size}",
        f"grad_accum={cfg.grad_accum}",
        f"gradient_checkpointing={str(cfg.gradient_checkpointing).lower()}",
        f"mixed_precision={cfg.mixed_precision}",
    ]
    levers = []
    if cfg.batch_size > 1:
        half = max(1, cfg.batch_size // 2)
        levers.append(
            f"--set train.batch_size={half} --set train.grad_accum={cfg.grad_accum * 2} "
            "(same global batch)"
        )
    if not cfg.gradient_checkpointing:
        levers.append("--set train.gradient_checkpointing=true")
    if cfg.mixed_precision != "bf16":
        levers.append('--set train.mixed_precision="bf16"')
    levers.append("a smaller student (train.student.num_layers / ffn_dim)")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return WandistillError(
        f"out of memory while training ({', '.join(figures)}): {first}",
        fix="; or ".join(levers) + "; then re-run with --resume",
    )


def collective_error(info: DistInfo, e: BaseException) -> WandistillError:
    """Another rank died mid-collective: say so in one line instead of a gloo/nccl traceback."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    first = re.sub(r"\[[^\]]*\]:?\s*", "", first)  # gloo's "[.../pair.cc:537]" source tags
    missing = unresponsive_ranks(info)
    who = (
        f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not answer "
        "(stopped, died or hangs)"
        if missing
        else "most likely because another rank stopped"
    )
    return WandistillError(
        f"rank {info.rank}: a collective failed, {who} (see that rank's error): {first[:300]}",
        fix="fix that rank's error, then re-run with --resume",
    )
