"""The background cache writer: records written in order by its thread, its errors raised in
the caller's thread, and close / abort ending exactly as the synchronous writer would."""

from __future__ import annotations

from typing import Any

import pytest

from wandistill.cache.background import BackgroundWriter
from wandistill.errors import CacheError


class Recorder:
    """A CacheWriter stand-in: what was written, committed and dropped, in order."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.calls: list[Any] = []
        self.records_written = self.records_skipped = self.bytes_written = 0

    def write(self, record: Any) -> bool:
        if record == self.fail_at:
            raise CacheError(f"cannot write record {record}: No space left on device")
        self.calls.append(record)
        return True

    def close(self) -> None:
        self.calls.append("close")

    def abort(self) -> None:
        self.calls.append("abort")


def test_every_record_is_written_in_order_and_close_commits_after_them() -> None:
    inner = Recorder()
    w = BackgroundWriter(inner, depth=2)  # type: ignore[arg-type]
    for i in range(7):
        w.write(i)
    w.close()
    assert inner.calls == [*range(7), "close"]


def test_a_write_error_is_raised_in_the_callers_thread_and_later_records_are_dropped() -> None:
    inner = Recorder(fail_at=2)
    w = BackgroundWriter(inner, depth=1)  # type: ignore[arg-type]
    with pytest.raises(CacheError, match="cannot write record 2: No space left"):
        for i in range(6):
            w.write(i)
        w.drain()
    w.abort()
    assert inner.calls[:2] == [0, 1] and inner.calls[-1] == "abort"
    assert not any(isinstance(c, int) and c > 2 for c in inner.calls)


def test_close_raises_an_error_not_yet_seen_and_drops_the_open_shard() -> None:
    inner = Recorder(fail_at=0)
    w = BackgroundWriter(inner, depth=4)  # type: ignore[arg-type]
    w.write(0)
    with pytest.raises(CacheError, match="cannot write record 0"):
        w.close()
    assert inner.calls == ["abort"]


def test_abort_writes_what_was_handed_over_then_drops_the_open_shard() -> None:
    inner = Recorder()
    w = BackgroundWriter(inner, depth=8)  # type: ignore[arg-type]
    for i in range(3):
        w.write(i)
    w.abort()
    assert inner.calls == [0, 1, 2, "abort"]


def test_a_writer_given_no_record_starts_no_thread_and_closes_at_once() -> None:
    inner = Recorder()
    w = BackgroundWriter(inner)  # type: ignore[arg-type]
    w.drain()
    w.close()
    assert inner.calls == ["close"] and w._thread is None
