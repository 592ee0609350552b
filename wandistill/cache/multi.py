"""Several caches trained on as one dataset (`train --cache A --cache B`, `train.cache_weights`).

What must agree. A student learns one teacher at one set of sampler settings: every cache given
to one train must have the teacher, the sampler settings, the dims, the shared tensors (negative
prompt embedding, schedule) and the field names of the first. The checks are `cache merge`'s
(`merge._differences`, the sealed manifest blocks), less what is each cache's own business: how it
is stored (backend, numerics, stored dtypes: each cache decodes its own records to the computed
dtype) and `settings.holdout_fraction` (each cache keeps its own held-out split). Every
difference is named in one error.

Weights, as mosaicml streaming's stream `proportion`: a cache's weight over the sum is its share
of the samples of each epoch, and an epoch is as long as all the caches' samples together. A
cache whose share exceeds its size is repeated (each pass in a fresh order), a smaller share is a
fresh subset each epoch; the draw depends only on (seed, epoch, cache index). Without weights an
epoch is every sample of every cache once, exactly as if the caches were one.

Keys. Two caches holding the same record key would train on that record twice and make `key`
ambiguous in batches and metrics: refused, the keys named (`cache merge` keeps one copy).
"""

from __future__ import annotations

import bisect
import copy
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from wandistill.cache.merge import _differences
from wandistill.cache.reader import CacheReader
from wandistill.errors import CacheError, CacheMismatchError, UsageError

OWN_BLOCKS = ("backend", "numerics", "fields", "format", "schema_version")
"""Sealed blocks that may differ between caches trained together (how a cache is stored)."""
OWN_SETTINGS = ("settings.holdout_fraction",)
"""Settings each cache keeps for itself."""


def differences(a: CacheReader, b: CacheReader) -> list[str]:
    """What two caches differ in that a student trained on both depends on (dotted keys)."""
    diffs = [
        d
        for d in _differences(a.manifest, b.manifest)
        if d.split(".", 1)[0] not in OWN_BLOCKS and d not in OWN_SETTINGS
    ]
    names_a = sorted(f.name for f in a.manifest.fields)
    names_b = sorted(f.name for f in b.manifest.fields)
    if names_a != names_b:
        diffs.append(f"fields ({names_a} vs {names_b})")
    return diffs


def check_compatible(stores: Sequence[CacheReader]) -> None:
    """Refuse caches a student cannot train on together, naming every difference."""
    paths = [str(s.path) for s in stores]
    twice = sorted({p for p in paths if paths.count(p) > 1})
    if twice:
        raise UsageError(
            f"--cache {twice[0]!r} is given more than once",
            fix="name each cache once; to train on it more often give it a larger "
            "train.cache_weights entry",
        )
    first = stores[0]
    problems = []
    for other in stores[1:]:
        diffs = differences(first, other)
        if diffs:
            problems.append(
                f"{str(other.path)!r} differs from {str(first.path)!r} in " + ", ".join(diffs)
            )
    if problems:
        raise CacheMismatchError(
            "caches given to one train must share teacher, sampler settings, dims and fields: "
            + "; ".join(problems),
            fix="train on caches precomputed with the same recipe and teacher (`wandistill "
            "cache info --json` shows each header), or train on them separately",
        )


def check_unique_keys(stores: Sequence[CacheReader]) -> None:
    """Refuse record keys held by more than one cache, naming them."""
    owner: dict[str, int] = {}
    dups: list[str] = []
    for n, store in enumerate(stores):
        for entry in store.entries:
            for key in entry.keys:
                was = owner.setdefault(key, n)
                if was != n:
                    dups.append(f"{key} ({str(stores[was].path)!r} and {str(store.path)!r})")
    if dups:
        more = f" and {len(dups) - 3} more" if len(dups) > 3 else ""
        raise CacheError(
            f"{len(dups)} record key(s) are in more than one cache: {', '.join(dups[:3])}{more}",
            fix="train on caches of different prompts or seeds, or `wandistill cache merge` "
            "them into one (merge keeps one copy of each key)",
        )


def check_caches(stores: Sequence[CacheReader]) -> None:
    """The check of several caches trained on together, before anything is built or written
    (`train`'s validate, the training reader): compatible with the first, no key in two."""
    check_compatible(stores)
    check_unique_keys(stores)


def shares(sizes: Sequence[int], weights: Sequence[float]) -> list[int]:
    """Samples each cache contributes to one epoch of sum(sizes) samples: proportional to the
    weights, rounded by largest remainder (ties to the earlier cache) so they sum exactly."""
    total = sum(sizes)
    if not weights:
        return list(sizes)
    exact = [total * w / sum(weights) for w in weights]
    out = [math.floor(x) for x in exact]
    by_rest = sorted(range(len(exact)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in by_rest[: total - sum(out)]:
        out[i] += 1
    return out


class MixSpace:
    """One epoch's samples of several caches, back to back (cache 0's share first): the same
    interface as `SampleSpace` (len, index, `shuffled`). `picks[i]` maps a position in cache i's
    share to a sample of its space (None: the identity, every sample once)."""

    def __init__(self, spaces: list[Any], picks: list[torch.Tensor | None]) -> None:
        self.spaces = spaces
        self.picks = picks
        sizes = [len(s) if p is None else len(p) for s, p in zip(spaces, picks, strict=True)]
        self.starts = [0, *itertools.accumulate(sizes)][:-1]
        self._len = sum(sizes)
        self.order: torch.Tensor | None = None

    def __len__(self) -> int:
        return self._len

    def shuffled(self, order: torch.Tensor) -> MixSpace:
        view = copy.copy(self)
        view.order = order
        return view

    def __getitem__(self, j: int) -> Any:
        if self.order is not None:
            j = int(self.order[j])
        i = bisect.bisect_right(self.starts, j) - 1
        local = j - self.starts[i]
        pick = self.picks[i]
        return self.spaces[i][local if pick is None else int(pick[local])]


def mix(
    spaces: list[Any], weights: Sequence[float], perm: Callable[..., torch.Tensor], epoch: int
) -> MixSpace:
    """Epoch `epoch`'s weighted draw from each cache's space (see the module docstring);
    `perm(n, *tag)` is the reader's seeded permutation."""
    counts = shares([len(s) for s in spaces], weights)
    picks: list[torch.Tensor | None] = []
    for i, (space, count) in enumerate(zip(spaces, counts, strict=True)):
        if not weights or count == len(space):
            picks.append(None)
            continue
        if count and not len(space):
            raise CacheError(
                f"cache {i} has no training samples but train.cache_weights[{i}] gives it "
                f"{count} per epoch",
                fix="drop that cache or precompute into it first",
            )
        passes = [perm(len(space), "mix", epoch, i, k) for k in range(-(-count // len(space)))]
        picks.append(torch.cat(passes)[:count] if passes else torch.empty(0, dtype=torch.long))
    return MixSpace(spaces, picks)
