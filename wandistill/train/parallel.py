"""Data parallelism for train: DDP (every rank holds the whole student) or FSDP2 (sharded).

`train.parallel = "fsdp"` applies torch's `fully_shard` to each transformer block (the classes a
diffusers model lists in `_no_split_modules`), then to the root (`DistillModule`: the student's
embeddings, output head and the feature projections), as torchtitan does. Parameters, gradients,
AdamW states and the EMA (built from the sharded parameters, so its shadows are DTensors of the
same layout) then hold 1/N of the student per rank; FSDP all-gathers a block's weights for its
forward and backward and reduce-scatters its gradients (fp32).

Mixed precision (`train.fsdp.param_dtype = "bf16"`) applies to the blocks only: they gather bf16
weights, compute in bf16 and return fp32; the root keeps its embeddings, the timestep
conditioning and the output head in fp32 (casting the root's inputs would round timesteps such
as 999 to 1000 in bf16, unlike the fp32 sampler at export).

On one process `fsdp` runs on a 1-rank group (1 shard: nothing is split, the code path is the
same), so a sharded checkpoint written by N ranks resumes on 1 and back.

Adapters (LoRA): wrap after the adapters are injected; frozen base weights are sharded like
the rest and only parameters with `requires_grad` reach the optimizer. Per-expert students
(`ExpertPair`): the blocks of each expert are sharded, and an expert's forward is a collective
every rank runs (`experts.is_sharded`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from wandistill.config import TrainConfig
from wandistill.runtime.dist import DistInfo, cuda_and_cpu
from wandistill.runtime.workarounds import ddp_no_buffer_sync, ddp_skip_init_sync
from wandistill.student import experts


def wrap_ddp(model: nn.Module, info: DistInfo) -> nn.Module:
    """DDP over the ranks, or `model` itself on one process. The ranks start from rank 0's
    weights: DDP broadcasts them all when it wraps, except for a model with frozen parameters
    (a LoRA student), where `broadcast_trained` sends only what is trained (see there)."""
    if not info.distributed:
        return model
    skip = {}
    if any(not p.requires_grad for p in model.parameters()):
        broadcast_trained(model)
        skip = ddp_skip_init_sync()
    return DistributedDataParallel(
        model,
        device_ids=[info.device.index] if info.device.type == "cuda" else None,
        **ddp_no_buffer_sync(),  # the only buffers are RoPE tables, equal on every rank
        **skip,
    )


@torch.no_grad()
def broadcast_trained(model: nn.Module) -> None:
    """Rank 0's trained parameters and buffers to every rank, one tensor at a time.

    What DDP's construction-time sync does, without the frozen parameters: a LoRA student's
    frozen base is the teacher's transformer, read from the same file on every rank, so it is
    equal already, and DDP's broadcast of it (through flattened bucket copies) is a transient of
    the base's size per rank, the peak of a LoRA run (docs/benchmarks.md, train memory). The
    adapter (and a resumed checkpoint) is the same on every rank by seed and by file; this makes
    it so by construction, as DDP would."""
    for p in model.parameters():
        if p.requires_grad:
            torch_dist.broadcast(p.data, src=0)
    for b in model.buffers():
        torch_dist.broadcast(b, src=0)


def blocks(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks FSDP shards one by one: the classes `_no_split_modules` names, in
    each transformer of the student (a per-expert `ExpertPair` has none itself: both experts'
    blocks, high-noise expert first)."""
    found = []
    for transformer in experts.transformers(module):
        names = set(getattr(transformer, "_no_split_modules", None) or [])
        found += [
            m
            for m in transformer.modules()
            if m is not transformer and any(c.__name__ in names for c in type(m).__mro__)
        ]
    return found


def shard(model: nn.Module, cfg: TrainConfig, info: DistInfo) -> int:
    """fully_shard each block of `model.student`, then `model` (the root). Returns the shard
    count (the world size)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not torch_dist.is_initialized():  # one process: its own 1-rank group (no peers)
        backend = "gloo"
        if info.device.type == "cuda":
            backend = cuda_and_cpu("nccl") if cfg.fsdp.cpu_offload else "nccl"
        store = torch_dist.HashStore()
        torch_dist.init_process_group(backend, store=store, rank=0, world_size=1, device_id=None)
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=info.device.type == "cuda")
        if cfg.fsdp.cpu_offload
        else OffloadPolicy()
    )
    block_mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if cfg.fsdp.param_dtype == "bf16" else None,
        reduce_dtype=torch.float32,
        output_dtype=torch.float32,
    )
    root_mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for block in blocks(model.student):
        fully_shard(block, mesh=mesh, mp_policy=block_mp, offload_policy=offload)
    # The root keeps its weights gathered from forward to backward
    fully_shard(
        model, mesh=mesh, mp_policy=root_mp, offload_policy=offload, reshard_after_forward=False
    )
    return info.world_size


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """No gradient all-reduce / reduce-scatter for the micro-steps inside (accumulation): DDP's
    `no_sync`, FSDP2's `set_requires_gradient_sync(False)`."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    elif isinstance(module, DistributedDataParallel):
        with module.no_sync():
            yield
    else:
        yield


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor is its own shard)."""
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a DTensor on every rank (e.g. the clipped gradient norm)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def gather_to_main(named: Iterable[tuple[str, torch.Tensor]], info: DistInfo) -> dict[str, Any]:
    """Rank 0 gets every tensor whole, on the CPU, gathered one tensor at a time (a collective
    per DTensor: every rank calls this); the other ranks get {} and never hold the whole model."""
    out: dict[str, torch.Tensor] = {}
    for name, t in named:
        whole = full(t.detach())
        if info.is_main:
            out[name] = whole.cpu()
        del whole
    return out


def describe(cfg: TrainConfig, info: DistInfo) -> list[str]:
    """The announce phrases for fsdp: the shard count, and on one process that nothing is
    split."""
    n = info.world_size
    offload = "on" if cfg.fsdp.cpu_offload else "off"
    how = f"(param_dtype {cfg.fsdp.param_dtype}, cpu_offload {offload})"
    if n == 1:
        return [
            "train: fsdp on 1 process: 1 shard,",
            f"the student is not split {how};",
            "launch `torchrun --nproc_per_node=N`",
            "to shard it N ways",
        ]
    return [
        "train: fsdp: student, gradients,",
        "optimizer state and EMA",
        f"in {n} shards, 1/{n} per rank",
        how,
    ]
