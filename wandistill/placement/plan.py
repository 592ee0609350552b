"""Memory planning for the teacher: which placement fits this machine, and which is fastest.

Nothing here loads weights. Every component is built on the meta device from its config
(`accelerate.init_empty_weights`), parameter sizes come from the safetensors headers when a real
teacher folder is given (from the config otherwise), and accelerate's own `infer_auto_device_map`
simulates the `balanced` / `balanced_low_0` / `sequential` device maps over the GPUs of an
`Inventory` — the real one (`Inventory.detect()`) or a made-up one (`Inventory.fake(...)`), so a
plan for 4x80 GB can be made on a laptop.

Precompute runs in phases and frees each phase's models before the next (docs/architecture.md),
so a strategy's need on a device is the maximum over phases, never the sum:

    encode   text encoder alone (UMT5-xxl: ~5.7B parameters)
    denoise  the transformer; Wan 2.2 A14B: one expert resident at a time by default
    decode   the VAE, only when previews are asked for

Weights are exact; activations are estimates (formulas in `activation_bytes`) with a 25% margin,
plus a fixed allowance for the CUDA context and allocator slack on each GPU and for the Python
process on the CPU. `Plan.auto` is the fastest strategy (lowest speed rank) that fits everywhere.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from wandistill.errors import UsageError
from wandistill.placement.devices import CPU_OVERHEAD, CUDA_OVERHEAD, GiB, device_key
from wandistill.placement.estimate import (
    ComponentSize,
    SamplerSizes,
    activation_bytes,
    component_size,
    dtype_name,
    module_sizes,
    quiet_libraries,
    shared_meta_model,
    special_dtypes,
)
from wandistill.placement.inventory import Inventory
from wandistill.placement.parse import Auto
from wandistill.placement.protocol import Need
from wandistill.placement.strategies import Cuda, Placement
from wandistill.teacher.folder import TeacherFolder
from wandistill.teacher.schema import validate_config

__all__ = [
    "AutoChoice",
    "Phase",
    "Plan",
    "PlanContext",
    "StrategyPlan",
    "make_plan",
    "same_strategy",
    "too_small",
]

# --------------------------------------------------------------------------- plan


@dataclass(frozen=True, slots=True)
class Phase:
    """Models resident at the same time, and the activations of the one running."""

    name: str
    components: tuple[str, ...]
    activation_bytes: int


@dataclass(frozen=True, slots=True)
class StrategyPlan:
    """One placement strategy on this inventory."""

    placement: Placement
    """The strategy; device-map strategies carry the per-component max_memory planned here."""
    speed_rank: int
    """1 = expected fastest; an estimate from how much data moves per forward, not measured."""
    needs: dict[str, dict[str, int]]
    """phase name -> device -> bytes."""
    peak: dict[str, int]
    """device -> max over phases (phases run one after another)."""
    fits: bool
    note: str
    """Why it does not fit, or what it assumes."""
    max_memory: dict[str, dict[int | str, int]] = field(default_factory=dict)
    """Device-map strategies: component -> the max_memory passed to accelerate when loading."""

    @property
    def strategy(self) -> str:
        """The --placement value (cuda rows name their GPU, e.g. cuda:0)."""
        return str(self.placement)


@dataclass(frozen=True, slots=True)
class AutoChoice:
    placement: Placement | None
    """None when nothing fits."""
    reason: str

    @property
    def strategy(self) -> str | None:
        return None if self.placement is None else str(self.placement)


@dataclass(frozen=True, slots=True)
class Plan:
    teacher: str
    dtype: torch.dtype
    sizes: SamplerSizes
    inventory: Inventory
    components: tuple[ComponentSize, ...]
    phases: tuple[Phase, ...]
    strategies: tuple[StrategyPlan, ...]
    """Sorted by speed rank; a requested placement that auto never picks comes last."""
    auto: AutoChoice
    requested: Placement | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def strategy(self, which: str | Placement) -> StrategyPlan:
        """The row for a placement (any single-GPU placement maps to the single-GPU row); a
        string is looked up by its --placement text, for tests and the command line."""
        for sp in self.strategies:
            if same_strategy(sp.placement, which):
                return sp
        raise KeyError(str(which))

    def component(self, name: str) -> ComponentSize:
        return next(c for c in self.components if c.name == name)

    def activation(self, component: str) -> int:
        return max(
            (p.activation_bytes for p in self.phases if component in p.components), default=0
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "teacher": self.teacher,
            "dtype": dtype_name(self.dtype),
            "sizes": dataclasses.asdict(self.sizes),
            "tokens": self.sizes.tokens(),
            "inventory": dataclasses.asdict(self.inventory),
            "components": [dataclasses.asdict(c) for c in self.components],
            "phases": [dataclasses.asdict(p) for p in self.phases],
            "strategies": [
                {
                    "strategy": s.strategy,
                    "speed_rank": s.speed_rank,
                    "fits": s.fits,
                    "peak": s.peak,
                    "needs": s.needs,
                    "max_memory": {
                        c: {str(k): v for k, v in mm.items()} for c, mm in s.max_memory.items()
                    },
                    "note": s.note,
                }
                for s in self.strategies
            ],
            "auto": {"strategy": self.auto.strategy, "reason": self.auto.reason},
            "requested": None if self.requested is None else str(self.requested),
            "notes": list(self.notes),
        }


def same_strategy(placement: Placement, which: str | Placement) -> bool:
    if isinstance(which, str):
        single = which in ("cuda", "gpu0") or which.startswith("cuda:")
        return str(placement) == which or (single and isinstance(placement, Cuda))
    if isinstance(which, Cuda):
        return isinstance(placement, Cuda)
    same_kind = type(placement) is type(which) and str(placement) == str(which)
    return same_kind and getattr(placement, "level", None) == getattr(which, "level", None)


def _load_configs(
    source: str | Path | TeacherFolder | Mapping[str, Mapping[str, Any]],
) -> tuple[str, dict[str, dict[str, Any]], TeacherFolder | None]:
    """(label, {component: config}, folder or None) for a folder, a config name or dicts.

    A path is opened for planning (`complete=False`: weights, tokenizer and scheduler may be
    missing; what is there is validated as for precompute); config dicts are validated by the
    same typed models."""
    if isinstance(source, Mapping):
        for name, config in source.items():
            validate_config(name, config, source=f"config dict {name!r}")
        return "config dicts", {k: dict(v) for k, v in source.items()}, None
    folder = TeacherFolder.coerce(source, complete=False)
    return folder.label, {n: folder.raw_config(n) for n in folder.components}, folder


def _phases(
    configs: Mapping[str, Mapping[str, Any]],
    sizes: SamplerSizes,
    dtype: torch.dtype,
    experts_resident: int,
) -> list[Phase]:
    def act(name: str) -> int:
        return activation_bytes(name, configs[name], sizes, dtype)

    phases = []
    if "text_encoder" in configs:
        phases.append(Phase("encode", ("text_encoder",), act("text_encoder")))
    experts = [n for n in ("transformer", "transformer_2") if n in configs]
    if len(experts) > 1 and experts_resident < len(experts):
        phases += [Phase(f"denoise ({e})", (e,), act(e)) for e in experts]
    elif experts:
        phases.append(Phase("denoise", tuple(experts), max(act(e) for e in experts)))
    if sizes.previews and "vae" in configs:
        phases.append(Phase("decode", ("vae",), act("vae")))
    return phases


@dataclass(slots=True)
class PlanContext:
    """What a placement's `need` reads: the machine, the dtype, the components' sizes and their
    meta models (see `wandistill.placement.Placement.need`)."""

    inventory: Inventory
    dtype: torch.dtype
    comps: dict[str, ComponentSize]
    models: dict[str, torch.nn.Module]
    caps: dict[int | str, int]
    """The user's max_memory: GPU index or "cpu" -> bytes."""
    best_gpu: int

    @property
    def gpu(self) -> str:
        """The single GPU a one-GPU strategy uses: the one with the most free memory."""
        return f"cuda:{self.best_gpu}"

    def cap(self, device: str) -> int:
        """Free memory on `device`, lowered by a user max_memory cap where one is set."""
        have = self.inventory.available(device)
        key: int | str = device_key(device)
        return min(have, self.caps[key]) if key in self.caps else have

    def module_sizes(self, name: str) -> dict[str, int]:
        """accelerate's `compute_module_sizes` of component `name` at the run dtype."""
        return module_sizes(self.models[name], self.dtype)

    def module_names(self, name: str) -> set[str]:
        """Every module and tensor name of component `name` (tied ones under each name)."""
        model = self.models[name]
        tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
        return {n for n, _ in model.named_modules(remove_duplicate=False)} | {n for n, _ in tensors}

    def simulate_device_map(self, phase: Phase, strategy: str, *, low_zero: bool) -> Need:
        """accelerate's own device-map algorithm on the meta models, GPUs only (plus the CPU
        where the user's max_memory names it), activation headroom reserved on every GPU.

        Each component's max_memory (what the loader passes to `from_pretrained`) is recorded:
        the library then runs the same `get_balanced_memory` + `infer_auto_device_map`."""
        from accelerate.utils import get_balanced_memory, infer_auto_device_map

        headroom = phase.activation_bytes + CUDA_OVERHEAD
        budget: dict[int | str, int] = {
            i: max(0, self.cap(f"cuda:{i}") - headroom) for i in range(len(self.inventory.gpus))
        }
        if "cpu" in self.caps:
            budget["cpu"] = self.cap("cpu")
        devices: dict[str, int] = {"cpu": CPU_OVERHEAD}
        planned: dict[str, dict[int | str, int]] = {}
        spilled: list[str] = []
        for name in phase.components:
            model, comp = self.models[name], self.comps[name]
            planned[name] = dict(budget)
            kwargs = {
                "no_split_module_classes": list(comp.no_split),
                "special_dtypes": special_dtypes(model, self.dtype),
            }
            with quiet_libraries():
                mm = dict(budget)
                if strategy != "sequential":
                    mm = get_balanced_memory(
                        model,
                        max_memory=dict(budget),
                        dtype=self.dtype,
                        low_zero=low_zero,
                        **kwargs,
                    )
                dmap = infer_auto_device_map(model, max_memory=mm, dtype=self.dtype, **kwargs)
            sizes = self.module_sizes(name)
            for module, dev in dmap.items():
                if isinstance(dev, int) or (dev == "cpu" and "cpu" in budget):
                    key = f"cuda:{dev}" if isinstance(dev, int) else "cpu"
                    devices[key] = devices.get(key, 0) + sizes.get(module, 0)
                    budget[dev] = max(0, budget[dev] - sizes.get(module, 0))
                else:
                    spilled.append(f"{name}.{module}" if module else name)
        devices = {d: n + (headroom if d != "cpu" else 0) for d, n in devices.items()}
        note = (
            f"{len(spilled)} module(s) do not fit on the GPUs (e.g. {spilled[0]})"
            if spilled
            else ""
        )
        return Need(devices, note, planned)


