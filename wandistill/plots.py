"""PNG plots of a run's losses and an eval's metrics, drawn with matplotlib.

matplotlib's object API (`Figure` + the Agg canvas), never `pyplot`: no global backend or figure
state, no display needed, safe inside any process (a torchrun rank, a test, a notebook that uses
another backend). Imported only when a plot is drawn: matplotlib costs about a second to import.
Every PNG is written atomically (`fsutil.atomic_write_bytes`).
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

from wandistill.fsutil import atomic_write_bytes

LOSS_PNG = "loss.png"
"""What `train` writes next to metrics.jsonl when it ends."""

_SKIP_EVAL_KEYS = frozenset({"records", "steps"})
"""eval.json numbers that are counts, not metrics."""


def loss_curves(rows: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """Per loss series (`loss` = the weighted total, `loss_<term>` each term): steps and values.
    A resumed run may log a step twice; the later row wins. Non-finite values are left out."""
    by_step: dict[str, dict[int, float]] = {}
    for row in rows:
        if "step" not in row or row.get("event"):
            continue
        for key, value in row.items():
            if (key == "loss" or key.startswith("loss_")) and isinstance(value, int | float):
                if math.isfinite(value):
                    by_step.setdefault(key, {})[int(row["step"])] = float(value)
    return {k: (sorted(v), [v[s] for s in sorted(v)]) for k, v in by_step.items()}


def plot_loss(metrics_jsonl: str | Path, out_png: str | Path) -> Path:
    """Training loss per step, one line per term and the total, log-scale y (losses span
    decades), labelled axes and a legend. Written atomically to `out_png`."""
    rows = []
    for line in Path(metrics_jsonl).read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a killed run's half-written last line
            continue
    curves = loss_curves(rows)
    fig, ax = _figure((7.0, 4.0))
    for name, (steps, values) in sorted(curves.items(), key=lambda kv: kv[0] != "loss"):
        total = name == "loss"
        ax.plot(
            steps,
            values,
            label="total (weighted)" if total else name.removeprefix("loss_"),
            linewidth=2.0 if total else 1.2,
            color="black" if total else None,
            marker="o" if len(steps) == 1 else None,
        )
    if any(v > 0 for _, values in curves.values() for v in values):
        ax.set_yscale("log")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (log scale)")
    ax.set_title(f"training loss ({Path(metrics_jsonl).name})")
    ax.grid(True, which="both", alpha=0.3)
    if curves:
        ax.legend(title="term", loc="best", fontsize="small")
    else:
        ax.text(0.5, 0.5, "no loss rows logged yet", ha="center", transform=ax.transAxes)
    return _save(fig, Path(out_png))


def plot_eval_metrics(eval_json_path: str | Path, out_png: str | Path) -> Path:
    """An eval's metrics as bars: errors (MSE, losses; lower is better) and PSNRs (dB; higher is
    better) on separate axes, the do-nothing noise baseline beside the student's MSE."""
    data = json.loads(Path(eval_json_path).read_text(encoding="utf-8"))
    metrics = {
        k: float(v)
        for k, v in data.items()
        if k not in _SKIP_EVAL_KEYS
        and isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
    }
    psnr = {k: v for k, v in metrics.items() if "psnr" in k}
    errors = {k: v for k, v in metrics.items() if k not in psnr}
    fig, (left, right) = _figure((8.0, 3.6), ncols=2)
    for ax, group, ylabel in (
        (left, errors, "error vs teacher (lower is better)"),
        (right, psnr, "PSNR vs teacher, dB (higher is better)"),
    ):
        names = list(group)
        bars = ax.bar(names, [group[n] for n in names], color="tab:blue")
        for name, bar in zip(names, bars, strict=True):
            if "noise" in name:  # the baseline, so the student's bars read against it
                bar.set_color("tab:gray")
        ax.bar_label(bars, fmt="%.4g", fontsize="small")
        ax.set_ylabel(ylabel)
        ax.tick_params(axis="x", labelrotation=20, labelsize="small")
        ax.grid(True, axis="y", alpha=0.3)
    title = f"eval: {data.get('records', '?')} records, {data.get('steps', '?')} student steps"
    fig.suptitle(title)
    return _save(fig, Path(out_png))


def _figure(size: tuple[float, float], ncols: int = 1) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols)
    return fig, axes if ncols == 1 else tuple(axes)


def _save(fig: Any, out: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(out, buf.getvalue())
    return out
