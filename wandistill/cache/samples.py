"""The training reader's sample space: every (record, recorded step) of some shards as arrays.

Why arrays: a list of `Sample` tuples, plus its shuffled copy, took ~100 bytes a sample (about
1 GB per rank for 1M records x 8 steps; tests/bench/scale.py). `SampleSpace` is one epoch's (or
one follow generation's) samples in key order, presented shuffled through a permutation;
`FollowPool` holds follow mode's generations back to back and drops those already trained on.
The order they are drawn in is cache/training.py's (see its docstring).
"""

from __future__ import annotations

import copy
from collections import deque

import numpy as np
import torch

from wandistill.cache.files import Entry

Sample = tuple[Entry, int, int]
"""(shard entry, row in shard, recorded-step slot)."""


class SampleSpace:
    """Every (record, step) sample of some shards, in key order, as arrays: sample j is record
    j // len(slots) at slot j % len(slots), and `order` (a permutation) presents them shuffled.
    It holds 8 bytes a record plus 8 a sample of `order` (see the module docstring)."""

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
