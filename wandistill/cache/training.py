"""The training reader: (record, recorded step) samples from a cache, built for DDP.

Why not stock webdataset streaming: uneven shards give ranks different batch counts and DDP hangs
at the last all-reduce, order depends on worker count, and a sample would read a whole record to
use one step of it. Here the sample space is every (record, step) pair of the committed records,
sorted by key, so it does not depend on how the cache was sharded or by how many writers:

- epoch order is one permutation of that space per (seed, epoch), independent of world size;
- one optimizer step consumes a global batch of G = B*A*W samples (B per micro-batch, A
  accumulation micro-steps, W ranks): step g is `perm[g*G : (g+1)*G]`, cut into A*W micro-batches
  of B, and micro-step m of rank r takes micro-batch m*W + r. So every layout with the same B*A*W
  sees the same micro-batches in every step, across epoch boundaries too (N ranks x A micro-steps
  trains like 1 rank x N*A), and every rank yields exactly A * (len(space) // G) batches per epoch
  (the tail is dropped, as DDP requires);
- the state is (epoch, optimizer steps consumed): resuming mid-epoch is exact;
- `slots` narrows the space to the recorded steps the objectives use, and `with_next` adds the
  next point of each sample's trajectory (`xt_next`, `timesteps_next`: the next recorded step, or
  after the last one the final latent with t = 0 and `next_is_final`), for consistency training;
- each batch is one task of a thread pool, read `max(prefetch_batches, num_threads)` batches
  ahead of the consumer; each sample is a few positioned reads (the step's rows of x_t and the
  teacher output, the embedding) straight into its row of the batch tensors (cache/batch.py),
  so no byte is copied twice.

Follow mode trains on a cache that is still being written: shards are taken in "generations" as
they are committed, each generation shuffled on its own (and dropped from memory once trained
on: `FollowPool`), and batches are emitted as soon as a whole global batch is available, until
the manifest says complete and the data is exhausted.
Ranks agree on what they have seen through a `sync` collective supplied by the caller, so this
module stays free of torch.distributed.

Several caches (`cache` a list, `weights` optional) are one sample space: each cache's own space
(its own held-out split), back to back in argument order, drawn by weight each epoch
(`cache/multi.py`), then shuffled and cut into global batches as above, so equal batches per
rank, determinism and exact resume hold unchanged. Follow mode polls every cache; a follow
generation names its shards `<cache index>:<shard>`.
"""

from __future__ import annotations

import copy
import hashlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wandistill.cache.batch import BatchBuffers, RowsOf
from wandistill.cache.choices import check_weights
from wandistill.cache.contract import is_holdout
from wandistill.cache.files import Entry
from wandistill.cache.multi import check_compatible, check_unique_keys, mix
from wandistill.cache.reader import CacheReader
from wandistill.errors import CacheError, CorruptRecordError, UsageError
from wandistill.io.storage import is_transient
from wandistill.runtime import waiting

DEFAULT_FIELDS = ("prompt_embeds", "xt", "timesteps", "teacher_out")
SyncFn = Callable[[list[str], bool], tuple[list[str], bool]]
"""(shard names this rank sees, manifest complete?) -> what every rank agrees on."""

Sample = tuple[Entry, int, int]
"""(shard entry, row in shard, recorded-step slot)."""


class SampleSpace:
    """Every (record, step) sample of some shards, in key order, as arrays: sample j is record
    j // len(slots) at slot j % len(slots), and `order` (a permutation) presents them shuffled.
    A list of `Sample` tuples, plus its shuffled copy, took ~100 bytes a sample (about 1 GB per
    rank for 1M records x 8 steps; tests/bench/scale.py); this holds 8 bytes a record plus 8 a
    sample of `order`."""

    def __init__(self, entries: list[Entry], rows: list[tuple[int, int]], slots: list[int]) -> None:
        self.entries = entries
        self._entry = np.fromiter((e for e, _ in rows), dtype=np.int32, count=len(rows))
        self._row = np.fromiter((i for _, i in rows), dtype=np.int32, count=len(rows))
        self.slots = slots
        self.order: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self._row) * len(self.slots)

    def shuffled(self, order: torch.Tensor) -> SampleSpace:
        view = copy.copy(self)
        view.order = order
        return view

    def __getitem__(self, j: int) -> Sample:
        if self.order is not None:
            j = int(self.order[j])
        r, s = divmod(j, len(self.slots))
        return self.entries[int(self._entry[r])], int(self._row[r]), self.slots[s]


