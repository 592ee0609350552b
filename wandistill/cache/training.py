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
- `slots` narrows the space to the recorded steps the objectives use, and `next_slots` adds a
  next point of each sample's trajectory (`xt_next`, `timesteps_next`: the x_t and t of slot
  `next_slots[slot]`, or past the last slot the final latent with t = 0), perflow's window end;
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

Where the parts live: the sample space arrays in cache/samples.py, follow mode's planner in
cache/follow.py and the batch reads in cache/batchread.py (mixins of `TrainingReader`); this
module plans epochs, cuts global batches, keeps the position and hands batches over.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from wandistill.cache.batchread import BatchReading
from wandistill.cache.choices import check_weights
from wandistill.cache.contract import is_holdout
from wandistill.cache.files import Entry
from wandistill.cache.follow import FollowMode
from wandistill.cache.multi import check_caches, mix
from wandistill.cache.reader import CacheReader
from wandistill.cache.samples import FollowPool, Sample, SampleSpace
from wandistill.errors import CacheError, UsageError

DEFAULT_FIELDS = ("prompt_embeds", "xt", "timesteps", "teacher_out")
SyncFn = Callable[[list[str], bool], tuple[list[str], bool]]
"""(shard names this rank sees, manifest complete?) -> what every rank agrees on."""


def pad_to(embeds_BLD: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad a batch padded to its own longest prompt up to `length` (e.g. on the GPU)."""
    extra = length - embeds_BLD.shape[1]
    if extra < 0:
        raise ValueError(f"embeddings of length {embeds_BLD.shape[1]} exceed {length}")
    return torch.nn.functional.pad(embeds_BLD, (0, 0, 0, extra)) if extra else embeds_BLD


def _seed_for(*parts: Any) -> int:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


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
        check_caches(stores)
    return stores, checked


class TrainingReader(FollowMode, BatchReading):
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
        self.next_slots = list(next_slots) if next_slots is not None else None
        """Slot -> the slot read as each sample's next point (num_slots or more: the final
        latent); perflow's window ends. None: no next point."""
        self.with_next = self.next_slots is not None
        self.follow = follow
        self.poll_interval = poll_interval
        self.follow_timeout = follow_timeout
        self.sync = sync or (lambda names, complete: (names, complete))
        self.agree = agree or bool
        """Follow mode: True on every rank when it is True on every rank (`all_agree` in
        train/build.py)."""
        self.num_threads = num_threads
        self.prefetch_batches = max(1, prefetch_batches, num_threads)
        """Batches read ahead, one task each: at least one per thread."""
        self.holdouts = [
            0.0 if include_holdout else (s.manifest.settings.holdout_fraction or 0.0)
            for s in self.stores
        ]
        """Each cache's own held-out fraction."""
        self.skip_corrupt = skip_corrupt
        if pad not in ("max_sequence_length", "batch"):
            raise UsageError(f"pad={pad!r} must be 'max_sequence_length' or 'batch'")
        self.pad = pad
        self.corrupt: list[str] = []
        """One line per skipped sample ("corrupt record ...") or shard ("unusable shard ...")."""
        self._unusable: dict[str, str] = {}
        self._last_good: dict[str, Any] | None = None
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
            tensors, order = future.result()
            batch = self._collate(tensors, order, samples)
            # The position advances only when a batch is handed over, so a checkpoint taken
            # now resumes right after it, whatever was prefetched.
            self.epoch, self.batches_done = position
            yield batch

    def _permutation(self, n: int, *tag: Any) -> torch.Tensor:
        gen = torch.Generator().manual_seed(_seed_for(self.seed, *tag))
        return torch.randperm(n, generator=gen)

    def _step_items(
        self, pool: Any, g: int, epoch: int
    ) -> Iterator[tuple[tuple[int, int], list[Sample]]]:
        """This rank's micro-batches of step g; the position counts the step only once its last
        micro-batch is handed over, so a resume replays a partly consumed step whole."""
        for m in range(self.grad_accum):  # micro-batch m of the step is rank r's at m*W + r
            start = g * self.global_batch + (m * self.world_size + self.rank) * self.batch_size
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
