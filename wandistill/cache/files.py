"""Typed schemas of every file a cache holds, declared once (pydantic, via `checks.validate`).

`manifest.json`, `journal/rank-<r>[-<s>].json`, the shard entries inside both (webdataset and zarr),
each record's `.json` member and safetensors header, and the zarr metadata (`zarr.json`) the zarr
backend reads. Readers check the parsed JSON against these before using a value, so a bad file
is one line naming the file, the field and the fix, never a traceback or a read elsewhere.

Bounds are generous sanity limits (no real cache comes near them), there to keep a hostile value
from becoming a huge allocation or an out-of-range seek.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    PrivateAttr,
    StringConstraints,
    model_validator,
)

from wandistill import __version__
from wandistill.cache.contract import (
    DTYPE_BY_NAME,
    DTYPES,
    FORMAT_NAME,
    MAX_ROWS,
    SCHEMA_VERSION,
)
from wandistill.cache.entries import Entries
from wandistill.checks.validate import OpenSchema, Schema, rel_path_problem

# ----------------------------------------------------------------------------- scalar types

Count = Annotated[int, Field(ge=0, le=MAX_ROWS)]
U32 = Annotated[int, Field(ge=0, le=0xFFFFFFFF)]
Seed = Annotated[int, Field(ge=-(1 << 63), le=(1 << 64) - 1)]
Hex64 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")]
"""A shard, tensor or field name: no slash, no leading dot, at most 128 characters."""
RecordKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,128}$")]
"""No dots (webdataset splits member names at the first dot) and no slashes."""
Text = Annotated[str, StringConstraints(max_length=1 << 20)]
Identifier = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,99}$")]
Short = Annotated[str, StringConstraints(max_length=256)]
Dtype = Literal[tuple(DTYPE_BY_NAME)]  # type: ignore[valid-type]
Span = Annotated[list[Count], Field(min_length=2, max_length=2)]
"""[start, stop) or [offset, length] (JSON arrays: strict mode takes tuples from Python only)."""


def _rel(value: str) -> str:
    problem = rel_path_problem(value) if len(value) <= 1024 else "is longer than 1024 characters"
    if problem:
        raise ValueError(f"path {problem}")
    return value


RelPath = Annotated[str, AfterValidator(_rel)]
"""A relative path that stays inside its folder (no absolute path, no `..`)."""


# ----------------------------------------------------------------------------- records


class RecordMeta(Schema):
    """A record's `<key>.json` member (webdataset) / `entry.meta[i]` (zarr)."""

    model_config = ConfigDict(frozen=True)

    key: RecordKey
    prompt: Text
    seed: Seed
    embed_len: Count
    schema_version: Annotated[int, Field(ge=1, le=1000)]
    extra: dict[Short, JsonValue] = Field(default_factory=dict)


class TensorInfo(Schema):
    """One entry of a safetensors header."""

    dtype: Literal[tuple(d.safetensors for d in DTYPES)]  # type: ignore[valid-type]
    shape: Annotated[list[Annotated[int, Field(ge=0, le=1 << 32)]], Field(max_length=8)]
    data_offsets: Span
    """Checked against the shape and the record's extent where they are used (`_span`)."""


class OwnMeta(Schema):
    """The `wandistill` metadata of a record's safetensors header: key + crc32c per tensor."""

    key: RecordKey
    crc32c: dict[Name, U32 | Annotated[list[U32], Field(max_length=1 << 16)]]


# ----------------------------------------------------------------------------- shard entries


class Entry(Schema):
    """What both backends' shard entries hold (CacheWriter adds name, rank, records, keys)."""

    model_config = ConfigDict(frozen=True)

    name: Name
    rank: Annotated[int, Field(ge=0, le=1 << 20)]
    records: Count
    keys: list[RecordKey]
    bytes: Count
    entry_sha256: Hex64 | None = None

    @model_validator(mode="after")
    def _counts(self) -> Entry:
        if self.records != len(self.keys):
            raise ValueError(
                f"says {self.records} records but lists {len(self.keys)} keys (manifest edited?)"
            )
        return self


class WdsEntry(Entry):
    file: RelPath
    frame_sha256: Hex64
    """sha256 of every byte of the shard file outside its records' tensor data (tar
    headers and padding, `.json` members, safetensors headers); tensor data is covered by the
    crc32c in each record's safetensors header, so every byte is hashed once."""
    offsets: list[Annotated[list[Count], Field(min_length=4, max_length=4)]]
    """Per record: [safetensors offset, bytes, json offset, bytes] in the tar."""
    crc32c: list[Annotated[list[U32], Field(min_length=2, max_length=2)]] | None = None
    """Per record: [crc32c of the safetensors header, crc32c of the json member]."""

    @model_validator(mode="after")
    def _rows(self) -> WdsEntry:
        n = len(self.keys)
        for name, rows in (("offsets", self.offsets), ("crc32c", self.crc32c)):
            if rows is not None and len(rows) != n:
                raise ValueError(f"lists {len(rows)} {name} rows for {n} keys (manifest edited?)")
        for i, (a, m, b, k) in enumerate(self.offsets):
            if a + m > self.bytes or b + k > self.bytes:
                raise ValueError(
                    f"offsets[{i}] reach past the shard's {self.bytes} bytes (manifest edited?)"
                )
        return self


