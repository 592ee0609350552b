"""One progress bar for long work: rate, ETA and optional byte count; silent off rank 0.

Also the process's progress beat: `beat()` (called by every `Progress.advance`, every denoising
step and every model load) tells listeners this process is getting on with its work;
`wandistill.dist` publishes it so that a rank waiting for the others can tell a slow peer from a
stuck one.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress

_listeners: list[Callable[[], None]] = []


def on_beat(listener: Callable[[], None], *, remove: bool = False) -> None:
    if remove:
        if listener in _listeners:
            _listeners.remove(listener)
    elif listener not in _listeners:
        _listeners.append(listener)


def beat() -> None:
    """This process made progress (cheap: listeners rate-limit themselves)."""
    for listener in _listeners:
        listener()


class Progress:
    """`with Progress(total=n, enabled=info.is_main): bar.advance(k, loss=...)`."""

    def __init__(
        self, *, total: int, description: str, enabled: bool = True, unit: str = "it"
    ) -> None:
        self.enabled = enabled
        self.unit = unit
        self._bar = (
            RichProgress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TaskProgressColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[extra]}"),
                transient=False,
            )
            if enabled
            else None
        )
        self._task = (
            self._bar.add_task(description, total=total, rate="", extra="")
            if self._bar is not None
            else None
        )

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.stop()

    def advance(self, n: int = 1, *, bytes_total: int | None = None, **fields: float) -> None:
        beat()
        if self._bar is None or self._task is None:
            return
        self._bar.advance(self._task, n)
        task = self._bar.tasks[0]
        rate = task.speed
        extra = " ".join(f"{k}={v:.4g}" for k, v in fields.items())
        if bytes_total:
            extra = f"{bytes_total / 2**20:.1f} MiB written {extra}".strip()
        self._bar.update(
            self._task,
            rate=f"{rate:.2f} {self.unit}/s" if rate else "",
            extra=extra,
        )
