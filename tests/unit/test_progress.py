"""The progress line: fits the terminal, plain periodic lines in logs, silent when disabled."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from wandistill.runtime.progress import Progress, clock

FIELDS = {"loss": 0.123456, "samples/s": 1024.5, "data_wait": 0.0123, "lr": 3e-4}


def _console(width: int, terminal: bool = False) -> Console:
    return Console(file=io.StringIO(), width=width, force_terminal=terminal, color_system=None)


@pytest.mark.parametrize("width", [40, 60, 80, 100, 160])
def test_line_fits_the_width_and_keeps_count_and_eta(width: int) -> None:
    p = Progress(total=123456, description="precompute", unit="prompts", console=_console(width))
    with p:
        p.advance(1000, **FIELDS)
        p.advance(1000, **FIELDS)
    for bar in (True, False):
        text = p.line(width, bar=bar).plain
        assert len(text) <= width
        if width >= 60:
            assert "2000/123456" in text and "eta" in text


def test_wide_terminal_shows_every_field_and_a_bar() -> None:
    p = Progress(total=10, description="train", unit="step", console=_console(200))
    with p:
        p.advance(5, **FIELDS)
    text = p.line(200, bar=True).plain
    assert "━" in text
    assert all(f"{k}=" in text for k in FIELDS)


def test_plain_lines_in_logs_at_each_quarter_and_at_the_end() -> None:
    console = _console(80)
    with Progress(total=8, description="train", console=console, interval=1e9) as p:
        for _ in range(8):
            p.advance(1)
    lines = console.file.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["2/8", "4/8", "6/8", "8/8"]
    assert all(len(line) <= 80 for line in lines)


def test_disabled_progress_prints_nothing() -> None:
    console = _console(80)
    with Progress(total=4, description="train", console=console, enabled=False, interval=0) as p:
        p.advance(4, loss=1.0)
    assert console.file.getvalue() == ""


def test_work_done_before_the_start_counts_in_total_not_in_rate() -> None:
    p = Progress(total=100, description="train", console=_console(80), initial=90)
    with p:
        assert p.rate() is None
        assert p.parts()["count"] == "90/100"


def test_clock_formats() -> None:
    assert [clock(s) for s in (0, 7, 754, 3723)] == ["0:00", "0:07", "12:34", "1:02:03"]
