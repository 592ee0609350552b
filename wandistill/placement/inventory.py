"""The machine a plan may use: GPUs with their free memory, CPU RAM and disk.

`Inventory.detect()` reads what this process sees (torch.cuda.mem_get_info, /proc/meminfo under
a cgroup limit, df); `Inventory.fake(...)` and `Inventory.described(...)` (`plan --gpus 4
--gpu-mem 80GiB --cpu-mem 512GiB`) make one up, so a plan for 4x80 GB can be made on a laptop.
"""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from wandistill.errors import UsageError
from wandistill.placement.devices import GiB, gpu_index, parse_size

__all__ = ["GPU", "Inventory", "read_meminfo"]


class GPU(NamedTuple):
    """One visible accelerator: (name, total_bytes, free_bytes)."""

    name: str
    total_bytes: int
    free_bytes: int


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo as bytes ({"MemTotal": ..., "MemAvailable": ...}); {} where there is none."""
    info: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            key, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                info[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return info


def _cgroup_available() -> int | None:
    """Room left under a cgroup v2 memory limit (containers), or None if unlimited/unknown."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - used)


@dataclass(frozen=True, slots=True)
class Inventory:
    """The memory a plan may use: GPUs with their free memory, CPU RAM and disk."""

    gpus: tuple[GPU, ...] = ()
    """Visible GPUs in index order (cuda:0 first)."""
    cpu_bytes: int = 0
    """RAM available to this process (MemAvailable, capped by a cgroup limit)."""
    disk_bytes: int = 0
    """Free space on the filesystem that holds the offload folder."""
    source: str = "detected"
    """"detected" or a description of the fake."""

    @classmethod
    def detect(cls, disk_path: str | Path | None = None) -> Inventory:
        """What this process can see now: torch.cuda.mem_get_info per GPU, /proc/meminfo, df."""
        gpus: list[GPU] = []
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                free, total = torch.cuda.mem_get_info(i)
                gpus.append(GPU(torch.cuda.get_device_name(i), int(total), int(free)))
        info = read_meminfo()
        ram = info.get("MemAvailable", info.get("MemTotal", 0))
        cgroup = _cgroup_available()
        if cgroup is not None:
            ram = min(ram, cgroup) if ram else cgroup
        where = Path(disk_path or ".").absolute()  # its nearest existing folder
        disk = shutil.disk_usage(next(p for p in (where, *where.parents) if p.exists())).free
        return cls(gpus=tuple(gpus), cpu_bytes=ram, disk_bytes=disk)

    @classmethod
    def fake(
        cls,
        gpus: int = 0,
        gpu_gib: float = 80.0,
        *,
        cpu_gib: float = 256.0,
        disk_gib: float = 1000.0,
        gpu_free_gib: float | None = None,
        gpu_name: str | None = None,
    ) -> Inventory:
        """`gpus` identical GPUs of `gpu_gib` (free: `gpu_free_gib`, default ~all but 0.5 GiB)."""
        free = gpu_free_gib if gpu_free_gib is not None else max(0.0, gpu_gib - 0.5)
        name = gpu_name or f"fake {gpu_gib:g} GB GPU"
        gpu = GPU(name, int(gpu_gib * GiB), int(free * GiB))
        desc = f"fake: {gpus}x{gpu_gib:g} GiB GPU, {cpu_gib:g} GiB RAM, {disk_gib:g} GiB disk"
        return cls((gpu,) * gpus, int(cpu_gib * GiB), int(disk_gib * GiB), desc)

    @classmethod
    def described(
        cls, *, gpus: int | None, gpu_mem: str | None, cpu_mem: str | None, disk: str | None
    ) -> Inventory:
        """A machine described on the command line (`plan --gpus 4 --gpu-mem 80GiB --cpu-mem
        512GiB [--disk 2TiB]`), sizes in any form `placements.parse_size` accepts. Each GPU has
        its size minus 0.5 GiB free (as `fake`); the disk defaults to 1 TiB."""
        if gpus is not None and gpus < 0:
            raise UsageError(f"--gpus {gpus} must be 0 or more", fix="e.g. --gpus 4")
        if gpu_mem is not None and not gpus:
            raise UsageError(
                f"--gpu-mem {gpu_mem} describes GPUs but --gpus is {gpus or 0}",
                fix=f"add --gpus N (e.g. --gpus 1 --gpu-mem {gpu_mem})",
            )
        if gpus and gpu_mem is None:
            raise UsageError(
                f"--gpus {gpus} needs the memory of each GPU", fix="add e.g. --gpu-mem 80GiB"
            )
        if cpu_mem is None:
            raise UsageError(
                "a described machine needs its RAM (--cpu-mem)", fix="add e.g. --cpu-mem 512GiB"
            )
        gpu_bytes = parse_size(gpu_mem, "--gpu-mem") if gpus else 0
        ram = parse_size(cpu_mem, "--cpu-mem")
        room = parse_size(disk or "1TiB", "--disk")
        gpu = GPU(f"{gpu_bytes / GiB:g} GiB GPU", gpu_bytes, max(0, gpu_bytes - GiB // 2))
        desc = (
            f"described: {gpus or 0}x{gpu_bytes / GiB:.1f} GiB GPU, {ram / GiB:.1f} GiB RAM, "
            f"{room / GiB:.0f} GiB disk{'' if disk else ' (default)'}"
        )
        return cls((gpu,) * (gpus or 0), ram, room, desc)

    @classmethod
    def cpu_only(cls, cpu_gib: float = 64.0, disk_gib: float = 1000.0) -> Inventory:
        return cls.fake(0, cpu_gib=cpu_gib, disk_gib=disk_gib)

    def only(self, index: int) -> Inventory:
        """The same machine seen by one torchrun rank that owns GPU `index` (as its cuda:0)."""
        return replace(self, gpus=(self.gpus[index],), source=f"{self.source}, GPU {index} only")

    @property
    def has_cuda(self) -> bool:
        return bool(self.gpus)

    def devices(self) -> list[str]:
        return [f"cuda:{i}" for i in range(len(self.gpus))] + ["cpu", "disk"]

    def available(self, device: str) -> int:
        if device == "cpu":
            return self.cpu_bytes
        if device == "disk":
            return self.disk_bytes
        index = gpu_index(device)
        if index is None:
            raise KeyError(f"no device {device!r} in this inventory")
        return self.gpus[index].free_bytes if index < len(self.gpus) else 0  # a GPU it lacks
