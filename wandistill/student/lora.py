"""LoRA students: peft adapters on the teacher's (frozen) transformer, the way diffusers adds them.

A LoRA student is the teacher's `WanTransformer3DModel` (read lazily by `student.init`, every
block) with `add_adapter(peft.LoraConfig(...))` (diffusers' `PeftAdapterMixin`, which calls
peft's `inject_adapter_in_model` and freezes everything but the adapters). Only the adapters
are trained; the functions below are the one place the train loop, checkpoints, EMA and export
ask "which tensors are the student's own":

- `trainable_state_dict(model)`: what a checkpoint and the EMA hold. A full student: its whole
  `state_dict()` (unchanged from before LoRA). A LoRA student: its `requires_grad` parameters
  under their module names (`blocks.0.attn1.to_q.lora_A.default.weight`), i.e. the names
  FSDP2 / torch.distributed.checkpoint see, so a sharded branch can save the same keys.
- `load_trainable_state_dict(model, sd)`: the inverse, strict about keys and shapes.
- `adapter_state_dict(model)` / `save_lora_folder` / `load_lora_file`: the diffusers LoRA file
  (`pytorch_lora_weights.safetensors`, `transformer.`-prefixed keys without the adapter name,
  the LoraConfig as metadata), as `get_peft_model_state_dict` + `WanPipeline.save_lora_weights`
  write it, so stock `WanPipeline.load_lora_weights` applies it to the teacher folder.

`add_lora` must run before any wrapping (DDP, FSDP2's `fully_shard`): wrappers then see the
adapter parameters as ordinary parameters and the frozen base as parameters without gradients.

Per-expert students (`experts.ExpertPair`): every function here takes the pair too. Each expert
gets its own adapter on its own base (`experts.transformers`), its trainable names are
`transformer.*` / `transformer_2.*`, and `save_lora_folder` writes one LoRA file per expert
(`transformer/`, `transformer_2/`, plus `experts.json`), each in the one-transformer format, so
stock diffusers loads the second with `load_lora_weights(..., load_into_transformer_2=True)`.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from wandistill.config import StudentConfig, StudentLoraConfig
from wandistill.errors import UsageError
from wandistill.student import experts

ADAPTER = "default"
"""peft's adapter name (what diffusers' add_adapter uses when none is given)."""
LORA_FILE = "pytorch_lora_weights.safetensors"
"""diffusers' LoRA weight name (LORA_WEIGHT_NAME_SAFE)."""
PREFIX = "transformer."
"""WanPipeline's LoRA keys name the component they load into."""


def is_lora(model: nn.Module) -> bool:
    """True once `add_lora` (or diffusers' add_adapter) has put an adapter on `model` (a pair:
    on its experts)."""
    return any(getattr(m, "_hf_peft_config_loaded", False) for m in experts.transformers(model))


def lora_config(cfg: StudentLoraConfig) -> Any:
    """The peft LoraConfig of a `[train.student.lora]` section."""
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.scale_alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        init_lora_weights=True,  # B = 0: the student starts exactly as the teacher
    )


def check_targets(model: nn.Module, targets: list[str]) -> None:
    """Every target names at least one nn.Linear of `model` (peft's rule: the full name or a
    suffix at a dot); otherwise one error naming the nearest module names. Runs on a meta-device
    model in validation, before anything is written."""
    names = [  # the model's own nn.Linear modules: what LoRA can adapt
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and ".lora_" not in n and not n.endswith("base_layer")
    ]
    parts = [n.split(".") for n in names]
    suffixes = sorted({".".join(p[i:]) for p in parts for i in range(len(p)) if not p[i].isdigit()})
    problems = []
    for target in targets:
        if not any(n == target or n.endswith(f".{target}") for n in names):
            near = difflib.get_close_matches(target, suffixes, n=4, cutoff=0.4)
            problems.append(f"{target!r} (nearest: {', '.join(near) or 'none'})")
    if problems:
        raise UsageError(
            f"student.lora.target_modules names no linear of the student: {'; '.join(problems)}",
            fix="use names of the Wan transformer's linears, e.g. to_q, to_k, to_v, to_out.0, "
            "ffn.net.0.proj, ffn.net.2",
        )


def add_lora(model: nn.Module, cfg: StudentLoraConfig) -> int:
    """Freeze `model` and inject LoRA adapters (diffusers' add_adapter, i.e. peft's
    inject_adapter_in_model), one per transformer (a per-expert pair: each expert its own, on
    its own base); returns the number of trainable parameters. Call before DDP / FSDP2 wrap the
    model."""
    model.requires_grad_(False)
    for transformer in experts.transformers(model):
        check_targets(transformer, list(cfg.target_modules))
        transformer.add_adapter(lora_config(cfg), adapter_name=ADAPTER)  # type: ignore[operator]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable, "peft injected no adapter"
    return sum(p.numel() for p in trainable)


