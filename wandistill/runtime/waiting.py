"""No silent wait: whatever blocks for more than a few seconds says what it waits for.

Rendezvous, `train --follow`, object-store calls and lock takeovers all wait on something
outside the process. A user watching a silent terminal cannot tell a slow endpoint from a
dead peer, so every such wait prints one line naming what it waits for, how long it has waited
and when it gives up (`say`), on rank 0 only (the other ranks wait for the same thing).

`Watched` covers calls that are usually instant but can hang (one object-store request): one
daemon thread looks at the calls in flight once a second and prints one line when the oldest
has run past NOTICE_S, then at most one line per REPEAT_S while calls stay slow (16 reader
threads stuck on one endpoint are one line, not 16; a long stall still shows it goes on).
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time

NOTICE_S = 3.0
"""A wait longer than this is announced."""
REPEAT_S = 10.0
"""`Watched`: at most one line per this many seconds (a stall across many calls repeats it, so
a long one still shows it goes on)."""


def say(message: str) -> None:
    """One `waiting:` line on stderr, on rank 0."""
    if os.environ.get("RANK", "0") in ("", "0"):
        print(f"waiting: {message}", file=sys.stderr, flush=True)


class Watched:
    """Calls in flight, announced once when one of them outlives NOTICE_S."""

    def __init__(self, notice_s: float = NOTICE_S) -> None:
        self.notice_s = notice_s
        self._calls: dict[int, tuple[float, str, str]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._last = -REPEAT_S

    def start(self, what: str, limit: str) -> int:
        """Register a call (`what` it waits for, `limit`: when it gives up); its id."""
        with self._lock:
            n = next(self._ids)
            self._calls[n] = (time.monotonic(), what, limit)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="wandistill-wait-notice", daemon=True
                )
                self._thread.start()
        return n

    def end(self, n: int) -> None:
        with self._lock:
            self._calls.pop(n, None)

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.notice_s / 2))
            with self._lock:
                if not self._calls:
                    continue
                start, what, limit = min(self._calls.values())
                now = time.monotonic()
                waited = now - start
                if waited < self.notice_s or now - self._last < REPEAT_S:
                    continue
                self._last = now
                others = len(self._calls) - 1
            more = f" (and {others} other call(s))" if others else ""
            say(f"{what}{more}: no answer for {waited:.0f} s; {limit}")
