"""One progress bar for long work: rate, ETA and optional byte count; silent off rank 0."""

from __future__ import annotations

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
