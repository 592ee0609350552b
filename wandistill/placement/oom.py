"""Out-of-memory errors that say where, how much, and what to try next.

A bare `torch.OutOfMemoryError` tells a user that one allocation failed; it does not say which
placement was in use or what would fit instead. `oom_guard` turns any out-of-memory failure
(`runtime.failures.is_oom`, the one rule both stages use) into a `WandistillError` (exit 1,
no traceback) naming the device, its allocated / reserved / total / free figures (torch.cuda
on GPUs, /proc/meminfo on the CPU, no psutil), the strategy, and the next strategies to try
as exact flags, in the order that frees the most accelerator memory for the least speed.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch

from wandistill.errors import WandistillError
from wandistill.placement.devices import GiB
from wandistill.placement.inventory import read_meminfo
from wandistill.placement.strategies import DiskOffload, Placement
from wandistill.runtime.failures import is_oom

__all__ = ["is_oom", "memory_figures", "next_strategies", "oom_error", "oom_guard"]


def _oom_device(exc: BaseException, device: torch.device) -> torch.device:
    """The device that ran out: CUDA errors name their GPU; CPU allocator failures are the CPU."""
    if isinstance(exc, torch.OutOfMemoryError):
        m = re.search(r"GPU (\d+)", str(exc))
        return torch.device("cuda", int(m.group(1))) if m else device
    if isinstance(exc, MemoryError) or "cpu" in str(exc).lower():
        return torch.device("cpu")
    return device


def memory_figures(device: torch.device) -> str:
    """ "allocated X GiB, reserved Y GiB, total Z GiB, free W GiB" for a GPU or the CPU."""
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            free, total = torch.cuda.mem_get_info(index)
            alloc = torch.cuda.memory_allocated(index)
            reserved = torch.cuda.memory_reserved(index)
        except RuntimeError:  # a broken context; say so rather than fail while reporting
            return "memory figures unavailable"
        return (
            f"allocated {alloc / GiB:.2f} GiB, reserved {reserved / GiB:.2f} GiB, "
            f"total {total / GiB:.2f} GiB, free {free / GiB:.2f} GiB"
        )
    info = read_meminfo()
    total, free = info.get("MemTotal", 0), info.get("MemAvailable", 0)
    rss = read_meminfo("/proc/self/status").get("VmRSS", 0)
    return (
        f"process resident {rss / GiB:.2f} GiB, total {total / GiB:.2f} GiB, "
        f"available {free / GiB:.2f} GiB"
    )


def next_strategies(placement: Placement | None, device: torch.device) -> list[str]:
    """Flags to try after `placement` ran out of memory on `device`, most promising first."""
    if device.type == "cpu":
        # CPU RAM ran out: offloading to the CPU makes it worse; only the disk relieves it.
        return [] if isinstance(placement, DiskOffload) else [DiskOffload().flags()]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # a module loaded elsewhere: what any placement suggests (`Placement.next_to_try`)
    return [p.flags() for p in (placement or Placement()).next_to_try(gpus)]


def oom_error(
    exc: BaseException,
    *,
    device: torch.device | str,
    placement: Placement | None,
    component: str | None = None,
) -> WandistillError:
    """The `WandistillError` to raise for out-of-memory `exc` (see the module docstring).

    `placement` is the one in use (None: a module loaded elsewhere).
    """
    where = _oom_device(exc, torch.device(device))
    what = f" running {component}" if component else ""
    label = placement.label if placement is not None else "unknown"
    message = f"out of memory on {where}{what} with placement {label!r}: {memory_figures(where)}"
    steps = next_strategies(placement, where)
    smaller = "lower sampler.batch_size, height/width or num_frames"
    fix = f"try {', then '.join(steps)}; or {smaller}" if steps else smaller
    if where.type == "cpu":
        fix += "; or use a machine with more RAM"
    return WandistillError(message, fix=fix)


@contextlib.contextmanager
def oom_guard(
    device: torch.device | str, placement: Placement | None, *, component: str | None = None
) -> Iterator[None]:
    """Run a block; turn an out-of-memory failure inside it into `oom_error(...)`."""
    try:
        yield
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
        if not is_oom(e):
            raise
        raise oom_error(e, device=device, placement=placement, component=component) from e
