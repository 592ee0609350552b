"""Follow mode of the training reader: train on a cache that is still being written.

Why its own module: polling, generations and the writer watch are one concept beside the epoch
plan. `FollowMode` is a mixin of `TrainingReader` (cache/training.py), whose state it uses:
shards are taken in generations as they are committed, each generation shuffled on its own
(`FollowPool` drops it once trained on), and ranks agree on what they have seen through the
reader's `sync` and `agree` collectives, until the manifest says complete and the data is
exhausted. When nothing new arrives it looks at the writer: a cache no process writes any more
stops training in one line.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

from wandistill.cache.files import Entry
from wandistill.cache.multi import mix
from wandistill.cache.samples import FollowPool, Sample
from wandistill.errors import CacheError
from wandistill.runtime import waiting


class FollowMode:
    """`TrainingReader`'s follow-mode planner (see the module docstring)."""

    def _follow_plan(self) -> Iterator[tuple[tuple[int, int], list[Sample]] | None]:
        """Batches over generations of newly committed shards, until complete and exhausted."""
        by_name: dict[str, tuple[int, Entry]] = {}
        self.pool = pool = FollowPool()
        emitted = 0
        resume_at = self.batches_done
        replay = [list(g) for g in self.generations]
        self.generations = []
        seen: set[str] = set()
        idle_since = time.monotonic()
        idle_polls = 0
        """Polls in a row that found nothing new: the same count on every rank (`sync`)."""
        complete = False
        while True:
            if replay:
                names = replay.pop(0)
                self._poll(by_name)
                missing = [n for n in names if n not in by_name]
                if missing:
                    raise CacheError(f"cannot resume follow mode: shards {missing} vanished")
            else:
                yield None  # about to poll: let the consumer drain what is planned first
                done = self._poll(by_name)
                fresh = sorted(n for n in by_name if n not in seen)
                names, complete = self.sync(fresh, done)
            if names:
                idle_since, idle_polls = time.monotonic(), 0
                gen_index = len(self.generations)
                self.generations.append(list(names))
                seen.update(names)
                chunk = self._generation_space(names, by_name)
                pool.extend(chunk.shuffled(self._permutation(len(chunk), "follow", gen_index)))
            while len(pool) - emitted * self.global_batch >= self.global_batch:
                if emitted >= resume_at:
                    yield from self._step_items(pool, emitted, 0)
                emitted += 1
                pool.drop_before(emitted * self.global_batch)
            if replay or names:
                continue
            if complete:
                return
            idle_polls += 1
            if idle_polls % self._polls_per_check() == 0:
                self._check_writer(first=idle_polls == self._polls_per_check())
            if (
                self.follow_timeout is not None
                and time.monotonic() - idle_since > self.follow_timeout
            ):
                raise CacheError(
                    f"follow mode: no new shard in "
                    f"{', '.join(repr(str(s.path)) for s in self.stores if not s.complete)} "
                    f"for {self.follow_timeout:.0f} s and the manifest is not complete",
                    fix="check that precompute is still running",
                )
            time.sleep(self.poll_interval)

    def _poll(self, by_name: dict[str, tuple[int, Entry]]) -> bool:
        """Add every cache's committed shards to `by_name` (qualified name -> (cache, entry));
        whether every cache is complete."""
        for n, store in enumerate(self.stores):
            store.refresh()
            by_name.update({self._qualified(n, e.name): (n, e) for e in store.entries})
        return all(s.complete for s in self.stores)

    def _generation_space(self, names: list[str], by_name: dict[str, tuple[int, Entry]]) -> Any:
        """One follow generation's samples: each cache's new shards, back to back."""
        spaces = [
            self._space([by_name[q][1] for q in names if by_name[q][0] == n], n)
            for n in range(len(self.stores))
        ]
        return spaces[0] if len(spaces) == 1 else mix(spaces, (), self._permutation, 0)

    def _polls_per_check(self) -> int:
        """Idle polls between two looks at the cache's writer: about every NOTICE_S seconds."""
        return max(1, math.ceil(waiting.NOTICE_S / max(self.poll_interval, 1e-3)))

    def _check_writer(self, *, first: bool) -> None:
        """Follow mode found nothing new for a while: stop, in one line, if no process writes
        an incomplete cache any more (only its writer could complete it); else say what it waits
        for, once per idle spell. Every rank looks and all must agree (`agree`), so all stop
        together or none does."""
        from wandistill.io.outputs import writer_gone

        gone, path, store = None, "", self.store
        for store in self.stores:
            if store.complete:
                continue
            path = store.path
            gone = writer_gone(store.storage)
            if gone is not None:
                store.refresh()  # completed just before its writer let go: not gone
                if store.complete:
                    gone = None
            if gone is not None:
                break
        if self.agree(gone is not None):
            raise CacheError(
                f"--follow: cache {path!r} is not complete ({len(store)} records "
                f"committed) and nothing writes it any more: {gone or 'another rank saw so'}",
                fix="re-run `wandistill precompute` with --out at this cache to finish it (it "
                "resumes), or train without --follow on the records committed so far",
            )
        if first and self.rank == 0:
            limit = (
                f"giving up after {self.follow_timeout:g} s without one (train.follow_timeout)"
                if self.follow_timeout
                else "no time limit (train.follow_timeout = 0)"
            )
            where = ", ".join(str(s.path) for s in self.stores if not s.complete)
            records = sum(len(s) for s in self.stores)
            waiting.say(
                f"for new shards in {where} ({records} records committed, its writer "
                f"is running); {limit}"
            )
