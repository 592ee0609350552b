"""A manifest's or journal's shard entries, each validated into its model when first used.

Why its own module: `files.py` declares what every cache file holds (the schemas); this is how a
list of a million shard entries stays cheap to read (`json.loads`, then one `model_validate`
per entry actually used), which no schema needs to know. The entry models themselves are in
`files.py` (`Entry`, `WdsEntry`, `ZarrEntry`); `Entries[WdsEntry]` is how a schema declares such
a list.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, get_args, overload

from pydantic_core import PydanticCustomError, core_schema

from wandistill.cache.contract import MAX_ROWS
from wandistill.checks.validate import check
from wandistill.errors import CacheError

if TYPE_CHECKING:
    from wandistill.cache.files import Entry

E = TypeVar("E", bound="Entry")


class Entries(Sequence[E]):
    """A manifest's (or journal's) shard entries: the JSON list as read, each entry validated
    into its model the first time it is used, then kept. Reading a manifest costs about a
    `json.loads` however many shards it lists; `load_committed`'s checks (names, digests) read
    the JSON. A bad entry is one CacheError naming the file, the entry's index and shard name
    and the field (the message a whole-file check gives), when it is used or when `cache verify`
    checks every entry."""

    def __init__(
        self,
        model: type[E],
        raw: list[Any],
        *,
        where: str = "manifest.json",
        fix: str = "restore manifest.json, or re-run `wandistill precompute` into a fresh "
        "directory",
    ) -> None:
        self.model = model
        self._raw = raw
        self._models: list[E | None] = [None] * len(raw)
        self._src: list[tuple[Entries[E], int]] | None = None
        """Entries picked from other files (`join`): each validated by its own file's Entries."""
        self.where = where
        """The file the entries came from, for messages."""
        self.fix = fix

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        (model,) = get_args(source)

        def lazy(value: Any) -> Entries[Any]:
            if isinstance(value, Entries):
                return value
            if not isinstance(value, list):
                raise PydanticCustomError("list_type", "Input should be a valid list")
            if len(value) > MAX_ROWS:
                raise ValueError(f"lists {len(value)} shards")
            return cls(model, value)

        return core_schema.no_info_plain_validator_function(lazy)

    def __len__(self) -> int:
        return len(self._raw)

    @overload
    def __getitem__(self, i: int) -> E: ...
    @overload
    def __getitem__(self, i: slice) -> list[E]: ...
    def __getitem__(self, i: int | slice) -> E | list[E]:
        if isinstance(i, slice):  # a Sequence slices: validated models, never raw rows
            return [self[j] for j in range(*i.indices(len(self)))]
        got = self._models[i]
        if got is None:
            got = self._models[i] = self._validate(i if i >= 0 else i + len(self))
        return got

    def __iter__(self) -> Iterator[E]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        """Same entries as read (the JSON their digests are taken over)."""
        if isinstance(other, Entries):
            return self._raw == other._raw
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def _validate(self, i: int) -> E:
        if self._src is not None:
            src, j = self._src[i]
            return src[j]
        raw, where = self._raw, f"{self.where} is corrupt"
        return check(
            self.model,
            raw[i],
            where,
            fix=self.fix,
            error=CacheError,
            at=("shards", i),
            root={"shards": raw},
        )

    def json(self, i: int) -> dict[str, Any]:
        """Entry `i` as read (what its digest is taken over, and what is written back); an
        entry that is not a JSON object is reported as `self[i]` reports it."""
        raw = self._raw[i]
        if type(raw) is not dict:
            self[i]
        return raw

    def json_list(self) -> list[Any]:
        return self._raw

    def name(self, i: int) -> str:
        """Entry `i`'s name, read from its JSON (the entry is validated only where the name is
        not a string: then it is reported)."""
        raw = self._raw[i]
        if type(raw) is dict and type(name := raw.get("name")) is str:
            return name
        return self[i].name

    def names(self) -> list[str]:
        """Every entry's name (see `name`)."""
        return [self.name(i) for i in range(len(self))]

    @classmethod
    def join(cls, model: type[E], parts: list[tuple[Entries[E], int]]) -> Entries[E]:
        """Entries picked from several files (manifest, journals), each validated when used by
        its own file's Entries (so its messages name that file, and it is validated once)."""
        made = cls(model, [src._raw[i] for src, i in parts])
        made._src = parts
        return made
