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

from wandistill.io.fsutil import atomic_write_bytes

LOSS_PNG = "loss.png"
"""What `train` writes next to metrics.jsonl when it ends."""

_SKIP_EVAL_KEYS = frozenset({"records", "steps", "num_inference_steps", "teacher_steps"})
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
    """An eval's metrics as bars: errors vs the teacher (MSE, losses; lower is better) and PSNRs
    (dB; higher is better) on separate axes, the do-nothing noise baseline in grey beside the
    rest. Reads either eval.json layout: one flat object of figures, or one entry per sampled
    `columns` (student@K, teacher@K, baseline, noise; the teacher@N reference, which scores
    itself, is left out)."""
    data = json.loads(Path(eval_json_path).read_text(encoding="utf-8"))
    errors, psnr = _eval_bars(data)
    fig, (left, right) = _figure((8.5, 3.8), ncols=2)
    log = len(errors) > 1 and min(errors.values(), default=0) > 0
    for ax, group, ylabel in (
        (left, errors, "MSE vs teacher" + (", log scale" if log else "") + " (lower is better)"),
        (right, psnr, "PSNR vs teacher, dB (higher is better)"),
    ):
        names = list(group)
        bars = ax.bar(names, [group[n] for n in names], color="tab:blue")
        for name, bar in zip(names, bars, strict=True):
            if "noise" in name:  # the baseline, so the others read against it
                bar.set_color("tab:gray")
        ax.bar_label(bars, fmt="%.4g", fontsize="small")
        ax.set_ylabel(ylabel, fontsize="small")
        ax.tick_params(axis="x", labelrotation=20, labelsize="small")
        ax.grid(True, axis="y", alpha=0.3)
    if log:
        left.set_yscale("log")
    steps = data.get("num_inference_steps", data.get("steps", "?"))
    fig.suptitle(f"eval: {data.get('records', '?')} records, student steps {steps}")
    return _save(fig, Path(out_png))


def _eval_bars(data: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """(errors, PSNRs) to draw, by bar label; non-finite and missing figures are left out."""
    errors: dict[str, float] = {}
    psnr: dict[str, float] = {}
    columns = data.get("columns")
    if isinstance(columns, list) and columns:
        for c in columns:
            if not isinstance(c, dict) or c.get("role") == "reference":
                continue
            name = str(c.get("name", "?"))
            _put(errors, name, c.get("latent_mse"))
            _put(psnr, name, c.get("latent_psnr"))
            _put(psnr, f"{name} (image)", c.get("image_psnr"))
        return errors, psnr
    for key, value in data.items():
        if key not in _SKIP_EVAL_KEYS:
            _put(psnr if "psnr" in key else errors, key, value)
    return errors, psnr


def _put(group: dict[str, float], name: str, value: Any) -> None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        group[name] = float(value)


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
