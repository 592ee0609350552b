"""A plan as rich tables: components, inventory, per-phase needs per strategy, the summary."""

from __future__ import annotations

from typing import TYPE_CHECKING

from wandistill.placement.devices import GiB, device_key
from wandistill.placement.estimate import dtype_name
from wandistill.placement.plan import Plan, same_strategy

if TYPE_CHECKING:
    from rich.console import RenderableType

__all__ = ["render_plan"]


def _gib(n: int) -> str:
    return f"{n / GiB:.1f}"


def render_plan(plan: Plan) -> list[RenderableType]:
    """Rich tables: components, inventory, per-phase needs per strategy, the summary, auto."""
    from rich.table import Table
    from rich.text import Text

    head = Table(title=f"teacher {plan.teacher}", show_header=False)
    head.add_row("dtype", dtype_name(plan.dtype))
    head.add_row("sampler", plan.sizes.describe())
    head.add_row("phases", " -> ".join(f"{p.name}" for p in plan.phases))

    devices = plan.inventory.devices()
    out: list[RenderableType] = [head, _components_table(plan), _inventory_table(plan)]
    name_width = max(len(s.strategy) for s in plan.strategies)  # names are never cut
    for phase in plan.phases:
        t = Table(
            title=f"phase {phase.name} (GiB): {', '.join(phase.components)} "
            f"(activations ~{_gib(phase.activation_bytes)} GiB est.)"
        )
        t.add_column("strategy", min_width=name_width, overflow="fold")
        for d in devices:
            t.add_column(d, justify="right", overflow="fold")
        for s in plan.strategies:
            need = s.needs[phase.name]
            t.add_row(s.strategy, *[_gib(need[d]) if d in need else "-" for d in devices])
        out.append(t)

    summary = Table(title="peak GiB over phases, fastest first (notes below)")
    summary.add_column("#")
    summary.add_column("strategy", min_width=name_width, overflow="fold")
    for d in devices:
        summary.add_column(d, justify="right", overflow="fold")
    summary.add_column("fits", overflow="fold")
    notes: list[Text] = []
    for s in plan.strategies:
        marks = ["auto"] if s.placement == plan.auto.placement else []
        if plan.requested is not None and same_strategy(s.placement, plan.requested):
            marks.append("requested")
        fits = Text("yes" if s.fits else "no", style="green" if s.fits else "red")
        summary.add_row(
            str(s.speed_rank),
            s.strategy,
            *[_gib(s.peak[d]) if d in s.peak else "-" for d in devices],
            fits,
        )
        mark = f" ({', '.join(marks)})" if marks else ""
        if s.note or mark:
            notes.append(Text(f"{s.speed_rank} {s.strategy}{mark}: {s.note}"))
    out.append(summary)
    out.extend(notes)
    budgets = _budget_table(plan, devices)
    if budgets is not None:
        out.append(budgets)
    pick = plan.auto.strategy or "nothing fits"
    out.append(Text(f"auto -> {pick}: {plan.auto.reason}"))
    out.extend(Text(f"note: {n}", style="dim") for n in plan.notes)
    return out


def _components_table(plan: Plan) -> RenderableType:
    """Each component's class, parameters, weight bytes and where its sizes came from."""
    from rich.table import Table

    comps = Table(title="components")
    for col in (
        "component",
        "class",
        "params",
        "weights GiB",
        "fp32-kept GiB",
        "largest block GiB",
        "sizes from",
    ):
        comps.add_column(
            col, justify="right" if "GiB" in col or col == "params" else "left", overflow="fold"
        )
    for c in plan.components:
        comps.add_row(
            c.name,
            c.class_name,
            f"{c.params / 1e9:.2f}B",
            _gib(c.weight_bytes),
            _gib(c.fp32_kept_bytes),
            _gib(c.largest_group_bytes),
            c.source,
        )
    return comps


def _inventory_table(plan: Plan) -> RenderableType:
    """The devices the plan places on, with their memory."""
    from rich.table import Table

    inv = Table(title=f"inventory ({plan.inventory.source})")
    for col in ("device", "name", "total GiB", "available GiB"):
        inv.add_column(col, overflow="fold")
    for i, g in enumerate(plan.inventory.gpus):
        inv.add_row(f"cuda:{i}", g.name, _gib(g.total_bytes), _gib(g.free_bytes))
    inv.add_row("cpu", "RAM", "", _gib(plan.inventory.cpu_bytes))
    inv.add_row("disk", "offload folder", "", _gib(plan.inventory.disk_bytes))
    return inv


def _budget_table(plan: Plan, devices: list[str]) -> RenderableType | None:
    """The max_memory each device-map strategy hands accelerate, per component: free memory
    minus that phase's activation headroom and the CUDA allowance (what `load` passes)."""
    from rich.table import Table

    rows = [(s, c, mm) for s in plan.strategies for c, mm in s.max_memory.items()]
    if not rows:
        return None
    t = Table(title="max_memory passed to accelerate (GiB; activation headroom reserved)")
    t.add_column("strategy", min_width=max(len(s.strategy) for s, _, _ in rows), overflow="fold")
    t.add_column("component", overflow="fold")
    for d in devices[:-1]:  # GPUs and the CPU; never the disk
        t.add_column(d, justify="right", overflow="fold")
    for s, component, mm in rows:
        cells = [_gib(mm[device_key(d)]) if device_key(d) in mm else "-" for d in devices[:-1]]
        t.add_row(s.strategy, component, *cells)
    return t
