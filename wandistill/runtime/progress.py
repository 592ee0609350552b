"""One progress display for long work: count, rate and ETA that stay readable at 80 columns.

Why not a stock `rich.progress.Progress` with a column per item: when a line is wider than the
terminal, rich ellipsises every column at once and an 80-column line collapses to
`train ━ 2… 100% 64.30 step/s … eta 0…`. Here one renderable lays the line out for the width it
is given, dropping the least useful parts first (extra fields, then the elapsed time, then the
bar shrinks), so the count, the rate and the ETA always show. When stderr is not a terminal (a log
file, CI) there is no live bar: a plain line is printed every `interval` seconds, at each quarter
of the work and at the end. Silent off rank 0 (`enabled=False`), and always on stderr so stdout
stays for results.

Work done before the display starts (`advance` before `__enter__`, e.g. records already in a cache
or the step a run resumes from) counts towards the total but not towards the rate.

Also the process's progress beat: `beat()` (called by every `Progress.advance`, every denoising
step and every model load) tells listeners this process is getting on with its work;
`runtime.dist` publishes it so that a rank waiting for the others can tell a slow peer from a
stuck one.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from rich.console import Console
from rich.live import Live
from rich.text import Text

MIN_BAR = 6
"""Narrowest bar worth drawing; below this the bar is left out."""


def clock(seconds: float) -> str:
    """0:07, 12:34, 1:02:03."""
    s = max(0, int(seconds + 0.5))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


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
    """`with Progress(total=n, description="train", enabled=info.is_main) as bar: bar.advance()`."""

    def __init__(
        self,
        *,
        total: int,
        description: str,
        enabled: bool = True,
        unit: str = "it",
        console: Console | None = None,
        interval: float = 30.0,
        initial: int = 0,
    ) -> None:
        self.total = max(0, int(total))
        self.description = description
        self.enabled = enabled
        self.unit = unit
        self.interval = interval
        self.console = console or Console(stderr=True, highlight=False)
        self.done = max(0, int(initial))
        self.extra = ""
        self._started: float | None = None
        self._window: deque[tuple[float, int]] = deque()
        self._live: Live | None = None
        self._printed_at = 0.0
        self._printed_done: int | None = None
        self._quarter = 0

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Progress:
        self._started = time.monotonic()
        self._window.append((self._started, self.done))
        if self.enabled and self.console.is_terminal:
            self._live = Live(  # re-laid-out for the terminal's width at each refresh
                console=self.console,
                get_renderable=lambda: self.line(self.console.width, bar=True),
            )
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        elif self.enabled and self._started is not None and self._printed_done != self.done:
            self._print_plain()

    def advance(self, n: int = 1, *, bytes_total: int | None = None, **fields: float) -> None:
        """Count `n` more units done; `fields` (e.g. loss=0.1) are shown after the ETA."""
        beat()
        self.done += n
        extra = " ".join(f"{k}={v:.4g}" for k, v in fields.items())
        if bytes_total:
            extra = f"{bytes_total / 2**20:.1f} MiB {extra}".strip()
        if extra or bytes_total is not None:
            self.extra = extra
        if self._started is None:
            return
        now = time.monotonic()
        self._window.append((now, self.done))
        while len(self._window) > 2 and now - self._window[0][0] > 30.0:
            self._window.popleft()
        if self.enabled and self._live is None:
            quarter = 4 * self.done // self.total if self.total else 0
            if now - self._printed_at >= self.interval or quarter > self._quarter:
                self._quarter = quarter
                self._print_plain()

    # ------------------------------------------------------------------ figures

    def rate(self) -> float | None:
        """Units per second over the last ~30 s of this run (None until there is one)."""
        if len(self._window) < 2:
            return None
        (t0, n0), (t1, n1) = self._window[0], self._window[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 and n1 > n0 else None

    def parts(self) -> dict[str, str]:
        elapsed = time.monotonic() - self._started if self._started is not None else 0.0
        rate = self.rate()
        left = self.total - self.done
        eta = clock(left / rate) if rate and left > 0 else ("0:00" if left <= 0 else "?")
        pct = f"{100 * self.done // self.total}%" if self.total else ""
        if rate is None:
            speed = ""
        elif rate >= 100:
            speed = f"{rate:.0f} {self.unit}/s"
        elif rate >= 1:
            speed = f"{rate:.3g} {self.unit}/s"
        else:
            speed = f"{1 / rate:.3g} s/{self.unit}"
        return {
            "desc": self.description,
            "count": f"{self.done}/{self.total}",
            "pct": pct,
            "rate": speed,
            "elapsed": clock(elapsed),
            "eta": f"eta {eta}",
            "extra": self.extra,
        }

    def line(self, width: int, *, bar: bool) -> Text:
        p = self.parts()
        full = [p["count"], p["pct"], p["rate"], p["elapsed"], p["eta"]]
        core = [p["count"], p["pct"], p["rate"], p["eta"]]
        extras = p["extra"].split(" ") if p["extra"] else []

        def length(items: list[str], bar_width: int) -> int:
            words = [w for w in [p["desc"], *items] if w]
            return len(" ".join(words)) + (bar_width + 1 if bar_width else 0)

        shown = full
        # Drop extras from the end, then the elapsed time, until a minimal bar fits.
        while extras and length(shown + extras, MIN_BAR if bar else 0) > width:
            extras.pop()
        if length(shown + extras, MIN_BAR if bar else 0) > width:
            shown = core
        items = shown + extras
        bar_width = 0
        if bar:
            room = width - length(items, 0) - 1
            bar_width = min(room, 40) if room >= MIN_BAR else 0
        text = Text(p["desc"], style="bold")
        if bar_width:
            filled = round(bar_width * self.done / self.total) if self.total else bar_width
            text.append(" ")
            text.append("━" * filled, style="green")
            text.append("━" * (bar_width - filled), style="grey37")
        for item in items:
            if item:
                text.append(" " + item)
        text.truncate(width, overflow="ellipsis")
        return text

    def _print_plain(self) -> None:
        self._printed_at = time.monotonic()
        self._printed_done = self.done
        self.console.print(self.line(max(self.console.width, 80), bar=False), soft_wrap=True)


SUMMARY_WIDTH = 80


def summary_lines(phrases: list[str], width: int = SUMMARY_WIDTH) -> list[str]:
    """A command's closing summary as short lines: the phrases packed greedily into lines of at
    most `width` columns (continuations indented), each phrase kept whole, never one long line
    a terminal or a log viewer folds anywhere. A phrase longer than a line (a deep path) gets a
    line of its own."""
    lines: list[str] = []
    for phrase in phrases:
        if lines and len(lines[-1]) + 1 + len(phrase) <= width:
            lines[-1] += " " + phrase
        else:
            lines.append(("  " if lines else "") + phrase)
    return lines


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"
