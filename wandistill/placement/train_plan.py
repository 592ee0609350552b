"""Memory plan for `train`: per-rank bytes of each choice, and which choices fit the machine.

A row is one way to train the same student on the same batches (`Choice`: DDP or FSDP2, its
parameter dtype and CPU offload, gradient checkpointing, a LoRA rank, the micro-batch), priced
per rank on an `Inventory` (detected, or described with `--gpus --gpu-mem --cpu-mem`):

    weights      DDP: every parameter, fp32 (autocast computes in bf16, the weights stay fp32).
                 FSDP: a 1/N fp32 shard, plus the unsharded copies being computed with (the
                 blocks' root parameters and two blocks: the current one and the prefetched one)
                 at `fsdp.param_dtype`. LoRA: the frozen base as above, plus the adapter (under
                 DDP nothing more: `train.parallel.wrap_ddp` broadcasts the adapter alone, so
                 DDP's start-up copy of the base, +1 base per rank, never happens).
    gradients    fp32 per trained parameter; DDP keeps a second copy in its all-reduce buckets
                 (`gradient_as_bucket_view` is off) once there are 2+ ranks; FSDP: a 1/N shard.
    optimizer    AdamW's exp_avg + exp_avg_sq, fp32: 8 bytes per trained parameter (FSDP: 1/N).
    EMA          fp32 copy of the trained parameters (FSDP: sharded like the student).
    activations  `train_size.activation_bytes` (calibrated, stated there), plus autocast's cache
                 of bf16 copies of the trained fp32 weights (2 bytes each) under bf16 autocast.
    overhead     CUDA context + allocator slack per GPU (1 GiB). The process itself (the
                 interpreter and the libraries train imports: torch, diffusers, transformers,
                 peft) is not in a row's total: its RAM is reserved per rank from the node's
                 before anything is priced (`devices.CPU_OVERHEAD`, 2 GiB; measured beside the
                 plan: the libraries beyond torch are 102 MiB resident per rank, torch and the
                 interpreter ~285 MiB; tests/bench/train_memory.py, which takes its baseline
                 after those imports for that reason).
    checkpoint   host RAM while a checkpoint is written: `safetensors.torch.save` builds each
                 file in memory and holds it twice at its peak (its Rust buffer, then the Python
                 `bytes` copy of it; measured: a 256 MiB file peaks at +512 MiB RSS). The largest
                 file is, under DDP, AdamW's states on rank 0 (8 bytes per trained parameter);
                 under FSDP, a file of the rank's DCP shard: the shard (the rank's student, EMA,
                 AdamW states: 16 bytes per trained parameter over N) split into files of at
                 most SHARD_FILE_BYTES (`train/dcp.py`), or one tensor's shard where that is
                 larger. So 2x that file (measured on the CPU, where it adds to the peak:
                 tests/bench/train_memory.py, docs/benchmarks.md). On GPUs it is RAM, and the
                 tensors' CPU copy may add one more file (not measured: no GPU here; not
                 counted).

`per-expert` students (Wan 2.2) hold two students' states; a sample runs through one of them, so
activations count once. The sum is a peak bound: on a GPU, gradients and activations overlap in
backward only partly, so a row that fits here fits there. CPU offload moves the FSDP shards of
weights, gradients and optimizer states (and the EMA) to CPU RAM, shared by the node's ranks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wandistill.placement.devices import CPU_OVERHEAD, CUDA_OVERHEAD, GiB
from wandistill.placement.inventory import Inventory
from wandistill.placement.train_size import StudentSize, TrainShape, activation_bytes

if TYPE_CHECKING:
    from wandistill.config import TrainConfig

__all__ = [
    "Choice",
    "RankMemory",
    "TrainPlan",
    "choice_of",
    "make_train_plan",
    "rank_memory",
    "render_train_plan",
]

#: LoRA rank a plan proposes when the recipe trains a full student.
PROPOSED_LORA_RANK = 64

#: Largest file of a rank's sharded checkpoint (`train/dcp.py` splits a rank's shard into files
#: of at most this many bytes, so the host RAM a checkpoint write takes is bounded by it).
SHARD_FILE_BYTES = GiB


@dataclass(frozen=True, slots=True)
class Choice:
    """One way to train: the recipe keys that change memory, and how many ranks share it."""

    parallel: str = "ddp"
    param_dtype: str = "fp32"
    cpu_offload: bool = False
    checkpointing: bool = False
    bf16: bool = False
    """train.mixed_precision = bf16 (autocast)."""
    lora_rank: int = 0
    batch_size: int = 1
    experts: int = 1
    """Students held at once: 2 for per-expert."""

    def settings(self) -> dict[str, str]:
        """Recipe key -> TOML value for every key this choice sets."""
        return {
            "train.parallel": f'"{self.parallel}"',
            "train.fsdp.param_dtype": f'"{self.param_dtype}"',
            "train.fsdp.cpu_offload": str(self.cpu_offload).lower(),
            "train.gradient_checkpointing": str(self.checkpointing).lower(),
            "train.student.lora.rank": str(self.lora_rank),
            "train.batch_size": str(self.batch_size),
        }

    def flags(self, relative_to: Choice | None = None) -> str:
        """The --set flags that select this choice (only those that differ from `relative_to`):
        what the plan and the OOM message print."""
        mine, theirs = self.settings(), relative_to.settings() if relative_to else {}
        if self.parallel == "ddp":
            mine = {k: v for k, v in mine.items() if not k.startswith("train.fsdp.")}
        return " ".join(f"--set {k}={v}" for k, v in mine.items() if theirs.get(k) != v)

    def label(self) -> str:
        """Short, for an 80-column table: "fsdp bf16 offload ckpt lora64 b1"."""
        bits = [self.parallel]
        if self.parallel == "fsdp":
            bits += [self.param_dtype] + (["offload"] if self.cpu_offload else [])
        bits += ["ckpt"] if self.checkpointing else []
        bits += [f"lora{self.lora_rank}"] if self.lora_rank else []
        return " ".join([*bits, f"b{self.batch_size}"])


def choice_of(cfg: TrainConfig) -> Choice:
    """The choice a recipe's [train] makes."""
    return Choice(
        parallel=cfg.parallel,
        param_dtype=cfg.fsdp.param_dtype,
        cpu_offload=cfg.fsdp.cpu_offload,
        checkpointing=cfg.gradient_checkpointing,
        bf16=cfg.mixed_precision == "bf16",
        lora_rank=cfg.student.lora.rank,
        batch_size=cfg.batch_size,
        experts=2 if cfg.student.experts == "per-expert" else 1,
    )


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Bytes one rank holds for one choice, on its device and in CPU RAM."""

    choice: Choice
    world_size: int
    weights: int
    gradients: int
    optimizer: int
    ema: int
    activations: int
    activations_other: int
    """The activations with checkpointing flipped (the with/without figure)."""
    overhead: int
    offloaded: int
    """CPU RAM this rank's offloaded shards take (FSDP cpu_offload)."""
    checkpoint: int
    """Host RAM while a checkpoint is written (module docstring)."""
    device: str
    available: int
    """Free memory of the device ("cpu": RAM shared by this node's ranks, per rank)."""
    cpu_available: int

    @property
    def total(self) -> int:
        """Peak bytes on the rank's device."""
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.ema
            + self.activations
            + self.overhead
            + (self.checkpoint if self.device == "cpu" else 0)
        )

    @property
    def ram(self) -> int:
        """CPU RAM this rank needs besides its device (offloaded shards, checkpoint buffers)."""
        return self.offloaded + (self.checkpoint if self.device != "cpu" else 0)

    @property
    def fits(self) -> bool:
        return self.total <= self.available and self.ram <= self.cpu_available

    def why(self) -> str:
        """One line: the figure against the room, and what does not fit."""
        have = f"{self.total / GiB:.1f} GiB of {self.available / GiB:.1f} GiB on {self.device}"
        if self.ram and self.device != "cpu":
            have += f"; {self.ram / GiB:.1f} GiB of {self.cpu_available / GiB:.1f} GiB RAM"
        return have

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self) | {"ram": self.ram, "total": self.total, "fits": self.fits}
        data["choice"] |= {"label": self.choice.label()}
        return data