class FollowPool:
    """Follow mode's planned samples: each generation's shuffled `SampleSpace`, back to back,
    indexed by position in the run. Generations wholly consumed are dropped (`drop_before`), so
    memory stays at the generations not yet trained on, not every sample of the run (the list
    of `Sample` tuples this replaces kept ~100 bytes a sample for the whole run)."""

    def __init__(self) -> None:
        self._spaces: deque[tuple[int, SampleSpace]] = deque()
        self._end = 0

    def __len__(self) -> int:
        """Samples planned since the run started, dropped ones included."""
        return self._end

    def extend(self, space: SampleSpace) -> None:
        if len(space):
            self._spaces.append((self._end, space))
            self._end += len(space)

    def __getitem__(self, j: int) -> Sample:
        for start, space in self._spaces:
            if start <= j < start + len(space):
                return space[j - start]
        raise IndexError(f"sample {j} is not planned or was dropped")

    def drop_before(self, j: int) -> None:
        """Forget the generations whose samples all come before position j."""
        while self._spaces and self._spaces[0][0] + len(self._spaces[0][1]) <= j:
            self._spaces.popleft()

    def held(self) -> int:
        """Samples still held (what the follow-mode test bounds)."""
        return sum(len(space) for _, space in self._spaces)


def pad_to(embeds_BLD: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad a batch padded to its own longest prompt up to `length` (e.g. on the GPU)."""
    extra = length - embeds_BLD.shape[1]
    if extra < 0:
        raise ValueError(f"embeddings of length {embeds_BLD.shape[1]} exceed {length}")
    return torch.nn.functional.pad(embeds_BLD, (0, 0, 0, extra)) if extra else embeds_BLD


def _seed_for(*parts: Any) -> int:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _local_sync(names: list[str], complete: bool) -> tuple[list[str], bool]:
    return names, complete


def _open_caches(
    cache: str | Path | CacheReader | Sequence[str | Path | CacheReader],
    weights: Sequence[float],
    follow: bool,
) -> tuple[list[CacheReader], list[float]]:
    """The caches a reader draws from, opened and checked to agree (one header, no key in two),
    with their checked sampling weights."""
    caches = list(cache) if isinstance(cache, list | tuple) else [cache]
    stores = [c if isinstance(c, CacheReader) else CacheReader(c) for c in caches]
    checked = check_weights(list(weights), len(stores))
    if checked and follow:
        raise UsageError(
            "train.cache_weights cannot be used with --follow (a cache still being written "
            "has no size to take a share of)",
            fix="drop train.cache_weights, or train without --follow once precompute is done",
        )
    if len(stores) > 1:
        check_compatible(stores)
        check_unique_keys(stores)
    return stores, checked


class TrainingReader:
    """Iterate per-rank batches of (record, step) samples; see the module docstring."""

    def __init__(
        self,
        cache: str | Path | CacheReader | Sequence[str | Path | CacheReader],
        *,
        weights: Sequence[float] = (),
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        grad_accum: int = 1,
        seed: int = 0,
        fields: tuple[str, ...] | list[str] = DEFAULT_FIELDS,
        slots: list[int] | None = None,
        with_next: bool = False,
        next_slots: Sequence[int] | None = None,
        follow: bool = False,
        poll_interval: float = 1.0,
        follow_timeout: float | None = None,
        sync: SyncFn | None = None,
        agree: Callable[[bool], bool] | None = None,
        num_threads: int = 4,
        prefetch_batches: int = 2,
        include_holdout: bool = False,
        skip_corrupt: bool = False,
        pad: str = "max_sequence_length",
    ) -> None:
        if batch_size <= 0 or world_size <= 0 or grad_accum <= 0 or not 0 <= rank < world_size:
            raise UsageError(
                f"bad reader layout: batch_size={batch_size}, grad_accum={grad_accum}, "
                f"rank={rank}, world_size={world_size}"
            )
        self.stores, self.weights = _open_caches(cache, weights, follow)
        self.store = self.stores[0]
        """The first cache: the manifest every cache agrees with (cache/multi.py)."""
        self._owner: dict[int, int] = {}
        """id(shard entry) -> index of the cache it belongs to (set as spaces are built)."""
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.grad_accum = grad_accum
        self.seed = seed
        self.fields = list(fields)
        self.num_slots = len(self.store.manifest.settings.record_steps or [0])
        self.slots = sorted(set(range(self.num_slots) if slots is None else slots))
        if not self.slots or not all(0 <= s < self.num_slots for s in self.slots):
            raise UsageError(f"slots={slots} must be recorded-step slots in [0, {self.num_slots})")
        self.with_next = with_next
        self.next_slots = list(next_slots) if next_slots is not None else None
        """with_next: slot -> the slot read as the next point (default slot + 1; num_slots or
        more: the final latent); perflow's window ends."""
        self.follow = follow
        self.poll_interval = poll_interval
        self.follow_timeout = follow_timeout
        self.sync = sync or _local_sync
        self.agree = agree or bool
        """Follow mode: True on every rank when it is True on every rank (dist.all_agree)."""
        self.num_threads = num_threads
        self.prefetch_batches = max(1, prefetch_batches, num_threads)
        """Batches read ahead, one task each: at least one per thread."""
        self.holdouts = [
            0.0 if include_holdout else (s.manifest.settings.holdout_fraction or 0.0)
            for s in self.stores
        ]
        """Each cache's own held-out fraction."""
        self.holdout = self.holdouts[0]
        self.skip_corrupt = skip_corrupt
        if pad not in ("max_sequence_length", "batch"):
            raise UsageError(f"pad={pad!r} must be 'max_sequence_length' or 'batch'")
        self.pad = pad
        self.corrupt: list[str] = []
        """One line per skipped sample ("corrupt record ...") or shard ("unusable shard ...")."""
        self._unusable: dict[str, str] = {}
        self._last_good: dict[str, Any] | None = None
        self.wait_seconds = 0.0
        # Position: epoch and optimizer steps (global batches) consumed in it (normal mode), or
        # the list of follow generations and steps consumed overall (follow mode).
        self.epoch = 0
        self.batches_done = 0
        self.generations: list[list[str]] = []
        self.pool: FollowPool | None = None
        """Follow mode's planned samples, once iteration started."""

    # ------------------------------------------------------------------ sample space

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks and micro-steps."""
        return self.batch_size * self.grad_accum * self.world_size

    def _qualified(self, n: int, name: str) -> str:
        """A shard's name unique over the caches (cache index prefixed when there are several)."""
        return name if len(self.stores) == 1 else f"{n}:{name}"

    def _usable(self, entries: Sequence[Entry], n: int = 0) -> list[Entry]:
        """Drop shards of cache n whose file is missing or truncated (a stat each): refuse them,
        or with skip_corrupt skip them whole and report each once."""
        fresh = [e for e in entries if self._qualified(n, e.name) not in self._unusable]
        bad = self.stores[n].unusable(fresh) if fresh else {}
        for e in fresh:
            why = bad.get(e.name)
            if why is None:
                continue
            if not self.skip_corrupt:
                raise CacheError(
                    f"unusable {why}", fix="run `wandistill cache verify`, or pass --skip-corrupt"
                )
            self._unusable[self._qualified(n, e.name)] = why
            self.corrupt.append(f"unusable {why}; its {len(e.keys)} records skipped")
        return [e for e in entries if self._qualified(n, e.name) not in self._unusable]

    def _space(self, entries: Sequence[Entry], n: int = 0) -> SampleSpace:
        """Every (record, step) of these shards of cache n, sorted by key so sharding does not
        matter."""
        usable = self._usable(entries, n)
        holdout = self.holdouts[n]
        for e in usable:
            self._owner[id(e)] = n
        rows = sorted(
            (
                (key, e.name, i, k)
                for k, e in enumerate(usable)
                for i, key in enumerate(e.keys)
                if not is_holdout(key, holdout)
            ),
        )  # by key, then shard name and row: a key listed twice sorts the same every time
        return SampleSpace(usable, [(k, i) for _, _, i, k in rows], list(self.slots))

    def _spaces(self) -> list[SampleSpace]:
        """Each cache's committed samples."""
        return [self._space(s.entries, n) for n, s in enumerate(self.stores)]

    def _epoch_space(self, spaces: list[SampleSpace], epoch: int) -> Any:
        """Epoch `epoch`'s samples, unshuffled: one cache's space as it is, several back to
        back, each drawn by its weight (cache/multi.py)."""
        if len(spaces) == 1 and not self.weights:
            return spaces[0]
        return mix(spaces, self.weights, self._permutation, epoch)

    def _store_of(self, entry: Entry) -> CacheReader:
        return self.stores[self._owner.get(id(entry), 0)]

    def steps_per_epoch(self) -> int:
        """Optimizer steps (global batches) per epoch (the weights change what an epoch holds,
        not its length)."""
        return sum(len(s) for s in self._spaces()) // self.global_batch

    def batches_per_epoch(self) -> int:
        """Micro-batches this rank yields per epoch."""
        return self.steps_per_epoch() * self.grad_accum

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "batches_done": self.batches_done,
            "seed": self.seed,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "grad_accum": self.grad_accum,
            "follow": self.follow,
        }
        if self.follow:
            state["generations"] = [list(g) for g in self.generations]
        if len(self.stores) > 1:
            state["caches"] = [str(s.path) for s in self.stores]
            state["weights"] = list(self.weights)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("follow", False) != self.follow:
            raise UsageError("reader state was saved with a different follow setting")
        caches = state.get("caches") or [str(self.store.path)]
        weights = list(state.get("weights") or [])
        if len(caches) != len(self.stores) or weights != self.weights:
            raise UsageError(
                f"cannot resume: the checkpoint trained on {len(caches)} cache(s) {caches} with "
                f"weights {weights or 'none'}, this run has {len(self.stores)} with "
                f"{self.weights or 'none'}",
                fix="resume with the same --cache list and train.cache_weights, or choose a new "
                "--out",
            )
        self.epoch = int(state["epoch"])
        self.batches_done = int(state["batches_done"])
        old_global = (
            int(state["batch_size"]) * int(state["world_size"]) * int(state.get("grad_accum", 1))
        )
        if old_global != self.global_batch:
            # Another global batch: convert the position through the samples consumed.
            consumed = self.batches_done * old_global
            if consumed % self.global_batch:
                raise UsageError(
                    f"cannot resume: {consumed} samples consumed is not a multiple of the new "
                    f"global batch {self.global_batch}",
                    fix="resume with the same batch_size x grad_accum x world_size as the "
                    "checkpoint",
                )
            self.batches_done = consumed // self.global_batch
        self.generations = [list(g) for g in state.get("generations", [])]

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Yield this rank's batches; the planner runs ahead by `prefetch_batches`, each batch
        read by one pool thread straight into its batch tensors (`_read_batch`)."""
        plan = self._follow_plan() if self.follow else self._epoch_plan()
        with ThreadPoolExecutor(self.num_threads, thread_name_prefix="wandistill-read") as pool:
            try:
                yield from self._batches(pool, plan)
            finally:  # closed early: batches nobody will take are not read
                pool.shutdown(wait=True, cancel_futures=True)

    def _batches(self, pool: ThreadPoolExecutor, plan: Iterator[Any]) -> Iterator[dict[str, Any]]:
        pending: deque[tuple[tuple[int, int], list[Sample], Future[Any]]] = deque()
        exhausted = blocked = False
        while True:
            # Fill the prefetch queue, except that a planner about to poll the cache (follow
            # mode) waits until everything already planned has been handed over: polls then
            # happen at the same batch index on every rank, which keeps `sync` in lockstep.
            while not exhausted and len(pending) < self.prefetch_batches:
                if blocked and pending:
                    break
                blocked = False
                try:
                    item = next(plan)
                except StopIteration:
                    exhausted = True
                    break
                if item is None:
                    blocked = True
                    continue
                position, samples = item
                pending.append((position, samples, pool.submit(self._read_batch, samples)))
            if not pending:
                if exhausted:
                    return
                continue
            position, samples, future = pending.popleft()
            t0 = time.perf_counter()
            tensors, order = future.result()
            self.wait_seconds += time.perf_counter() - t0
            batch = self._collate(tensors, order, samples)
            # The position advances only when a batch is handed over, so a checkpoint taken
            # now resumes right after it, whatever was prefetched.
            self.epoch, self.batches_done = position
            yield batch

    def _permutation(self, n: int, *tag: Any) -> torch.Tensor:
        gen = torch.Generator().manual_seed(_seed_for(self.seed, *tag))
        return torch.randperm(n, generator=gen)

    def _micro_starts(self, g: int) -> list[int]:
        """Offsets of this rank's micro-batches of optimizer step g (micro m -> m*W + rank)."""
        first = g * self.global_batch
        return [
            first + (m * self.world_size + self.rank) * self.batch_size
            for m in range(self.grad_accum)
        ]

    def _step_items(
        self, pool: Any, g: int, epoch: int
    ) -> Iterator[tuple[tuple[int, int], list[Sample]]]:
        """This rank's micro-batches of step g; the position counts the step only once its last
        micro-batch is handed over, so a resume replays a partly consumed step whole."""
        for m, start in enumerate(self._micro_starts(g)):
            done = g + 1 if m == self.grad_accum - 1 else g
            yield (epoch, done), [pool[j] for j in range(start, start + self.batch_size)]

    def _epoch_plan(self) -> Iterator[tuple[tuple[int, int], list[Sample]]]:
        spaces = self._spaces()
        total = sum(len(s) for s in spaces)
        n = total // self.global_batch
        if n == 0:
            where = ", ".join(repr(str(s.path)) for s in self.stores)
            raise CacheError(
                f"cache {where} has {total} training samples, fewer than "
                f"one global batch ({self.batch_size} per micro-batch x {self.grad_accum} "
                f"accumulation x {self.world_size} ranks)",
                fix="lower train.batch_size or train.grad_accum, or precompute more prompts",
            )
        epoch, g = self.epoch, self.batches_done
        while True:
            if g >= n:
                epoch, g = epoch + 1, 0
            space = self._epoch_space(spaces, epoch)
            shuffled = space.shuffled(self._permutation(len(space), "epoch", epoch))
            while g < n:
                yield from self._step_items(shuffled, g, epoch)
                g += 1

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
            gone = writer_gone(path)
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

    # ------------------------------------------------------------------ reading

    def _read_batch(self, samples: list[Sample]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """(batch tensors, the sample in each row); runs in a pool thread. A skipped corrupt
        sample's row holds the batch's first good sample; no rows when none was good.

        In place when the backend can (`CacheReader.read_batch`): every tensor is read straight
        into its row of the batch, with no per-sample tensor and no stacking copy. Otherwise
        (fields stored in another dtype, `with_next`) each sample is read and decoded on its own
        and copied into its row."""
        pad = None if self.pad == "batch" else self.store.max_sequence_length
        groups: dict[int, list[int]] = {}
        for b, (entry, _, _) in enumerate(samples):
            groups.setdefault(self._owner.get(id(entry), 0), []).append(b)
        if len(groups) == 1:
            out, errors = self._read_rows(self.stores[next(iter(groups))], samples, pad)
        else:
            out, errors = self._read_mixed(groups, samples, pad)
        for (entry, row, _), e in zip(samples, errors, strict=True):
            if e is not None:
                self._failed(entry, row, e)
        good = [b for b, e in enumerate(errors) if e is None]
        if not good:
            return {}, []
        if "prompt_embeds" in out.lengths:
            out.tensors["prompt_len"] = torch.tensor(out.lengths["prompt_embeds"])
        if len(good) == len(samples):
            return out.tensors, good
        # Keep the batch shape: the first good sample takes the place of each skipped one.
        order = good + [good[0]] * (len(samples) - len(good))
        index = torch.tensor(order)
        tensors = {name: t[index] for name, t in out.tensors.items()}
        if self.pad == "batch":  # padded to the longest good sample only
            for name, lengths in out.lengths.items():
                longest = max(lengths[b] for b in good)
                tensors[name] = tensors[name][:, :longest].contiguous()
        return tensors, order

    def _read_rows(
        self, store: CacheReader, samples: list[Sample], pad: int | None
    ) -> tuple[BatchBuffers, list[BaseException | None]]:
        """Samples of one cache into one batch, in place where the backend can."""
        out = BatchBuffers(len(samples), pad)
        errors = None if self.with_next else store.read_batch(samples, self.fields, out)
        if errors is None:
            errors = self._read_each(samples, out)
        return out, errors

    def _read_mixed(
        self, groups: dict[int, list[int]], samples: list[Sample], pad: int | None
    ) -> tuple[BatchBuffers, list[BaseException | None]]:
        """A batch drawn from several caches: each cache's backend reads its samples straight
        into their rows of the one batch (`RowsOf`), no copy. Ragged fields are laid out at
        max_sequence_length (the rows are allocated before every cache has said how long its
        prompts are), then trimmed to the longest when the reader pads per batch."""
        out = BatchBuffers(len(samples), self.store.max_sequence_length)
        errors: list[BaseException | None] = [None] * len(samples)
        for n, rows in groups.items():
            view: Any = RowsOf(out, rows)
            mine = [samples[b] for b in rows]
            errs = None if self.with_next else self.stores[n].read_batch(mine, self.fields, view)
            if errs is None:
                errs = self._read_each(mine, view)
            for b, e in zip(rows, errs, strict=True):
                errors[b] = e
        if pad is None:
            for name, lengths in out.lengths.items():
                longest = max(lengths, default=0)
                if longest < out.tensors[name].shape[1]:
                    out.tensors[name] = out.tensors[name][:, :longest].contiguous()
        return out, errors

    def _read_each(self, samples: list[Sample], out: BatchBuffers) -> list[BaseException | None]:
        """Read and decode each sample on its own, then copy it into its row of `out`; each
        sample's error, or None."""
        results = [self._read_sample(*s) for s in samples]
        errors = [r if isinstance(r, BaseException) else None for r in results]
        shapes = [
            None
            if isinstance(r, BaseException)
            else {n: (tuple(t.shape), t.dtype) for n, t in r.items()}
            for r in results
        ]
        for b, problem in enumerate(out.allocate(shapes)):
            r = results[b]
            if problem is not None:
                errors[b] = ValueError(problem)
            elif not isinstance(r, BaseException):
                for name, t in r.items():
                    out.row(b, name).copy_(t)
        return errors

    def _read_sample(
        self, entry: Entry, row: int, slot: int
    ) -> dict[str, torch.Tensor] | BaseException:
        try:
            out = self._store_of(entry).read_sample(entry, row, slot, self.fields, pad=False)
            if self.with_next:
                out.update(self._read_next(entry, row, slot))
            return out
        except Exception as e:
            return e

    def _failed(self, entry: Entry, row: int, e: BaseException) -> None:
        """A sample that could not be read: refuse it, or with skip_corrupt record it. An error
        about the process, not the record (out of file descriptors or memory), is raised as it
        is: skipping would drop good records."""
        if is_transient(e):
            raise e
        detail = e.detail if isinstance(e, CorruptRecordError) else str(e)
        detail = detail.removeprefix(f"shard {entry.name} record {entry.keys[row]}: ")
        msg = f"corrupt record {entry.keys[row]} in shard {entry.name}: {detail}"
        if not self.skip_corrupt:
            raise CacheError(msg, fix="run `wandistill cache verify`, or pass --skip-corrupt")
        self.corrupt.append(msg)

    def _read_next(self, entry: Entry, row: int, slot: int) -> dict[str, torch.Tensor]:
        """The next point of this sample's trajectory: the next recorded step's x_t and t, or
        after the last recorded step the final latent (in x_t's dtype) at t = 0."""
        store = self._store_of(entry)
        ahead = self.next_slots[slot] if self.next_slots is not None else slot + 1
        if ahead < self.num_slots:
            nxt = store.read_sample(entry, row, ahead, ["xt", "timesteps"], pad=False)
            xt, t, final = nxt["xt"], nxt["timesteps"], False
        else:
            both = store.read_sample(entry, row, slot, ["xt", "final_latent"], pad=False)
            xt = both["final_latent"].to(both["xt"].dtype)
            t, final = torch.zeros((), dtype=torch.float32), True
        return {"xt_next": xt, "timesteps_next": t, "next_is_final": torch.tensor(final)}

    def _collate(
        self, tensors: dict[str, torch.Tensor], order: list[int], samples: list[Sample]
    ) -> dict[str, Any]:
        """The batch handed over: `tensors` hold the samples in `order` (empty: every sample of
        the batch was corrupt and skipped)."""
        if not order:
            if self._last_good is None:
                raise CacheError(
                    f"every sample of the first batch was corrupt ({len(samples)} samples; the "
                    f"last: {self.corrupt[-1] if self.corrupt else '?'})",
                    fix="run `wandistill cache verify` and restore the damaged shards",
                )
            # A wholly corrupt batch: repeat the last good one (ranks stay in step; every
            # skipped sample is in self.corrupt).
            return {
                k: v.clone() if isinstance(v, torch.Tensor) else list(v)
                for k, v in self._last_good.items()
            }
        batch: dict[str, Any] = dict(tensors)
        batch["key"] = [samples[b][0].keys[samples[b][1]] for b in order]
        batch["step_slot"] = torch.tensor([samples[b][2] for b in order])
        self._last_good = dict(batch)
        return batch
