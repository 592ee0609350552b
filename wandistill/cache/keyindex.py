"""A compact set / map of record keys: what must not grow with the prompt file.

Record keys are 32 hex digits. A Python set or dict of 100k key strings is ~14 MB; `NameIndex`
holds each as its 16 digest bytes in a sorted numpy array (~25 bytes a key). Used by the
embedding store (name -> shard) and the cache writer (which keys are committed).
"""

from __future__ import annotations

import numpy as np


class NameIndex:
    """Tensor name -> shard position, for every committed name, in ~25 bytes a name.

    Record keys are 32 hex digits: such a name (and "<key>.negative") is held as its 16 digest
    bytes in a sorted numpy array, not as a Python string in a dict (~140 bytes a name: ~14 MB
    per 100k prompts, which is what the encode phase must not grow by). Other names (the
    recipe's negative prompt) sit in a small dict. Additions wait in a small dict and are merged
    into the sorted array (sorted among themselves, then inserted: one pass over the array) once
    there are `_batch()` of them, a number that grows with the index, so n additions cost
    O(n log n) and not O(n^2) (1.6M keys, a fixed 4,096 per full re-sort: 6.9 s of merging).
    """

    def __init__(self) -> None:
        self._keys = np.empty(0, dtype="S17")
        self._pos = np.empty(0, dtype=np.int32)
        self._pending: dict[bytes, int] = {}
        self._other: dict[str, int] = {}

    @staticmethod
    def _packed(name: str) -> bytes | None:
        key, dot, rest = name.partition(".")
        if len(key) != 32 or (dot and rest != "negative"):
            return None
        try:
            return (b"\x01" if dot else b"\x00") + bytes.fromhex(key)
        except ValueError:
            return None

    def add(self, name: str, pos: int) -> None:
        packed = self._packed(name)
        if packed is None:
            self._other.setdefault(name, pos)
        elif self._find(packed) is None:  # first one wins, as dict.setdefault (same bytes)
            self._pending.setdefault(packed, pos)
            if len(self._pending) >= self._batch():
                self._merge()

    def get(self, name: str) -> int | None:
        packed = self._packed(name)
        if packed is None:
            return self._other.get(name)
        hit = self._find(packed)  # merged (older) entries first: the first one added wins
        return hit if hit is not None else self._pending.get(packed)

    def __contains__(self, name: str) -> bool:
        return self.get(name) is not None

    def __len__(self) -> int:
        return len(self._keys) + len(self._pending) + len(self._other)

    def names(self) -> list[str]:
        """Every indexed name (for tests and tools; builds the strings)."""
        self._merge()
        raw = self._keys.tobytes()
        out = [
            raw[i + 1 : i + 17].hex() + (".negative" if raw[i] else "")
            for i in range(0, len(raw), 17)
        ]
        return [*out, *self._other]

    def _find(self, packed: bytes) -> int | None:
        q = np.array([packed], dtype="S17")
        j = int(np.searchsorted(self._keys, q[0]))
        if j < len(self._keys) and self._keys[j : j + 1] == q:
            return int(self._pos[j])
        return None

    def _batch(self) -> int:
        """Pending additions per merge: an eighth of the index, at least 4,096 and at most
        65,536 (the pending dict is ~150 bytes a name: it stays under ~10 MB)."""
        return min(max(len(self._keys) // 8, 4096), 65536)

    def _merge(self) -> None:
        if not self._pending:
            return
        new = np.array(list(self._pending), dtype="S17")
        pos = np.fromiter(self._pending.values(), dtype=np.int32, count=len(new))
        order = np.argsort(new)  # pending names are distinct and absent from the array
        new, pos = new[order], pos[order]
        at = np.searchsorted(self._keys, new)
        self._keys, self._pos = np.insert(self._keys, at, new), np.insert(self._pos, at, pos)
        self._pending = {}