def _room(inventory: Inventory, world: int) -> tuple[str, int, int]:
    """(device, bytes one rank may use there, RAM one rank may use): GPUs are one per rank; the
    CPU's RAM is shared by the ranks of the node (torchrun ranks on one machine)."""
    local = max(1, min(world, len(inventory.gpus)) if inventory.gpus else world)
    ram = max(0, inventory.cpu_bytes - local * CPU_OVERHEAD) // local
    if inventory.gpus:
        return "cuda", min(g.free_bytes for g in inventory.gpus), ram
    return "cpu", ram, ram


def _largest_checkpoint_file(size: StudentSize, trained: int, shard: int, fsdp: bool) -> int:
    """Bytes of the largest file a rank writes in a checkpoint (module docstring): DDP, AdamW's
    states (rank 0); FSDP, the rank's shard (16 bytes per trained parameter over N) in files of
    at most SHARD_FILE_BYTES, or one tensor's shard where that is larger."""
    if not fsdp:
        return 8 * trained
    whole = 16 * trained // shard
    return min(whole, max(SHARD_FILE_BYTES, 4 * size.largest_param // shard))


def rank_memory(
    size: StudentSize, shape: TrainShape, choice: Choice, inventory: Inventory, world: int
) -> RankMemory:
    """Price one choice per rank (module docstring for each term)."""
    shape = dataclasses.replace(shape, batch_size=choice.batch_size)
    if choice.lora_rank != size.lora_rank:
        raise ValueError("size and choice disagree on the LoRA rank; price the size for it")
    fsdp = choice.parallel == "fsdp"
    shard = world if fsdp else 1
    trained = size.trainable * choice.experts
    frozen = (size.params if size.lora_rank else 0) * choice.experts
    param_bytes = 2 if fsdp and choice.param_dtype == "bf16" else 4
    weights = 4 * (trained + frozen) // shard
    if fsdp:  # unsharded copies in compute: the root's own parameters + two blocks in flight
        outside = size.params - size.num_blocks * size.block_params
        weights += param_bytes * (outside + 2 * size.block_params)
    grads = 4 * trained // shard
    if not fsdp and world > 1:
        grads *= 2  # DDP's all-reduce buckets
    optimizer, ema = 8 * trained // shard, 4 * trained // shard
    kw = {"bf16": choice.bf16 or param_bytes == 2}
    act = activation_bytes(size, shape, checkpointing=choice.checkpointing, **kw)
    other = activation_bytes(size, shape, checkpointing=not choice.checkpointing, **kw)
    if choice.bf16 and param_bytes == 4:  # autocast caches bf16 copies of trained fp32 weights
        act += 2 * size.trainable
        other += 2 * size.trainable
    device, room, ram = _room(inventory, world)
    offloaded = 0
    if fsdp and choice.cpu_offload:
        offloaded = 4 * (trained + frozen) // shard + grads + optimizer + ema
        weights -= 4 * (trained + frozen) // shard
        grads = optimizer = ema = 0
    overhead = CUDA_OVERHEAD if device == "cuda" else 0
    checkpoint = 2 * _largest_checkpoint_file(size, trained, shard, fsdp)
    return RankMemory(
        choice, world, weights, grads, optimizer, ema, act, other, overhead, offloaded,
        checkpoint, device, room, ram,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class TrainPlan:
    """The requested choice and the alternatives, priced on one inventory."""

    student: str
    size: StudentSize
    shape: TrainShape
    inventory: Inventory
    world_size: int
    requested: RankMemory
    rows: tuple[RankMemory, ...]
    """Alternatives in the order to try them: FSDP, offload, checkpointing, LoRA, batch."""

    def next_lever(self) -> RankMemory | None:
        """The first alternative that fits (None: none does)."""
        return next((r for r in self.rows if r.fits), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "student": self.student,
            "params": self.size.params,
            "trained_params": self.size.trainable,
            "block_params": self.size.block_params,
            "shape": dataclasses.asdict(self.shape) | {"tokens": self.shape.tokens()},
            "inventory": self.inventory.source,
            "world_size": self.world_size,
            "requested": self.requested.to_json(),
            "alternatives": [r.to_json() for r in self.rows],
        }


def _alternatives(base: Choice) -> list[Choice]:
    """Levers in the order that costs least speed for the most memory: FSDP (fp32, then bf16
    parameters), CPU offload, checkpointing, LoRA, half the micro-batch; each on top of the
    previous ones, and each alone on top of the recipe's choice."""
    rep = dataclasses.replace
    fsdp = rep(base, parallel="fsdp")
    fsdp_bf16 = rep(fsdp, param_dtype="bf16")
    ladder = [
        rep(base, parallel="ddp"),
        fsdp,
        fsdp_bf16,
        rep(fsdp_bf16, checkpointing=True),
        rep(fsdp_bf16, checkpointing=True, cpu_offload=True),
        rep(base, checkpointing=True),
        rep(base, lora_rank=base.lora_rank or PROPOSED_LORA_RANK, checkpointing=True),
        rep(base, batch_size=max(1, base.batch_size // 2)),
    ]
    return [c for c in dict.fromkeys(ladder) if c != base]


def make_train_plan(
    student_config: Mapping[str, Any],
    choice: Choice,
    shape: TrainShape,
    inventory: Inventory,
    *,
    world_size: int | None = None,
    lora_targets: tuple[str, ...] = (),
    student: str = "student",
) -> TrainPlan:
    """Price `choice` and its alternatives for a student config (WanTransformer3DModel keys).

    `world_size`: ranks (default: the inventory's GPUs, 1 without any)."""
    world = world_size or max(1, len(inventory.gpus))

    @functools.cache
    def size(lora_rank: int) -> StudentSize:
        return StudentSize.from_config(student_config, lora_rank=lora_rank, targets=lora_targets)

    def priced(c: Choice) -> RankMemory:
        return rank_memory(size(c.lora_rank), shape, c, inventory, world)

    rows = tuple(priced(c) for c in _alternatives(choice))
    return TrainPlan(
        student=student,
        size=size(choice.lora_rank),
        shape=shape,
        inventory=inventory,
        world_size=world,
        requested=priced(choice),
        rows=rows,
    )


def render_train_plan(plan: TrainPlan) -> list[Any]:
    """Rich renderables: the student and batch, then one row per choice (GiB per rank)."""
    from rich.table import Table
    from rich.text import Text

    head = Table(title=f"train memory plan: {plan.student}", show_header=False)
    head.add_row("student", plan.size.describe())
    head.add_row("batch", plan.shape.describe())
    head.add_row("machine", f"{plan.inventory.source}; {plan.world_size} rank(s)")
    small = plan.requested.total - plan.requested.overhead < GiB  # tiny recipes: MiB
    unit, name = (1 << 20, "MiB") if small else (GiB, "GiB")

    def _gib(n: int) -> str:
        return f"{n / unit:.1f}"

    t = Table(
        title=f"per rank, {name}",
        caption="* the recipe's choice; act: with/without checkpointing; total/room",
    )
    for col in ("choice", "weights", "grads", "AdamW", "EMA", "act", "total", "fits"):
        t.add_column(col, justify="left" if col == "choice" else "right", overflow="fold")
    for i, r in enumerate((plan.requested, *plan.rows)):
        pair = (r.activations, r.activations_other)
        ckpt_on, ckpt_off = pair if r.choice.checkpointing else pair[::-1]
        extra = f" +{_gib(r.offloaded)} in RAM" if r.offloaded else ""
        fits = Text("yes", style="green") if r.fits else Text("no", style="red")
        t.add_row(
            ("* " if i == 0 else "") + r.choice.label() + extra,
            _gib(r.weights),
            _gib(r.gradients),
            _gib(r.optimizer),
            _gib(r.ema),
            f"{_gib(ckpt_on)}/{_gib(ckpt_off)}",
            f"{_gib(r.total)}/{_gib(r.available)}",
            fits,
        )
    out: list[Any] = [head, t]
    lever = plan.next_lever()
    if plan.requested.fits:
        out.append(Text(f"requested fits: {plan.requested.why()}"))
    elif lever is not None:
        out.append(Text(f"requested does not fit ({plan.requested.why()}); first that fits: "))
        out.append(Text(f"  {lever.choice.flags(plan.requested.choice)}  ({lever.why()})"))
    else:
        out.append(
            Text(f"nothing listed fits ({plan.requested.why()}); more GPUs or a smaller student")
        )
    out.append(
        Text(
            "note: weights, gradients, AdamW and EMA exact from the parameter count; activations "
            "estimated (wandistill/placement/train_size.py); per GPU +1 GiB CUDA context",
            style="dim",
        )
    )
    return out