class ZarrEntry(Entry):
    file: Literal["data.zarr"]
    rows: Span
    reserved: Span
    token_rows: dict[Literal["prompt_embeds", "negative_prompt_embeds"], Span]
    fields: Annotated[list[Name], Field(max_length=4096)]
    meta: list[RecordMeta]
    sha256: dict[RelPath, Hex64]

    @model_validator(mode="after")
    def _rows(self) -> ZarrEntry:
        (a, b), (ra, rb) = self.rows, self.reserved
        if b - a != self.records or ra != a or rb < b:
            raise ValueError(
                f"rows {list(self.rows)} / reserved {list(self.reserved)} do not hold "
                f"{self.records} records (manifest edited?)"
            )
        if len(self.meta) != self.records:
            raise ValueError(f"lists {len(self.meta)} meta rows for {self.records} keys")
        for i, (m, k) in enumerate(zip(self.meta, self.keys, strict=True)):
            if m.key != k:
                raise ValueError(f"meta[{i}] names key {m.key!r}, keys[{i}] is {k!r}")
        return self


ENTRIES: dict[str, type[Entry]] = {"webdataset": WdsEntry, "zarr": ZarrEntry}

# ----------------------------------------------------------------------------- manifest


class FieldSpec(Schema):
    """One entry of the manifest's `fields` list: how a record tensor is stored and handed out."""

    model_config = ConfigDict(frozen=True)

    name: Name
    dtype: Dtype
    """The dtype the field is stored in."""
    shape: Annotated[str, StringConstraints(pattern=r"^[A-Z*](,[A-Z*]){0,7}$")]
    doc: Text = ""
    decoded: Dtype | None = None
    """The dtype readers hand out when it is not `dtype` (storage options, encoding.py)."""
    scaled: bool = False
    """Stored as fp8 with a float32 `scale.<name>` (per recorded step, or per tensor)."""
    compression: Literal["zstd"] | None = None
    compression_level: Annotated[int, Field(ge=1, le=22)] | None = None


class Block(OpenSchema):
    """A sealed manifest block: frozen (its digest is in `header_sha256`); keys it does not
    declare are kept (and sealed) but no reader uses them."""

    model_config = ConfigDict(frozen=True)


class TeacherBlock(Block):
    """Teacher fingerprint (sealed); other keys are informational."""

    fingerprint: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16,128}$")]
    components: dict[str, JsonValue] = Field(default_factory=dict)
    transformer_config: dict[str, JsonValue] | None = None
    path: Text | None = None


Pos = Annotated[int, Field(ge=1, le=1 << 20)]
Scale = Annotated[float, Field(ge=0.0, le=1e6)]


class SettingsBlock(Block):
    """Sampler settings: everything that changes the teacher's output for a prompt and seed."""

    scheduler: Identifier | None = None
    scheduler_config: dict[Short, JsonValue] | None = None
    num_inference_steps: Annotated[int, Field(ge=1, le=10_000)] | None = None
    max_sequence_length: Pos | None = None
    record_steps: (
        Annotated[list[Annotated[int, Field(ge=0, le=10_000)]], Field(max_length=10_000)] | None
    ) = None
    features: list[Short] = Field(default_factory=list)
    dtype: Literal["fp32", "fp16", "bf16"] | None = None
    holdout_fraction: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None
    height: Pos | None = None
    width: Pos | None = None
    num_frames: Pos | None = None
    guidance_scale: Scale | None = None
    guidance_scale_2: Scale | None = None
    """Wan 2.2: the low-noise expert's guidance (None: one expert)."""
    boundary_ratio: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    """Wan 2.2: where the high-noise expert hands over (None: one expert)."""
    expand_timesteps: bool = False
    cfg_formula: Text | None = None
    """How cond and uncond were combined (informational: the guidance scales decide it)."""
    negative_prompt: Text | None = None


class DimsBlock(Block):
    """Sizes a student must match."""

    text_dim: Pos | None = None
    latent_channels: Pos | None = None
    latent_shape: Annotated[list[Pos], Field(min_length=4, max_length=4)] | None = None
    num_recorded_steps: Annotated[int, Field(ge=0, le=10_000)] | None = None
    teacher_dtype: Dtype | None = None
    recorded_experts: (
        Annotated[list[Literal["transformer", "transformer_2"]], Field(max_length=10_000)] | None
    ) = None
    """Wan 2.2: the expert that produced each recorded slot (absent in one-expert caches)."""


class SharedTensor(Schema):
    model_config = ConfigDict(frozen=True)

    dtype: Dtype
    shape: Annotated[list[Annotated[int, Field(ge=0, le=1 << 32)]], Field(max_length=8)]


class SharedBlock(Schema):
    """`shared.safetensors`: tensors every record shares (the scheduler's sigmas)."""

    model_config = ConfigDict(frozen=True)

    file: Literal["shared.safetensors"]
    sha256: Hex64
    tensors: dict[Name, SharedTensor]


