"""Devices and sizes as the placement package names them: one `cuda:N` parser, memory sizes.

Every place that reads a device name ("cuda:3", "cpu", "disk", a max_memory key "0") goes
through `gpu_index` / `device_key`, and every memory size a user writes ("80GiB", "2TiB")
through `parse_size`, so the spelling rules live in one module that imports nothing else.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from wandistill.errors import UsageError

__all__ = [
    "CPU_OVERHEAD",
    "CUDA_OVERHEAD",
    "Caps",
    "GiB",
    "device_key",
    "gpu_index",
    "parse_max_memory",
    "parse_size",
]

GiB = 1 << 30
#: Allowance per GPU for the CUDA context, cuBLAS workspaces and caching-allocator slack.
CUDA_OVERHEAD = 1 * GiB
#: Allowance on the CPU for the Python process itself (torch, diffusers, transformers imported).
CPU_OVERHEAD = 2 * GiB
Caps = tuple[tuple[int | str, int], ...]
"""max_memory as hashable pairs: (GPU index or "cpu", bytes)."""

_CUDA = re.compile(r"cuda:(\d+)")


def gpu_index(device: str) -> int | None:
    """N for "cuda:N"; None for anything else ("cpu", "disk", a bare "cuda", "cuda:x").

    The one `cuda:N` parser of the package: placements, device-map files, max_memory keys, the
    inventory and the plan's tables all read device names through it."""
    m = _CUDA.fullmatch(device)
    return int(m.group(1)) if m else None


def device_key(device: str) -> int | str:
    """A plan's device name as an accelerate max_memory key: "cuda:N" -> N, others unchanged."""
    index = gpu_index(device)
    return device if index is None else index


# --------------------------------------------------------------------------- sizes


def parse_size(value: Any, what: str) -> int:
    """Bytes from "80GiB", "80 GiB", "80GB", "512MiB", "2TiB" or an int (what accelerate's
    `convert_file_size_to_int` accepts, plus TiB/TB); anything else is one UsageError naming
    `what` and the nearest valid spelling."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value > 0:
            return value
        raise UsageError(f"{what} {value} must be positive", fix=f"e.g. {what} 80GiB")
    text = str(value).strip()
    scaled = re.fullmatch(r"(.*?)\s*[tT](i?)([bB])", text)
    if scaled:  # accelerate stops at GB/GiB: express TB/TiB in GB/GiB for it
        num, i, b = scaled.groups()
        try:  # any float, as accelerate reads GB: ".5TiB", "1e1TB"
            text = f"{float(num) * (1024 if i else 1000)}G{i}{b}"
        except ValueError:
            raise UsageError(f"{what} {value!r} is not a memory size", fix="e.g. 2TiB") from None
    from accelerate.utils import convert_file_size_to_int

    try:
        size = convert_file_size_to_int(text)
    except (ValueError, OverflowError):
        size = -1
    if size <= 0:
        raise UsageError(
            f"{what} {value!r} is not a memory size", fix=f"write it like {_nearest_size(text)}"
        )
    return size


def _nearest_size(text: str) -> str:
    """The accepted spelling closest to a refused size: keep the number, fix the unit."""
    m = re.match(r"\s*-?(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)", text)
    if not m:
        return "80GiB (or 80GB, 512MiB, 2TiB)"
    unit = (m.group(2) or "G").upper()
    return f"{m.group(1)}{unit}iB"


def parse_max_memory(caps: Mapping[Any, Any] | None, what: str = "max_memory") -> Caps:
    """{"0": "70GiB", "cuda:1": "70GiB", "cpu": "200GiB"} -> ((0, n), (1, n), ("cpu", n))."""
    out: list[tuple[int | str, int]] = []
    for key, value in (caps or {}).items():
        k = str(key)
        device = "cpu" if k == "cpu" else int(k) if k.isdigit() else gpu_index(k)
        if device is None:
            raise UsageError(
                f"{what} key {key!r} is not a device",
                fix='use a GPU index ("0"), "cuda:N" or "cpu"',
            )
        out.append((device, parse_size(value, f"{what}.{key}")))
    return tuple(sorted(out, key=lambda kv: (isinstance(kv[0], str), str(kv[0]))))
