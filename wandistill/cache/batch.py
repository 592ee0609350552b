"""One training batch, filled in place: each sample's tensors are read straight into its row.

Why: reading every sample into tensors of its own and then stacking them (and zero-padding the
embeddings) copies every byte a second time; for a warm or fast disk that copy cost as much as
the read. A backend first works out the shape and dtype of each sample's fields (headers it has
cached, zarr metadata), `BatchBuffers.allocate` makes the batch tensors, and the backend then
reads each tensor (or step row) into `row(b, name)` with one positioned read or one zarr call.
Ragged fields (the prompt embeddings) are `[B, L, D]`, zero past each sample's length: L is the
batch's longest prompt (`pad="batch"`) or a fixed length; only the tails are zeroed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

RAGGED = ("prompt_embeds", "negative_prompt_embeds")
"""Fields stored trimmed; batches zero-pad them (bit-exact with the pipeline's own padding)."""

Shape = tuple[tuple[int, ...], torch.dtype]
"""A field of one sample as stored: (shape, dtype)."""


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty` in memory numpy allocates: malloc hands a freed batch's pages to the next
    one, where torch's allocator maps fresh pages for every large tensor and each first write
    takes a page fault (measured: a 7 MB `preadv` into `torch.empty` 1.5 ms, into `np.empty`
    0.6 ms)."""
    n = dtype.itemsize
    for d in shape:
        n *= d
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(np.empty(n, dtype=np.uint8)).view(dtype).view(shape)


def _differs(sample: dict[str, Shape], first: dict[str, Shape]) -> str | None:
    """Why a sample's fields cannot share the batch tensors with the first sample's, or None."""
    for name, want in first.items():
        got = sample.get(name)
        if got is None:
            return f"has no {name!r}, the batch's first sample has one"
        same = got[0][1:] == want[0][1:] if name in RAGGED else got[0] == want[0]
        if not same or got[1] != want[1]:
            return (
                f"{name!r} is {tuple(got[0])} {got[1]}, the batch's first sample has "
                f"{tuple(want[0])} {want[1]}"
            )
    return None


class BatchBuffers:
    """The batch tensors of B samples; `allocate` once the samples' shapes are known."""

    def __init__(self, size: int, pad_len: int | None) -> None:
        self.size = size
        self.pad_len = pad_len
        """Length of ragged fields; None pads to the batch's longest."""
        self.tensors: dict[str, torch.Tensor] = {}
        self.lengths: dict[str, list[int]] = {}
        """Ragged field -> each sample's true length (0 for a failed sample)."""
        self._raw: dict[str, Any] = {}
        self.first: dict[str, Shape] = {}
        """The first good sample's field shapes (what every other sample must match)."""

    def allocate(self, shapes: list[dict[str, Shape] | None]) -> list[str | None]:
        """Make the batch tensors from each sample's field shapes (None: a failed sample).

        Every sample must match the first good one (ragged fields: in width and dtype); a sample
        that does not, or whose embedding is longer than the fixed pad length, gets a problem
        line and no row. Returns one problem (or None) per sample."""
        problems: list[str | None] = [None] * self.size
        first = next((s for s in shapes if s is not None), None)
        if first is None:
            return problems
        self.first = first
        for b, s in enumerate(shapes):
            if s is None or s is first:
                continue
            problems[b] = _differs(s, first)
        for name, (shape, dtype) in first.items():
            if name not in RAGGED:
                self.tensors[name] = empty((self.size, *shape), dtype)
                continue
            lengths = [
                s[name][0][0] if s is not None and p is None else 0
                for s, p in zip(shapes, problems, strict=True)
            ]
            length = max(lengths) if self.pad_len is None else self.pad_len
            for b, n in enumerate(lengths):
                if n > length and problems[b] is None:
                    problems[b] = f"{name!r} has {n} tokens, more than max_sequence_length {length}"
                    lengths[b] = 0
            out = empty((self.size, length, *shape[1:]), dtype)
            for b, n in enumerate(lengths):
                out[b, n:] = 0
            self.tensors[name], self.lengths[name] = out, lengths
        return problems

    def row(self, b: int, name: str) -> torch.Tensor:
        """Where sample b's `name` goes: its row, or its first `length` tokens (contiguous)."""
        t = self.tensors[name][b]
        return t[: self.lengths[name][b]] if name in self.lengths else t

    def raw_row(self, b: int, name: str) -> Any:
        """`row(b, name)` as a writable uint8 numpy view, for `preadv` and crc32c (slicing
        numpy costs ~0.2 us, a torch view ~10 us: it adds up at 24 views a batch)."""
        raw = self._raw.get(name)
        if raw is None:
            t = self.tensors[name]
            raw = self._raw[name] = t.view(t.shape[0], -1).view(torch.uint8).numpy()
        if name not in self.lengths:
            return raw[b]
        return raw[
            b, : self.lengths[name][b] * (raw.shape[1] // max(1, self.tensors[name].shape[1]))
        ]


class RowsOf:
    """Rows `rows` of a batch whose samples come from several caches (`TrainingReader` over
    several caches): what a backend's `read_batch` sees of the batch, so each cache reads its
    samples straight into their rows of the one batch. The first `allocate` that has a good
    sample makes the batch tensors (ragged fields at the batch's fixed `pad_len`); later ones
    check their samples against that first sample, as `BatchBuffers.allocate` does within one
    cache."""

    def __init__(self, batch: BatchBuffers, rows: list[int]) -> None:
        if batch.pad_len is None:
            raise ValueError("a batch shared by several caches needs a fixed pad length")
        self.batch = batch
        self.rows = rows
        self.size = len(rows)

    def allocate(self, shapes: list[dict[str, Shape] | None]) -> list[str | None]:
        batch = self.batch
        if not batch.tensors:
            full: list[dict[str, Shape] | None] = [None] * batch.size
            for b, s in zip(self.rows, shapes, strict=True):
                full[b] = s
            problems = batch.allocate(full)
            return [problems[b] for b in self.rows]
        want = batch.first
        problems: list[str | None] = [None] * self.size
        for i, (b, s) in enumerate(zip(self.rows, shapes, strict=True)):
            if s is None:
                continue
            problems[i] = _differs(s, want)
            for name in batch.lengths:
                n = s[name][0][0] if problems[i] is None and name in s else 0
                if n > batch.tensors[name].shape[1]:
                    problems[i] = f"{name!r} has {n} tokens, more than max_sequence_length"
                    n = 0
                batch.lengths[name][b] = n
        return problems

    def row(self, b: int, name: str) -> torch.Tensor:
        return self.batch.row(self.rows[b], name)

    def raw_row(self, b: int, name: str) -> Any:
        return self.batch.raw_row(self.rows[b], name)
