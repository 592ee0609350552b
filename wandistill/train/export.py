"""The run's result: `save_pretrained` folders that diffusers loads directly.

`<out>/student/` holds the trained weights and `<out>/student_ema/` their EMA, each a diffusers
`WanTransformer3DModel` folder (config.json + diffusion_pytorch_model.safetensors), so
`WanTransformer3DModel.from_pretrained(out / "student")` loads it and
`WanPipeline.from_pretrained(teacher, transformer=student)` samples with it. Each folder is
written under a temp name and swapped into place. `<out>/sampling.json` is written last: K, the
student's scheduler and the teacher it came from, all that `wandistill export` needs besides the
weights; its presence marks a finished run.

A LoRA student's folders hold its adapter only, `pytorch_lora_weights.safetensors` in diffusers'
LoRA format (`wandistill.student.lora.save_lora_folder`); its base is the teacher's transformer
that sampling.json's `lora` names. Per-expert students' folders hold `transformer/`,
`transformer_2/` (each a model folder, or each one LoRA file) and `experts.json`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from wandistill.io.fsutil import atomic_write_json, fsync_tree, make_temp_dir, publish
from wandistill.runtime.dist import DistInfo, barrier
from wandistill.student import experts, lora
from wandistill.train.ema import EMA
from wandistill.train.parallel import gather_to_main

STUDENT = "student"
STUDENT_EMA = "student_ema"
SAMPLING = "sampling.json"


def _save_folder(
    model: nn.Module, final: Path, adapter: dict[str, torch.Tensor] | None = None
) -> None:
    """`adapter`: a sharded LoRA student's gathered adapter (`lora.save_lora_folder`'s state)."""
    tmp = make_temp_dir(final.parent, final.name)
    try:
        if lora.is_lora(model):  # the adapter alone, as a diffusers LoRA file
            lora.save_lora_folder(model, tmp, adapter)
        else:
            model.save_pretrained(tmp, safe_serialization=True)  # type: ignore[operator]
        fsync_tree(tmp)  # per-expert students: transformer/, transformer_2/ too
        if final.exists():  # park the old result, swap, then delete it
            old = make_temp_dir(final.parent, f"{final.name}.old")  # a temp name: see outputs
            os.replace(final, old)
            publish(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@torch.no_grad()
def export_pretrained(
    student: nn.Module, ema: EMA, out: Path, info: DistInfo, sampling: dict[str, Any]
) -> tuple[Path, Path]:
    """Rank 0 writes student/ then student_ema/ (the student's weights are replaced by the EMA
    for the second save: training is over, and no second copy of the model is needed), then
    sampling.json."""
    paths = (out / STUDENT, out / STUDENT_EMA)
    if experts.is_sharded(student):
        _export_sharded(student, ema, paths, info)
        if info.is_main:
            atomic_write_json(out / SAMPLING, sampling)
        barrier(info)
        return paths
    if info.is_main:
        (out / SAMPLING).unlink(missing_ok=True)  # not finished until both folders are new
        _save_folder(student, paths[0])
        ema.copy_to(student)
        _save_folder(student, paths[1])
        atomic_write_json(out / SAMPLING, sampling)
    barrier(info)
    return paths


def _export_sharded(student: nn.Module, ema: EMA, paths: tuple[Path, Path], info: DistInfo) -> None:
    """FSDP: gather the student, then its EMA, to rank 0 (on the CPU, one tensor at a time; no
    other rank ever holds the whole model) and save each in the folder the unsharded export
    writes. A LoRA student: only its adapter is gathered (the EMA's shadows carry the same
    names) and written as its LoRA file(s) by the sharded model itself; a full student: into a
    plain model (per-expert: a plain `ExpertPair`) built on the meta device around the gathered
    tensors (no second copy)."""
    adapter = lora.is_lora(student)
    if info.is_main:
        (paths[0].parent / SAMPLING).unlink(missing_ok=True)
    own = lora.trainable_state_dict(student) if adapter else student.state_dict()
    for named, path in ((own.items(), paths[0]), (ema.state_dict().items(), paths[1])):
        whole = gather_to_main(named, info)
        if info.is_main and adapter:
            _save_folder(student, path, whole)
        elif info.is_main:
            plain = _meta_copy(student)
            plain.load_state_dict(whole, strict=True, assign=True)
            _save_folder(plain, path)
            del plain
        del whole


def _meta_copy(student: nn.Module) -> nn.Module:
    """An empty (meta device) unsharded model of the student's classes and configs."""
    with torch.device("meta"):
        if isinstance(student, experts.ExpertPair):
            return experts.ExpertPair(
                *(_meta_copy(t) for t in experts.transformers(student)),
                student.boundary_ratio,
                student.num_train_timesteps,
            )
        # the model's own class (fully_shard swaps in an `FSDP<name>` subclass)
        own = next(c for c in type(student).__mro__ if not issubclass(c, FSDPModule))
        return own.from_config(student.config)  # type: ignore[attr-defined]