def trainable_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The student's own tensors (see the module docstring), detached views, not copies."""
    if not is_lora(model):
        return model.state_dict()
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def trainable_names(model: nn.Module) -> list[str]:
    """The keys of `trainable_state_dict` of a LoRA student (a full student: every parameter),
    in parameter order: what a sharded checkpoint (torch.distributed.checkpoint) filters
    `get_model_state_dict` to."""
    return [n for n, _ in trainable_parameters(model)]


def full_trainable_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`trainable_state_dict` with sharded tensors (FSDP2's DTensors) gathered whole, on the
    CPU: the adapter alone is gathered, never the frozen base. Under FSDP2 every rank must call
    it (`full_tensor()` is an all-gather); without sharding it is a CPU copy."""
    out = {}
    for name, t in trainable_state_dict(model).items():
        whole = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = whole.detach().cpu()
    return out


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of what the optimizer, EMA and finiteness checks cover."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


@torch.no_grad()
def load_trainable_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Inverse of `trainable_state_dict`; the same keys and shapes, or a KeyError/ValueError
    (checkpoints are matched against the live model first, `checkpoint_read.check_restorable`)."""
    if not is_lora(model):
        model.load_state_dict(state)
        return
    live = dict(trainable_parameters(model))
    if set(live) != set(state):
        diff = sorted(set(live) ^ set(state))
        raise KeyError(f"LoRA state does not fit the student's adapters ({diff[:3]})")
    for name, p in live.items():
        if state[name].shape != p.shape:
            raise ValueError(f"{name} is {list(state[name].shape)}, adapter is {list(p.shape)}")
        p.copy_(state[name])


def adapter_state_dict(
    model: nn.Module, state: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The adapter of one transformer as peft saves it: module names without the adapter name
    (`blocks.0.attn1.to_q.lora_A.weight`), CPU contiguous tensors. `state`: the adapter's
    tensors under `trainable_state_dict` names when the model's own are sharded (pass
    `full_trainable_state_dict(model)`); None: the model's."""
    from peft.utils import get_peft_model_state_dict

    sd = get_peft_model_state_dict(model, state_dict=state, adapter_name=ADAPTER)
    return {k: v.detach().cpu().contiguous() for k, v in sd.items()}


def save_lora_folder(
    model: nn.Module, folder: Path, state: dict[str, torch.Tensor] | None = None
) -> Path:
    """`folder/pytorch_lora_weights.safetensors` in diffusers' Wan LoRA format (what
    `WanPipeline.save_lora_weights` writes from `get_peft_model_state_dict`); returns it.
    A per-expert pair: `folder/transformer/` and `folder/transformer_2/` each with its expert's
    file (the same format: stock diffusers loads the second into transformer_2) and
    `folder/experts.json`; returns `folder`. `state`: see `adapter_state_dict` (a sharded
    model's gathered adapter, under the pair's `transformer.*` / `transformer_2.*` names)."""
    if not isinstance(model, experts.ExpertPair):
        return _save_lora_file(model, folder, state)
    for name in experts.EXPERTS:
        mine = None
        if state is not None:
            prefix = f"{name}."
            mine = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
        (folder / name).mkdir(parents=True, exist_ok=True)
        _save_lora_file(getattr(model, name), folder / name, mine)
    experts.write_marker(folder, model.boundary_ratio, model.num_train_timesteps)
    return folder


def _save_lora_file(model: nn.Module, folder: Path, state: dict[str, torch.Tensor] | None) -> Path:
    from diffusers import WanPipeline

    # The LoraConfig as diffusers stores it in the file's metadata (rank, alpha, targets), so
    # load_lora_weights rebuilds the very adapter instead of guessing alpha from shapes
    config = model.peft_config[ADAPTER].to_dict()  # type: ignore[index,union-attr,operator]
    WanPipeline.save_lora_weights(
        folder,
        transformer_lora_layers=adapter_state_dict(model, state),
        transformer_lora_adapter_metadata=config,
        weight_name=LORA_FILE,
        safe_serialization=True,
    )
    return folder / LORA_FILE


@torch.no_grad()
def load_lora_file(model: nn.Module, path: Path) -> None:
    """Put a LoRA file written by `save_lora_folder` into `model`, whose adapters `add_lora`
    made with the run's config (read with safetensors; every key must land)."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    raw = load_file(path)
    foreign = [k for k in raw if not k.startswith(PREFIX)]
    if foreign:
        raise UsageError(
            f"LoRA file {str(path)!r} holds keys outside transformer. ({foreign[0]!r})",
            fix="pass a LoRA file written by `wandistill train` / `wandistill export`",
        )
    sd = {k.removeprefix(PREFIX): v for k, v in raw.items()}
    result = set_peft_model_state_dict(model, sd, adapter_name=ADAPTER)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys or missing:
        bad = (list(result.unexpected_keys) or missing)[:3]
        raise UsageError(
            f"LoRA file {str(path)!r} does not fit the run's adapters ({bad})",
            fix="pass the run the LoRA file was written by",
        )


def describe(model: nn.Module) -> str:
    """`LoRA rank 8 on 12 linears: 0.05M trainable of 14.2M (0.35%)` for the run's banner (a
    per-expert pair: `on 12 linears x 2 experts`, the counts of both)."""
    first = experts.transformers(model)[0]
    cfg = first.peft_config[ADAPTER]  # type: ignore[index,union-attr,operator]
    n_all = sum(p.numel() for p in model.parameters())
    n_own = sum(p.numel() for _, p in trainable_parameters(model))
    layers = sum(1 for n, _ in first.named_modules() if n.endswith(f"lora_A.{ADAPTER}"))
    many = len(experts.transformers(model))
    each = f" x {many} experts" if many > 1 else ""
    return (
        f"LoRA rank {cfg.r} (alpha {cfg.lora_alpha:g}) on {layers} linears{each}: "
        f"{n_own / 1e6:.3f}M trainable of {n_all / 1e6:.2f}M ({100 * n_own / max(n_all, 1):.2f}%)"
    )


def run_record(student: StudentConfig) -> dict[str, Any] | None:
    """The run's LoRA as run.json and checkpoints' meta record it (None: a full student)."""
    if not student.lora.enabled:
        return None
    init = student.init_from_teacher
    return record(student.lora, init.component, init.path)


def sampling_entry(student: StudentConfig, components: dict[str, Any]) -> dict[str, Any] | None:
    """sampling.json's `lora`: `run_record` plus the digests of the cache teacher's base
    component (`components`: the manifest's teacher components), which export checks its
    --teacher against; per-expert students: each expert's (`expert_base_files`)."""
    rec = run_record(student)
    if rec is None:
        return None
    base = str(Path(rec["base"]).resolve())  # sample / eval --run load it from any directory
    entry = {**rec, "base": base, "base_files": components.get(rec["component"])}
    if student.experts == experts.PER_EXPERT:
        entry["expert_base_files"] = {name: components.get(name) for name in experts.EXPERTS}
    return entry


def record(cfg: StudentLoraConfig, component: str, base: str | None) -> dict[str, Any]:
    """What run.json, checkpoints' meta and sampling.json say about the LoRA (JSON)."""
    return {
        "rank": cfg.rank,
        "alpha": cfg.scale_alpha,
        "target_modules": list(cfg.target_modules),
        "dropout": cfg.dropout,
        "component": component,
        "base": base,
    }


def config_from_record(rec: dict[str, Any]) -> StudentLoraConfig:
    return StudentLoraConfig(
        rank=int(rec["rank"]),
        alpha=float(rec["alpha"]),
        target_modules=[str(t) for t in rec["target_modules"]],
        dropout=float(rec.get("dropout", 0.0)),
    )


# --------------------------------------------------------------------------- validation


def plan_problems(
    student: StudentConfig, student_config: dict[str, Any], teacher_config: dict[str, Any]
) -> list[str]:
    """Why this recipe cannot train a LoRA on this cache's teacher (empty: it can). Needs only
    the recipe and the manifest's teacher config; the targets are checked on a meta-device model
    (no memory, no weights)."""
    from wandistill.student.config import init_params

    base = {k: v for k, v in teacher_config.items() if k in init_params()}
    if not base:
        return [
            "student.lora needs the teacher's transformer config, which this cache does not "
            "record; re-run precompute with this wandistill"
        ]
    problems = []
    keys = set(base) | set(student_config)
    differ = sorted(k for k in keys if base.get(k) != student_config.get(k))
    if differ:
        problems.append(
            f"a LoRA student is the teacher's transformer, but the recipe changes its "
            f"{', '.join(differ)}; remove them from [train.student] (and student.config_file)"
        )
    blocks = student.init_from_teacher.blocks
    n = int(base.get("num_layers", 0))
    if blocks and blocks != list(range(n)):
        problems.append(
            f"student.init_from_teacher.blocks = {blocks} but a LoRA student adapts every "
            f"teacher block; remove blocks (or list 0..{n - 1})"
        )
    if not differ:
        from diffusers import WanTransformer3DModel

        with torch.device("meta"):
            model = WanTransformer3DModel(**base)
        try:
            check_targets(model, list(student.lora.target_modules))
        except UsageError as e:
            problems.append(f"{e.message} ({e.fix})")
    return problems


def resume_problem(saved: dict[str, Any] | None, want: dict[str, Any] | None) -> str | None:
    """Why a checkpoint's LoRA (its meta's `lora`, None: a full student) cannot resume under
    the recipe's, or None. Rank, alpha and targets shape the adapter; the component is its
    base."""
    keys = ("rank", "alpha", "target_modules", "component")

    def text(rec: dict[str, Any] | None) -> str:
        if not rec:
            return "a full student (no LoRA)"
        targets = rec.get("target_modules")
        return f"LoRA rank {rec.get('rank')}, alpha {rec.get('alpha')}, targets {targets}"

    if (saved is None) != (want is None) or (
        saved and want and any(saved.get(k) != want.get(k) for k in keys)
    ):
        return f"it holds {text(saved)}, the recipe asks for {text(want)}"
    return None
