"""Distributed setup in one place: torchrun environment -> process group -> DistInfo.

Both stages use it: precompute to split prompts and gather shard commits, train for DDP. Model and
cache code never import torch.distributed. Collectives that carry Python objects go through JSON
bytes in uint8 tensors, never `*_object` collectives (those pickle).

Failure contract: a rank that raises exits non-zero straight away (no barrier on the error path);
torchrun then stops every other worker, so no rank waits forever in a collective.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from wandistill.errors import UsageError


@dataclass(frozen=True, slots=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    """None when running as a single process without a process group."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def init(device: str = "auto", *, timeout_s: float = 1800.0) -> DistInfo:
    """Join the torchrun job if there is one; pick this rank's device.

    `device`: "auto" (cuda:LOCAL_RANK when CUDA is available, else cpu), "cpu" or "cuda".
    The backend follows the device: nccl for CUDA, gloo for CPU.
    """
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    want_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise UsageError(
            "CUDA was asked for but this machine has no usable GPU",
            fix="run on a GPU machine, or use the CPU (e.g. --set train.device=cpu)",
        )
    if want_cuda:
        if local_rank >= torch.cuda.device_count():
            raise UsageError(
                f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible",
                fix="lower --nproc_per_node or set CUDA_VISIBLE_DEVICES",
            )
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    backend: str | None = None
    if world > 1:
        backend = "nccl" if want_cuda else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(
                backend=backend,
                timeout=datetime.timedelta(seconds=timeout_s),
                device_id=dev if want_cuda else None,
            )
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev, backend=backend)


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.distributed:
        if info.backend == "nccl":
            dist.barrier(device_ids=[info.device.index])
        else:
            dist.barrier()


def _bytes_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        if data
        else torch.empty(0, dtype=torch.uint8, device=device)
    )


def all_gather_json(info: DistInfo, obj: Any) -> list[Any]:
    """Every rank's JSON-able `obj`, in rank order (no pickle involved)."""
    if not info.distributed:
        return [obj]
    payload = json.dumps(obj).encode()
    size = torch.tensor([len(payload)], device=info.device)
    sizes = [torch.zeros_like(size) for _ in range(info.world_size)]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    buf = torch.zeros(longest, dtype=torch.uint8, device=info.device)
    buf[: len(payload)] = _bytes_tensor(payload, info.device)
    bufs = [torch.zeros_like(buf) for _ in range(info.world_size)]
    dist.all_gather(bufs, buf)
    return [
        json.loads(bytes(b[: int(s.item())].cpu().tolist()))
        for b, s in zip(bufs, sizes, strict=True)
    ]


def broadcast_json(info: DistInfo, obj: Any, src: int = 0) -> Any:
    return all_gather_json(info, obj if info.rank == src else None)[src]


def all_reduce_max(info: DistInfo, value: float) -> float:
    if not info.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def follow_sync(info: DistInfo):  # noqa: ANN201 - returns the reader's SyncFn
    """The training reader's follow-mode agreement: shards every rank sees, complete if all do."""

    def sync(names: list[str], complete: bool) -> tuple[list[str], bool]:
        views = all_gather_json(info, {"names": names, "complete": complete})
        common = set(views[0]["names"]).intersection(*(v["names"] for v in views[1:]))
        return sorted(common), all(v["complete"] for v in views)

    return sync