SEALED = ("format", "schema_version", "wandistill_version", "backend", "created", "teacher")
SEALED += ("settings", "numerics", "fields", "dims", "shared")
"""Manifest blocks covered by `header_sha256` (one digest each): everything that defines what
the records mean or how their bits were computed. Not `complete` and `shards`: they change as
the cache grows (each shard entry carries its own `entry_sha256`)."""
BLOCKS = ("teacher", "settings", "fields", "dims", "shared", "numerics")
"""The header blocks a manifest writes back exactly as it read (or was built from) them."""


class Manifest(Schema):
    """`manifest.json`, parsed: the object every reader uses (attributes, never string keys).

    One subclass per backend types its shard entries. The header blocks are frozen (sealed) and
    written back from the JSON they were validated from (`to_json`), so a manifest read and
    written again is byte-identical and its seal still holds; `complete`, `created` and `shards`
    change as the cache grows. `shards` is an `Entries`: the raw list, each entry validated when
    first used (`read_manifest` then costs about a `json.loads`)."""

    format: Literal[FORMAT_NAME] = FORMAT_NAME  # type: ignore[valid-type]
    schema_version: int = SCHEMA_VERSION
    wandistill_version: Short = __version__
    backend: Literal["webdataset", "zarr"]
    created: Short = ""
    complete: bool = False
    teacher: TeacherBlock
    settings: SettingsBlock
    fields: Annotated[list[FieldSpec], Field(min_length=1, max_length=4096)]
    dims: DimsBlock = Field(default_factory=DimsBlock)
    shared: SharedBlock | Annotated[dict[str, Any], Field(max_length=0)] = Field(
        default_factory=dict
    )
    numerics: dict[Short, JsonValue] = Field(default_factory=dict)
    """How the record bits were computed (see docs/cache-format.md)."""
    header_sha256: dict[Literal[SEALED], Hex64] = Field(default_factory=dict)  # type: ignore[valid-type]
    """sha256 of each sealed block's canonical JSON."""
    _blocks: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_blocks(cls, data: Any, handler: Any) -> Manifest:
        made = handler(data)
        if isinstance(data, dict):
            made._blocks = {k: data[k] for k in BLOCKS if k in data}
        return made

    def block_json(self, name: str) -> Any:
        """A header block as JSON: as read (or built), else dumped from the model."""
        if name in self._blocks:
            return self._blocks[name]
        value = getattr(self, name)
        if name == "fields":
            return [f.model_dump(mode="json", exclude_unset=True) for f in value]
        if isinstance(value, BaseModel):
            return value.model_dump(mode="json", exclude_unset=True)
        return value

    @property
    def num_records(self) -> int:
        return sum(e.records for e in self.shards)  # type: ignore[attr-defined]

    @property
    def num_bytes(self) -> int:
        return sum(e.bytes for e in self.shards)  # type: ignore[attr-defined]


class WdsManifest(Manifest):
    shards: Entries[WdsEntry] = Field(default_factory=lambda: Entries(WdsEntry, []))


class ZarrManifest(Manifest):
    shards: Entries[ZarrEntry] = Field(default_factory=lambda: Entries(ZarrEntry, []))


MANIFESTS: dict[str, type[Manifest]] = {"webdataset": WdsManifest, "zarr": ZarrManifest}


class JournalBase(Schema):
    rank: Annotated[int, Field(ge=0, le=1 << 20)]


class WdsJournal(JournalBase):
    shards: Entries[WdsEntry]


class ZarrJournal(JournalBase):
    shards: Entries[ZarrEntry]


JOURNALS: dict[str, type[JournalBase]] = {"webdataset": WdsJournal, "zarr": ZarrJournal}


# ----------------------------------------------------------------------------- zarr metadata


class ZarrGroupAttrs(OpenSchema):
    block_records: Annotated[int, Field(ge=1, le=1 << 20)]
    token_chunk: Annotated[int, Field(ge=1, le=1 << 20)]
    token_block: Annotated[int, Field(ge=1, le=1 << 30)]


class ZarrGroupMeta(OpenSchema):
    """`data.zarr/zarr.json`: what the zarr backend reads of it before zarr-python does."""

    zarr_format: Literal[3]
    node_type: Literal["group"]
    attributes: dict[Short, JsonValue] = Field(default_factory=dict)


class ZarrArrayMeta(OpenSchema):
    """`data.zarr/<array>/zarr.json`: bounds checked before zarr-python parses the rest."""

    zarr_format: Literal[3]
    node_type: Literal["array"]
    shape: Annotated[list[Annotated[int, Field(ge=0, le=MAX_ROWS)]], Field(max_length=8)]
    data_type: JsonValue
    chunk_grid: dict[Short, JsonValue]
    chunk_key_encoding: dict[Short, JsonValue]
    fill_value: JsonValue
    codecs: Annotated[list[dict[Short, JsonValue]], Field(min_length=1, max_length=16)]
    attributes: dict[Short, JsonValue] = Field(default_factory=dict)


class ZarrNodeMeta(OpenSchema):
    """Just enough to tell a group's zarr.json from an array's."""

    node_type: Literal["group", "array"]
