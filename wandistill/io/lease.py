"""One writer on an object store (no flock there): `LeaseLock`, a lock object refreshed by a
heartbeat and taken over once its lease runs out. Moved out of `storage.py`; `outputs.py` and the
zarr backend hold it."""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any

from wandistill.errors import UsageError
from wandistill.io.folderkind import _printable
from wandistill.io.storage import FsspecStorage
from wandistill.runtime import waiting

LOCK_LEASE_S = 60.0
"""An object-store lock not refreshed for this long is stale (its holder died)."""
LOCK_SETTLE_S = 0.5
"""How long a new holder waits before reading its lock back (see `LeaseLock`)."""
CLOCK_SKEW_S = 5.0
"""A heartbeat this far in the future is still believed (clocks of two hosts differ a little);
further ahead, the writer's clock is wrong and only the reader's own clock can tell."""


def holder_identity() -> dict[str, Any]:
    """Who holds a lock: host and pid (what makes a lock stale once that pid is gone on this
    host), start time and command (what a refusal shows the user)."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": " ".join(["wandistill", *sys.argv[1:3]])[:120],
    }


class LeaseLock:
    """One writer on an object store, where there is no flock: a lock object created with a
    conditional PUT (`If-None-Match: *`), holding host, pid, start, a random token and a
    heartbeat that a thread refreshes every lease / 4 seconds.

    When a lock is stale (`verdict`). Its lifetime is bounded whatever its heartbeat says: a
    reader remembers, on its own monotonic clock, when it first saw each version of the lock
    object, and a version unchanged for a whole lease is stale, since a live holder rewrites it
    every lease / 4. That holds for a heartbeat in the future (a writer whose clock runs
    ahead), NaN, missing or garbage. Shortcuts: a believable heartbeat (a number, not more than
    CLOCK_SKEW_S ahead) older than the lease is stale at once (a crashed writer's lock is taken
    over without waiting), and so is a lock whose holder ran on this host under a pid that is
    gone (a `kill -9`). An unbelievable heartbeat is watched (`acquire(watch=True)`) for up to
    a lease, with one line saying so, and taken over if it does not change.

    A stale lock is deleted and taken. The delete is not conditional (S3 has no
    compare-and-delete that s3fs exposes), so two runs taking over one stale lock at once could
    each delete the other's fresh lock. Tokens fence that: a new holder reads its lock back
    after LOCK_SETTLE_S and yields to the token it finds there; a heartbeat never overwrites
    another run's lock (it marks this one `lost` and stops); release deletes the lock only if
    it is still this run's.
    """

    def __init__(
        self, store: FsspecStorage, rel: str, me: dict[str, Any], lease_s: float | None = None
    ) -> None:
        self.store, self.rel, self.me = store, rel, me
        self.lease_s = LOCK_LEASE_S if lease_s is None else lease_s
        self.token = uuid.uuid4().hex
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: dict[bytes, float] = {}
        """Each version of the lock object seen -> when, on this process's monotonic clock."""

    @property
    def is_locked(self) -> bool:
        return self._thread is not None

    @property
    def url(self) -> str:
        return self.store.name(self.rel)

    def _body(self) -> bytes:
        beat = {**self.me, "token": self.token, "heartbeat": time.time(), "lease_s": self.lease_s}
        return json.dumps(beat).encode()

    def _raw(self) -> bytes | None:
        """The lock object's bytes (None if there is none)."""
        size = self.store.size(self.rel)
        if size is None:
            return None
        if size > 1 << 16:
            return b"(oversized)"
        try:
            return bytes(
                self.store._call(self.rel, self.store.fs.cat_file, self.store.key(self.rel))
            )
        except FileNotFoundError:
            return None

    def holder(self) -> dict[str, Any] | None:
        """The lock object's content (None if there is none; {} if unreadable)."""
        raw = self._raw()
        if raw is None:
            return None
        self._seen.setdefault(raw, time.monotonic())
        try:
            info = json.loads(raw)
        except (ValueError, RecursionError):
            return {"_raw": raw}
        return {**info, "_raw": raw} if isinstance(info, dict) else {"_raw": raw}

    def verdict(self, holder: dict[str, Any]) -> str:
        """ "stale", "alive" or "watch" (a heartbeat that cannot be believed, not yet watched
        for a whole lease): see the class docstring."""
        raw = holder.get("_raw", b"")
        first = self._seen.setdefault(raw, time.monotonic())
        if time.monotonic() - first > self.lease_s:
            return "stale"  # unchanged for a whole lease on this reader's clock
        pid = holder.get("pid")
        if holder.get("host") == socket.gethostname() and type(pid) is int and 0 < pid < 1 << 31:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return "stale"
            except PermissionError:
                pass
        beat = holder.get("heartbeat")
        if type(beat) in (int, float) and math.isfinite(beat):
            age = time.time() - beat
            if age > self.lease_s:
                return "stale"
            if age >= -CLOCK_SKEW_S:
                return "alive"
        return "watch"

    def _settle(self) -> None:
        time.sleep(LOCK_SETTLE_S)

    def _mine(self, holder: dict[str, Any] | None) -> bool:
        return holder is not None and holder.get("token") == self.token

    def acquire(self, *, watch: bool = True) -> dict[str, Any] | None:
        """Take the lock (None), or return the live holder's details. `watch`: a lock whose
        heartbeat cannot be believed is watched here (up to a lease, announced) until it
        changes (alive) or not (stale); else it counts as held and a later call decides."""
        for _ in range(3):
            if self.store.create(self.rel, self._body()):
                self._settle()  # a racing takeover's delete + create shows by now
                holder = self.holder()
                if holder is None:
                    continue  # deleted by a racing takeover that has not created yet: again
                if not self._mine(holder):
                    return holder  # that run took it: it is the live holder
                self._thread = threading.Thread(
                    target=self._beat, name="wandistill-lock-heartbeat", daemon=True
                )
                self._thread.start()
                return None
            holder = self.holder()
            if holder is None:
                continue  # released between our create and our read: try again
            state = self.verdict(holder)
            if state == "watch" and watch:
                state = self._watch(holder)
            if state != "stale":
                return holder
            self.store.rm(self.rel)
        return self.holder() or {}

    def _watch(self, holder: dict[str, Any]) -> str:
        """Watch a lock with an unbelievable heartbeat until it changes or a lease passes."""
        waiting.say(
            f"lock object {self.url} has heartbeat {str(holder.get('heartbeat'))[:40]!r} "
            f"({_beat_text(holder.get('heartbeat'))}); watching it for up to {self.lease_s:g} s "
            "on this machine's clock: a live holder rewrites it, a dead one's is taken over"
        )
        raw = holder.get("_raw")
        while True:
            time.sleep(min(1.0, self.lease_s / 8))
            now = self.holder()
            if now is None or now.get("_raw") != raw:
                return "alive"  # rewritten (a live holder) or released: let the caller retry
            state = self.verdict(now)
            if state != "watch":
                return state

    def refusal(self, holder: dict[str, Any], label: str, flag: str) -> UsageError:
        """The one-line refusal for a live holder: who, and how to remove the lock safely."""
        return UsageError(
            f"{label} is in use by another wandistill process ({holder_text(holder)}); its "
            f"lock object is {self.url}",
            fix=f"wait for it to finish, or choose another {flag}; if that process is gone "
            f"(check its host and pid), delete the lock object (`aws s3 rm {self.url}`, or "
            f"any tool for the store) and re-run; an abandoned lock is taken over by itself "
            f"once it has not changed for {self.lease_s:g} s",
        )

    def beat_once(self) -> bool:
        """Refresh the heartbeat unless another run holds the lock now (then mark it lost)."""
        holder = self.holder()
        if holder is not None and not self._mine(holder):
            self.lost = True
            return False
        self.store.put(self.rel, self._body())
        return True

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            try:
                if not self.beat_once():
                    return
            except Exception:  # a missed beat is retried; the lease is long
                continue

    def release(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        with contextlib.suppress(Exception):
            if self._mine(self.holder()):
                self.store.rm(self.rel)


def _beat_text(beat: Any) -> str:
    if type(beat) in (int, float) and math.isfinite(beat):
        return f"{beat - time.time():.0f} s in the future: is the writer's clock ahead?"
    return "not a time"


def holder_text(info: dict[str, Any]) -> str:
    """Who holds a lock, as a refusal shows it (every field made printable and short)."""
    if not {k for k in info if k != "_raw"}:
        return "holder not known yet: it is starting, or its lock object is unreadable"
    fields = {k: _printable(info.get(k, "?")) for k in ("command", "host", "pid", "started")}
    return (
        f"{fields['command']}: host {fields['host']}, pid {fields['pid']}, "
        f"started {fields['started']}"
    )