def _strategy_plan(
    ctx: PlanContext, phases: list[Phase], placement: Placement, rank: int
) -> StrategyPlan:
    needs: dict[str, dict[str, int]] = {}
    notes: list[str] = []
    budgets: dict[str, dict[int | str, int]] = {}
    for phase in phases:
        one = phase.components[0] if len(phase.components) == 1 else None
        # a phase of one component runs it as `for_component` places it (the VAE: whole)
        placed = placement.for_component(one, ctx.comps[one].class_name) if one else placement
        need = placed.need(phase, ctx)
        needs[phase.name] = need.devices
        budgets.update(need.max_memory)
        if need.note:
            notes.append(f"{phase.name}: {need.note}")
    peak: dict[str, int] = {}
    for devices in needs.values():
        for dev, b in devices.items():
            peak[dev] = max(peak.get(dev, 0), b)
    short = [
        f"{dev} needs {b / GiB:.1f} GiB, has {ctx.cap(dev) / GiB:.1f} GiB"
        for dev, b in peak.items()
        if b > ctx.cap(dev)
    ]
    fits = not short and not notes
    note = "; ".join(notes + short) if not fits else placement.why
    if budgets:
        placement = placement.with_budgets(budgets)
    return StrategyPlan(placement, rank, needs, peak, fits, note, budgets)


