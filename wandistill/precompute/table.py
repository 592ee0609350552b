"""The prompt list and record keys precompute keeps for a whole run, in compact columns.

`read_prompts` returns one `Prompt` object per line (with its own seed and line-number ints):
about 250 bytes a prompt besides the text. Precompute holds the list for the whole run and every
rank holds all of it (batches are assigned by position), so at 100k prompts that overhead alone
is ~10% of the process. `PromptTable` keeps the texts in a list and the numbers in typed arrays
(16 bytes a prompt), is filled line by line by `read_prompts(..., into=PromptTable())` (so the
objects never exist all at once: freed objects would not give their memory back to the OS), and
hands out a `Prompt` on access, so callers index it like the list.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar, overload

from wandistill.precompute.prompts import Prompt

T = TypeVar("T")


class _Columns(Sequence[T]):
    """A read-only sequence whose items are made on access by `_item(i)`, i in range."""

    def _item(self, i: int) -> T:
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> T: ...

    @overload
    def __getitem__(self, i: slice) -> list[T]: ...

    def __getitem__(self, i: int | slice) -> T | list[T]:
        if isinstance(i, slice):
            return [self._item(j) for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(i)
        return self._item(i % n)

    def __iter__(self) -> Iterator[T]:
        return (self._item(i) for i in range(len(self)))


class PromptTable(_Columns[Prompt]):
    """A read-only sequence of prompts: texts, seeds, line numbers, sparse own negatives."""

    def __init__(self, prompts: Iterable[Prompt] = ()) -> None:
        self._texts: list[str] = []
        self._seeds = array("Q")
        self._lines = array("q")
        self._negatives: dict[int, str] = {}
        for p in prompts:
            self.append(p)

    def append(self, p: Prompt) -> None:
        """Add one prompt (`read_prompts(..., into=PromptTable())` fills it line by line)."""
        if p.negative_prompt is not None:
            self._negatives[len(self._texts)] = p.negative_prompt
        self._texts.append(p.text)
        self._seeds.append(p.seed)
        self._lines.append(p.line)

    def __len__(self) -> int:
        return len(self._texts)

    def _item(self, i: int) -> Prompt:
        return Prompt(self._texts[i], self._seeds[i], self._lines[i], self._negatives.get(i))


class KeyTable(_Columns[str]):
    """Record keys (32 hex digits each) as 16 bytes each; the string is made on access.

    A list of 100k key strings is ~9 MB; this is 1.6 MB."""

    def __init__(self, keys: Iterable[str]) -> None:
        raw = bytearray()
        for k in keys:
            b = bytes.fromhex(k)
            if len(b) != 16:
                raise ValueError(f"record key {k!r} is not 32 hex digits")
            raw += b
        self._raw = bytes(raw)

    def __len__(self) -> int:
        return len(self._raw) // 16

    def _item(self, i: int) -> str:
        return self._raw[16 * i : 16 * i + 16].hex()
