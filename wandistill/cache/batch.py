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

import threading
import weakref
from typing import Any

import numpy as np
import torch

RAGGED = ("prompt_embeds", "negative_prompt_embeds")
"""Fields stored trimmed; batches zero-pad them (bit-exact with the pipeline's own padding)."""

Shape = tuple[tuple[int, ...], torch.dtype]
"""A field of one sample as stored: (shape, dtype)."""


def empty(
    shape: tuple[int, ...], dtype: torch.dtype, pool: BufferPool | None = None
) -> torch.Tensor:
    """`torch.empty` in memory numpy allocates (or `pool` recycles): malloc hands a freed
    batch's pages to the next one, where torch's allocator maps fresh pages for every large
    tensor and each first write takes a page fault (measured: a 7 MB `preadv` into
    `torch.empty` 1.5 ms, into `np.empty` 0.6 ms)."""
    n = dtype.itemsize
    for d in shape:
        n *= d
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    raw = pool.take(n) if pool is not None else np.empty(n, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


class BufferPool:
    """Recycles the memory of big batch tensors once every tensor over it is gone.

    Why: malloc recycles a freed block only below glibc's mmap threshold, which adapts up to
    32 MiB. A bigger batch tensor (8 samples of an 81-frame 480p latent are 33.5 MB) is mapped
    fresh for every batch, and the kernel faults in and zeroes each page on its first write:
    at 81 frames that is ~1 GB an epoch at ~4 GB/s on a 2-core VM, a third of the reader's
    time (docs/benchmarks.md, "Batch memory"). A buffer returns to the pool when its last view
    dies (`weakref.finalize`), so a batch the consumer still holds is never handed out again.
    Sizes are rounded up to 1/8 of their power of two so that batches padded to different
    prompt lengths share buffers; at most as many bytes are kept free as were ever in use at
    once, oldest dropped first. Below `MIN_BYTES` plain `np.empty` (malloc) is already fast."""

    MIN_BYTES = 1 << 20

    def __init__(self) -> None:
        self._lock = threading.RLock()  # a finalizer may run inside `take` (GC) on this thread
        self._free: list[np.ndarray] = []
        """Whole buffers ready for reuse, oldest first."""
        self.free_bytes = 0
        self.in_use = 0
        self.peak = 0

    @staticmethod
    def size_class(n: int) -> int:
        step = max(1 << 16, 1 << max(0, n.bit_length() - 4))
        return -(-n // step) * step

    def take(self, n: int) -> np.ndarray:
        """A writable uint8 array of n bytes (uninitialised)."""
        if n < self.MIN_BYTES:
            return np.empty(n, dtype=np.uint8)
        size = self.size_class(n)
        base = None
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):
                if self._free[i].nbytes == size:
                    base = self._free.pop(i)
                    self.free_bytes -= size
                    break
            self.in_use += size
            self.peak = max(self.peak, self.in_use)
        if base is None:
            base = np.empty(size, dtype=np.uint8)
        view = base[:n]
        weakref.finalize(view, self._give, base).atexit = False
        return view

    def _give(self, base: np.ndarray) -> None:
        with self._lock:
            self.in_use -= base.nbytes
            self._free.append(base)
            self.free_bytes += base.nbytes
            while self.free_bytes > self.peak:
                self.free_bytes -= self._free.pop(0).nbytes


def _differs(name: str, got: Shape | None, want: Shape) -> str | None:
    """Why a sample's field cannot share a batch tensor with the first sample's, or None."""
    if got is None:
        return f"has no {name!r}, the batch's first sample has one"
    same = got[0][1:] == want[0][1:] if name in RAGGED else got[0] == want[0]
    if same and got[1] == want[1]:
        return None
    return (
        f"{name!r} is {tuple(got[0])} {got[1]}, the batch's first sample has "
        f"{tuple(want[0])} {want[1]}"
    )


class BatchBuffers:
    """The batch tensors of B samples; `allocate` once the samples' shapes are known."""

    def __init__(self, size: int, pad_len: int | None, pool: BufferPool | None = None) -> None:
        self.size = size
        self.pad_len = pad_len
        self.pool = pool
        """Length of ragged fields; None pads to the batch's longest."""
        self.tensors: dict[str, torch.Tensor] = {}
        self.lengths: dict[str, list[int]] = {}
        """Ragged field -> each sample's true length (0 for a failed sample)."""
        self._raw: dict[str, Any] = {}

    def allocate(self, shapes: list[dict[str, Shape] | None]) -> list[str | None]:
        """Make the batch tensors from each sample's field shapes (None: a failed sample).

        Every sample must match the first good one (ragged fields: in width and dtype); a sample
        that does not, or whose embedding is longer than the fixed pad length, gets a problem
        line and no row. Returns one problem (or None) per sample."""
        problems: list[str | None] = [None] * self.size
        first = next((s for s in shapes if s is not None), None)
        if first is None:
            return problems
        for b, s in enumerate(shapes):
            if s is None or s is first:
                continue
            problems[b] = next(
                (p for name, want in first.items() if (p := _differs(name, s.get(name), want))),
                None,
            )
        for name, (shape, dtype) in first.items():
            if name not in RAGGED:
                self.tensors[name] = empty((self.size, *shape), dtype, self.pool)
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
            out = empty((self.size, length, *shape[1:]), dtype, self.pool)
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

    @staticmethod
    def raw(t: torch.Tensor) -> Any:
        """A writable uint8 numpy view over a contiguous tensor's bytes, for `preadv`/crc32c."""
        return t.reshape(-1).view(torch.uint8).numpy()