def _auto(strategies: list[StrategyPlan], inventory: Inventory) -> AutoChoice:
    fitting = [s for s in strategies if s.fits]
    if not fitting:
        least = min(strategies, key=lambda s: sum(s.peak.values()))
        return AutoChoice(None, f"nothing fits; closest is {least.strategy}: {least.note}")
    best = fitting[0]
    faster = [s for s in strategies if s.speed_rank < best.speed_rank]
    why = f"the fastest strategy that fits ({best.note})"
    if faster:
        why += "; faster but too big: " + "; ".join(f"{s.strategy} ({s.note})" for s in faster)
    if not inventory.has_cuda:
        why += "; no GPU visible"
    return AutoChoice(best.placement, why)


def _as_auto(requested: Placement | None) -> Auto:
    """The `auto` whose candidates share the requested strategy's caps and group level."""
    if isinstance(requested, Auto):
        return requested
    level = getattr(requested, "level", "block_level")
    return Auto(level=level, caps=getattr(requested, "caps", ()))


def make_plan(
    folder_or_configs: str | Path | TeacherFolder | Mapping[str, Mapping[str, Any]],
    *,
    dtype: torch.dtype,
    sizes: SamplerSizes,
    inventory: Inventory,
    placement: Placement | None = None,
    experts_resident: int = 1,
    components: tuple[str, ...] | None = None,
    only: tuple[type[Placement], ...] | None = None,
) -> Plan:
    """Plan every strategy `auto` may pick (and the requested `placement`, if auto never would)
    for a teacher folder, a committed config name, or config dicts.

    `experts_resident`: Wan 2.2 experts kept loaded together during denoising (1: the sampler
    swaps them; 2: both stay loaded). `components`: plan only these (eval needs the VAE only);
    `only`: the strategy types auto may pick (eval / sample `--device auto`: Cuda or Cpu).
    The requested placement's max_memory caps every device, as accelerate's would."""
    label, configs, folder = _load_configs(folder_or_configs)
    if components is not None:
        configs = {n: c for n, c in configs.items() if n in components}
    models = {n: shared_meta_model(n, json.dumps(c, sort_keys=True)) for n, c in configs.items()}
    comps = {
        n: component_size(n, m, dtype, folder.numels(n) if folder is not None else None)
        for n, m in models.items()
    }
    auto = _as_auto(placement)
    best_gpu = max(
        range(len(inventory.gpus)), key=lambda i: inventory.gpus[i].free_bytes, default=0
    )
    ctx = PlanContext(inventory, dtype, comps, models, dict(auto.caps), best_gpu)
    phases = _phases(configs, sizes, dtype, experts_resident)
    candidates = [
        p for p in auto.candidates(len(inventory.gpus), best_gpu) if not only or isinstance(p, only)
    ]
    plans = [_strategy_plan(ctx, phases, p, rank) for rank, p in enumerate(candidates, start=1)]
    choice = _auto(plans, inventory)
    if placement is not None and not isinstance(placement, Auto):
        if not any(same_strategy(s.placement, placement) for s in plans):
            plans.append(_strategy_plan(ctx, phases, placement, len(plans) + 1))
    notes = (
        "weights: exact (fp32-kept layers at 4 bytes); activations: estimated, +25% margin",
        f"per GPU +{CUDA_OVERHEAD / GiB:.0f} GiB CUDA context/allocator; "
        f"CPU +{CPU_OVERHEAD / GiB:.0f} GiB process",
    )
    return Plan(
        teacher=label,
        dtype=dtype,
        sizes=sizes,
        inventory=inventory,
        components=tuple(comps.values()),
        phases=tuple(phases),
        strategies=tuple(plans),
        auto=choice,
        requested=placement,
        notes=notes,
    )


