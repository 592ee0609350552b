"""The run's parts, built: the student (LoRA, gradient checkpointing, placed or sharded over the
ranks) and this rank's training reader over the caches."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from wandistill.cache.training import TrainingReader
from wandistill.config import TrainConfig
from wandistill.runtime import dist
from wandistill.student import experts, lora
from wandistill.student.config import width
from wandistill.student.model import DistillModule
from wandistill.student.schedule import ObjectivePlan
from wandistill.train import parallel

if TYPE_CHECKING:
    from wandistill.train.inputs import Plan


def build_model(cfg: TrainConfig, plan: Plan, info: dist.DistInfo) -> DistillModule:
    """The student (LoRA added, checkpointing on) and the distillation wrapper, placed on the
    device or sharded over the ranks (FSDP2)."""
    student = experts.build(cfg.student, plan.student_config, plan.manifest.settings, seed=cfg.seed)
    if cfg.student.lora.enabled:  # before any wrapper (DDP here, FSDP2's fully_shard) sees it
        lora.add_lora(student, cfg.student.lora)
    if cfg.gradient_checkpointing:
        student.enable_gradient_checkpointing()
    feature_map = cfg.loss.feature_map if cfg.loss.feature > 0 else {}
    model = DistillModule(student, feature_map, width(plan.student_config), plan.teacher_width)
    model.train()
    if cfg.parallel == "fsdp":  # before the optimizer and EMA: they hold the sharded weights
        # fully_shard moves each block to the device as it shards it: no rank's device ever
        # holds the whole student
        parallel.shard(model, cfg, info)
    else:
        model.to(info.device)
    return model


def build_reader(
    cfg: TrainConfig,
    plan: Plan,
    info: dist.DistInfo,
    *,
    follow: bool,
    skip_corrupt: bool,
) -> TrainingReader:
    """This rank's equal share of every epoch over the run's caches, the ones `validate`
    opened (`plan.caches`). A cache still being written is read again first: the reader starts
    from what is committed now, after the join, as a freshly opened cache would."""
    for store in plan.caches:
        if not store.complete:
            store.refresh()
    return TrainingReader(
        list(plan.caches),
        weights=cfg.cache_weights,
        batch_size=cfg.batch_size,
        rank=info.rank,
        world_size=info.world_size,
        grad_accum=cfg.grad_accum,
        seed=cfg.seed,
        fields=plan.fields,
        slots=plan.objectives.slots,
        next_slots=plan.objectives.next_slots(),
        follow=follow,
        poll_interval=cfg.follow_poll_interval,
        follow_timeout=cfg.follow_timeout or None,
        sync=follow_sync(info) if follow and info.distributed else None,
        agree=all_agree(info) if follow and info.distributed else None,
        num_threads=cfg.data_threads,
        skip_corrupt=skip_corrupt,
        pad="batch",  # padded to max_sequence_length on the device, in forward()
    )


def follow_sync(info: dist.DistInfo):  # noqa: ANN201 - returns the reader's SyncFn
    """The training reader's follow-mode agreement: shards every rank sees, complete if all do."""

    def sync(names: list[str], complete: bool) -> tuple[list[str], bool]:
        views = dist.all_gather_json(info, {"names": names, "complete": complete})
        common = set(views[0]["names"]).intersection(*(v["names"] for v in views[1:]))
        return sorted(common), all(v["complete"] for v in views)

    return sync


def all_agree(info: dist.DistInfo) -> Callable[[bool], bool]:
    """A vote every rank casts at the same point: True on every rank iff True on all of them
    (follow mode stops for a gone writer only when every rank saw it gone)."""

    def agree(mine: bool) -> bool:
        return all(bool(v) for v in dist.all_gather_json(info, mine))

    return agree


def objective_masks(
    cfg: TrainConfig, objectives: ObjectivePlan, device: torch.device
) -> dict[str, torch.Tensor]:
    """Objective -> bool per recorded slot. `output` is reported at every sample even at weight
    0 (a diagnostic; it only enters the loss when weighted)."""
    masks = {n: objectives.slot_mask(n).to(device) for n in cfg.loss.weights()}
    if cfg.loss.output == 0:
        masks["output"] = torch.ones_like(masks["output"])
    return masks
