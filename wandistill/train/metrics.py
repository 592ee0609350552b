"""Metrics: one JSON object per line in `<out>/metrics.jsonl` (and TensorBoard when installed).

Rows written every `log_every` steps hold `step`, `loss` and each term as `loss_<term>` (averaged
over the log window and over ranks), `lr`, `grad_norm`, `samples_per_s` (global), `step_time_s`,
`data_wait_frac` (share of step time spent waiting for the reader, max over ranks),
`peak_mem_bytes` (CUDA max allocated, max over ranks; 0 on CPU), `peak_rss_bytes`, `corrupt`
(records skipped so far) and `epoch`. The first row of a run has `"event": "start"`, the last
`"event": "end"`. A bench reads these figures from this file. A row averages a `Window` of steps
over the ranks (`log_window`).
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from wandistill.io.fsutil import atomic_write_bytes, writing
from wandistill.runtime import dist

if TYPE_CHECKING:
    from wandistill.train.loop import Trainer

METRICS = "metrics.jsonl"


class MetricsLog:
    """Append-only JSONL on the main rank; a no-op elsewhere."""

    def __init__(self, out: Path, *, enabled: bool, tensorboard: bool) -> None:
        self.enabled = enabled
        self.path = out / METRICS
        self._file = open(self.path, "a", encoding="utf-8") if enabled else None  # noqa: SIM115
        self._tb: Any = None
        if enabled and tensorboard:
            with contextlib.suppress(ImportError):  # tensorboard is optional
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(out / "tensorboard"))

    def write(self, row: dict[str, Any]) -> None:
        if self._file is None:
            return
        with writing(self.path):  # EFBIG / a full disk names metrics.jsonl
            self._file.write(json.dumps({**row, "time": round(time.time(), 3)}) + "\n")
            self._file.flush()
        if self._tb is not None and "step" in row:
            for key, value in row.items():
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, row["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def truncate_after(out: Path, step: int) -> None:
    """On resume: drop rows a killed run logged after the checkpoint it resumes from."""
    path = out / METRICS
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a half-written last line
        if row.get("step", 0) <= step and row.get("event") != "end":
            kept.append(line)
    atomic_write_bytes(path, "".join(k + "\n" for k in kept).encode())


def read_metrics(out: str | Path) -> list[dict[str, Any]]:
    """Every row of a run's metrics.jsonl (for benches and tests)."""
    path = Path(out) / METRICS
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def peak_memory(device: torch.device) -> dict[str, int]:
    """Peak accelerator memory (CUDA max allocated) and peak host RSS of this process, in bytes."""
    gpu = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = rss if sys.platform == "darwin" else rss * 1024
    return {"peak_mem_bytes": int(gpu), "peak_rss_bytes": int(rss_bytes)}


@dataclass(slots=True)
class Window:
    """Sums over the steps since the last metrics row. A loss term is summed with the number
    of samples it covered (terms cover only their own steps), `loss` once per optimizer step."""

    steps: int = 0
    sums: dict[str, torch.Tensor | float] = field(default_factory=dict)
    counts: dict[str, torch.Tensor | float] = field(default_factory=dict)
    grad_norm: float | torch.Tensor = 0.0
    lr: float = 0.0
    seconds: float = 0.0
    wait: float = 0.0

    def add_micro(
        self, terms: dict[str, torch.Tensor], counts: dict[str, torch.Tensor], grad_accum: int
    ) -> None:
        for k, v in terms.items():
            n = 1.0 / grad_accum if k == "loss" else counts[k]
            self.sums[k] = self.sums.get(k, 0.0) + v.detach() * n
            self.counts[k] = self.counts.get(k, 0.0) + n

    def add(self, grad_norm: torch.Tensor, lr: float, seconds: float, wait: float) -> None:
        self.steps += 1
        self.grad_norm = self.grad_norm + grad_norm
        self.lr, self.seconds, self.wait = lr, self.seconds + seconds, self.wait + wait


def log_window(t: Trainer, step: int, w: Window, samples_per_step: int) -> dict[str, float]:
    """Average the window over ranks (a collective: every rank calls it), write one row."""
    local = {
        "sums": {k: float(v) for k, v in w.sums.items()},
        "counts": {k: float(v) for k, v in w.counts.items()},
        "seconds": w.seconds,
        "wait": w.wait,
        "corrupt": len(t.reader.corrupt),
        **peak_memory(t.info.device),
    }
    views = dist.all_gather_json(t.info, local)
    seconds = max(v["seconds"] for v in views)
    row: dict[str, Any] = {"step": step, "epoch": t.reader.epoch}
    names = sorted({k for v in views for k in v["sums"]}, key=lambda k: (k != "loss", k))
    for k in names:
        total = sum(v["counts"].get(k, 0.0) for v in views)
        mean = sum(v["sums"].get(k, 0.0) for v in views) / total
        row["loss" if k == "loss" else f"loss_{k}"] = mean
    row |= {
        "lr": w.lr,
        "grad_norm": float(w.grad_norm) / w.steps,
        "samples_per_s": samples_per_step * w.steps / max(seconds, 1e-9),
        "step_time_s": seconds / w.steps,
        "data_wait_frac": max(v["wait"] / max(v["seconds"], 1e-9) for v in views),
        "peak_mem_bytes": max(v["peak_mem_bytes"] for v in views),
        "peak_rss_bytes": max(v["peak_rss_bytes"] for v in views),
        "corrupt": sum(v["corrupt"] for v in views),
    }
    t.metrics.write(row)
    w.steps, w.sums, w.counts, w.grad_norm, w.seconds, w.wait = 0, {}, {}, 0.0, 0.0, 0.0
    return {
        "loss": row["loss"],
        "samples/s": row["samples_per_s"],
        "data_wait": row["data_wait_frac"],
    }