_FLAGS = {"cpu": "--cpu-mem", "disk": "--disk"}


def too_small(plan: Plan) -> UsageError:
    """The one-line error for a described machine on which nothing fits: the strategy closest
    to fitting (least memory short), what it needs per device, and the flags that would do."""
    spilled = tuple(f"{p.name}: " for p in plan.phases)  # device maps that spill: no size fixes
    pool = [s for s in plan.strategies if not s.note.startswith(spilled)] or list(plan.strategies)
    inv = plan.inventory
    best = min(pool, key=lambda s: sum(max(0, b - inv.available(d)) for d, b in s.peak.items()))
    needs = ", ".join(f"{d} {b / GiB:.1f} GiB" for d, b in best.peak.items())
    raise_to: dict[str, int] = {}
    for device, b in best.peak.items():
        if b > inv.available(device):
            flag = _FLAGS.get(device, "--gpu-mem")
            extra = GiB // 2 if flag == "--gpu-mem" else 0  # a described GPU keeps 0.5 GiB back
            raise_to[flag] = max(raise_to.get(flag, 0), b + extra)
    fix = " ".join(f"{f} {math.ceil(n / GiB)}GiB" for f, n in raise_to.items())
    return UsageError(
        f"the described machine ({inv.source.removeprefix('described: ')}) is too "
        f"small for teacher {plan.teacher} with any placement; the closest, {best.strategy}, "
        f"needs {needs}",
        fix=f"describe a bigger machine: {fix}" if fix else best.note,
    )
