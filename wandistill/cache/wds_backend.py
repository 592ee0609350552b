"""webdataset backend: POSIX tar shards, one `<key>.json` + `<key>.safetensors` pair per record.

Shards are written with `webdataset.TarWriter` (no encoder: we hand it bytes, so nothing is ever
pickled; the `.safetensors` member is streamed by its tarfile from the header and each tensor's
own bytes, never serialised into one blob first) into a temp name, fsynced and renamed. Because
every member name is short and the tar format is USTAR, member data offsets are computable; we
record each record's safetensors offset and length in the manifest so the training reader can
`pread` one recorded step directly instead of streaming the tar. Stock `webdataset.WebDataset`
still reads these shards unchanged.

Checksums (no silent wrong tensors), each byte hashed once. The training reader `pread`s one
step's rows, so a whole-shard sha256 cannot guard it. Each record's safetensors header carries,
in its `__metadata__`, the record key and a crc32c of every tensor (one per row of the leading
step axis for step fields: x_t, teacher output, timesteps, features); the manifest entry's
`crc32c` lists, per record, the crc32c of that header (8-byte length prefix + JSON) and of the
`.json` member; its `frame_sha256` hashes every other byte of the tar: headers,
padding and members outside the tensor data.
Every read verifies the header against the manifest, then each tensor or row it returns against
the header (crc32c runs at ~13 GB/s). Caches written before these checksums existed carry neither
and are read unverified, as before. `verify` also walks the tar headers: any member that is not
`<listed key>.json` / `<listed key>.safetensors` (a `.pth`, a `../` path, a link) is reported.

Reading with stock webdataset: use `safe_decoder()` (`.decode(safe_decoder())` or
`.map(safe_decoder())`), never webdataset's default handlers, which unpickle `.pth`/`.pyd`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tarfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, BinaryIO

import google_crc32c
import numpy as np
import torch
import webdataset as wds
from pydantic import StringConstraints
from safetensors.torch import load as st_load

from wandistill.cache.batch import BatchBuffers, empty
from wandistill.cache.contract import (
    DTYPE_NAMES,
    DTYPE_NAMES_BY_SAFETENSORS,
    DTYPES_BY_NAME,
    Record,
    canonical_json,
    is_step_field,
    tensor_bytes,
)
from wandistill.cache.files import Name, OwnMeta, RecordMeta, TensorInfo, WdsEntry
from wandistill.checks.validate import MiB, check, inside, parse_json, rel_path_problem
from wandistill.errors import CacheError, CorruptRecordError
from wandistill.io.storage import LocalStorage, Storage, is_transient, open_storage
from wandistill.runtime.workarounds import safetensors_header

BLOCK = tarfile.BLOCKSIZE
META_KEY = "wandistill"
"""The one safetensors `__metadata__` key wandistill writes (one key: safetensors does not keep
the order of several): JSON {"key": record key, "crc32c": {tensor: crc32c, or [crc32c per step
row]}}."""
MEMBER_EXTS = ("json", "safetensors")
"""The only members a wandistill shard holds, one of each per record."""
HEAD_READ = 4096
"""First read of a record: the length prefix and (almost always) the whole header."""
HEADER_CACHE = 4096
"""Parsed record headers a WebDatasetSource keeps (a few KB each)."""
MAX_HEADER_BYTES = 100 * MiB
"""safetensors' own cap on a header; a longer length prefix is corruption."""
_META = "__metadata__"
_Metadata = dict[str, Annotated[str, StringConstraints(max_length=100 * MiB)]]
_Table = dict[Name, TensorInfo]


def _checked_json(data: bytes | str | None, what: str, tp: Any, obj: Any = None) -> Any:
    """Parse (unless `obj` is given) and check one piece of a record against its schema; a
    failure is a CacheError that the read paths turn into a CorruptRecordError."""
    fix = "run `wandistill cache verify`; restore the shard, or pass --skip-corrupt"
    if data is not None:  # every value is typed by `tp`: no separate walk needed
        obj = parse_json(data, what, fix=fix, error=CacheError, walk=False)
    return check(tp, obj, what, fix=fix, error=CacheError)


def crc32c(data: Any) -> int:
    """crc32c of a bytes-like object or a contiguous numpy array."""
    return int(google_crc32c.value(data))


def tensor_checksums(
    tensors: dict[str, torch.Tensor], raw: dict[str, np.ndarray] | None = None
) -> dict[str, int | list[int]]:
    """crc32c of each tensor's bytes; step fields get one per row of their leading step axis.
    `raw`: the tensors' bytes (`tensor_bytes`) when the caller has them already."""
    out: dict[str, int | list[int]] = {}
    for name, t in tensors.items():
        data = tensor_bytes(t) if raw is None else raw[name]
        if is_step_field(name) and t.dim() >= 1:
            rows = int(t.shape[0])
            out[name] = [crc32c(row) for row in data.reshape(rows, data.size // max(rows, 1))]
        else:
            out[name] = crc32c(data)
    return out


def member_name_problem(name: str) -> str | None:
    """Why a tar member name is unsafe to use anywhere (absolute, `..`, backslash), or None."""
    if not name:
        return "is empty"
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return "is an absolute path"
    if "\\" in name:
        return "contains a backslash"
    if ".." in PurePosixPath(name).parts:
        return "contains '..'"
    return None


def _padded(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


class _Parts:
    """Some bytes as a list of (buffer, hashed) pieces: what `_PartReader.read` hands tarfile,
    which only takes its `len` and passes it on to `_HashingFile.write`."""

    def __init__(self, parts: list[tuple[memoryview, bool]]) -> None:
        self.parts = parts
        self.size = sum(len(v) for v, _ in parts)

    def __len__(self) -> int:
        return self.size


class _PartReader:
    """A read-only file over (buffer, hashed) pieces, read without copying a byte: a record's
    safetensors header (hashed into the shard's frame digest) and its tensors' bytes (covered by
    the crc32c in that header instead, so hashed once, not twice)."""

    def __init__(self, parts: list[tuple[Any, bool]]) -> None:
        self.parts = [(memoryview(v).cast("B"), hashed) for v, hashed in parts]
        self.size = sum(len(v) for v, _ in self.parts)

    def read(self, n: int) -> _Parts:
        out: list[tuple[memoryview, bool]] = []
        while n > 0 and self.parts:
            view, hashed = self.parts[0]
            out.append((view[:n], hashed))
            if len(view) <= n:
                self.parts.pop(0)
            else:
                self.parts[0] = (view[n:], hashed)
            n -= len(out[-1][0])
        return _Parts(out)


class _HashingFile:
    """A write-only file object that counts what passes through to the real file and hashes the
    shard's frame: every byte but the records' tensor data (see `WebDatasetSink`)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | _Parts) -> int:
        parts = data.parts if isinstance(data, _Parts) else [(data, True)]
        for view, hashed in parts:
            if hashed:
                self.sha.update(view)
            self.f.write(view)
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        self.f.flush()

    def tell(self) -> int:
        return self.size


class _DirectTarWriter(wds.TarWriter):
    """webdataset's TarWriter over a seekless file in plain "w:" mode, one write per member.

    TarWriter opens tarfile in stream mode ("w|"), whose 10 KiB record buffer re-slices the
    pending bytes on every write: ~28k writes and hash updates per 64 Wan records. Plain mode with
    a large copy buffer writes each header, blob and padding once; the bytes are identical.
    """

    @staticmethod
    def tarmode(fileobj: Any, compress: Any = None) -> str:
        return "w:"

    def __init__(self, fileobj: Any, **kw: Any) -> None:
        super().__init__(fileobj, **kw)
        self.tarstream.copybufsize = 1 << 30

    def write_parts(self, name: str, parts: list[tuple[Any, bool]]) -> None:
        """One member streamed from (buffer, hashed) pieces by tarfile, with the header fields
        `TarWriter.write` gives a member (which takes only one bytes object per member)."""
        reader = _PartReader(parts)
        info = tarfile.TarInfo(name)
        info.size = reader.size
        info.mtime, info.mode = self.mtime, self.mode
        info.uname, info.gname = self.user, self.group
        self.tarstream.addfile(info, reader)


class _Aborted(Exception):
    """Thrown into a shard's upload to drop it (temp file removed, object upload aborted)."""


class WebDatasetSink:
    suffix = ".tar"

    def __init__(self, store: Storage) -> None:
        self.store = store

    def begin(self, name: str) -> None:
        self.rel = f"shards/{name}{self.suffix}"
        self.upload = self.store.upload(self.rel, bulk=True)
        self.file = self.upload.__enter__()  # left in end (publish) or abort (drop)
        self.hashing = _HashingFile(self.file)
        # mtime=0 and fixed owner make shard bytes a pure function of the records.
        self.tar = _DirectTarWriter(
            self.hashing, encoder=False, mtime=0, user="wandistill", group="wandistill"
        )
        self.offsets: list[list[int]] = []
        self.crcs: list[list[int]] = []

    def add(self, record: Record) -> None:
        """Stream the record's members into the tar: no serialised blob, no copy of a tensor.

        The `.safetensors` member is the header `safetensors.torch.save` would write, then each
        tensor's own bytes. Each byte is checksummed once: tensor bytes by the crc32c (per
        tensor, per step row) in that header, every other byte of the shard (tar headers and
        padding, `.json` members, safetensors headers) by the entry's `frame_sha256`."""
        meta = json.dumps(record.meta(), ensure_ascii=False).encode()
        tensors = record.tensors()
        raw = {name: tensor_bytes(t) for name, t in tensors.items()}
        own = {"key": record.key, "crc32c": tensor_checksums(tensors, raw)}
        head, order = safetensors_header(tensors, {META_KEY: canonical_json(own)})
        parts = [(head, True)] + [(raw[name], False) for name in order]
        start = self.tar.tarstream.offset
        # Members in webdataset's order (sorted extensions): json, then safetensors.
        json_off = start + BLOCK
        st_off = json_off + _padded(len(meta)) + BLOCK
        self.tar.write({"__key__": record.key, "json": meta})
        self.tar.write_parts(f"{record.key}.safetensors", parts)
        size = self.tar.tarstream.members[-1].size
        assert self.tar.tarstream.offset == st_off + _padded(size), "tar layout changed"
        self.offsets.append([st_off, size, json_off, len(meta)])
        self.crcs.append([crc32c(head), crc32c(meta)])

    def end(self) -> dict[str, Any]:
        try:
            self.tar.close()
        except BaseException as e:
            self._drop(e)
            raise
        self.upload.__exit__(None, None, None)  # fsync + rename, or complete the upload
        return {
            "file": self.rel,
            "bytes": self.hashing.size,
            "frame_sha256": self.hashing.sha.hexdigest(),
            "offsets": self.offsets,
            "crc32c": self.crcs,
        }

    def abort(self) -> None:
        self._drop(_Aborted())

    def _drop(self, e: BaseException) -> None:
        with contextlib.suppress(_Aborted):
            self.upload.__exit__(type(e), e, e.__traceback__)


_ST_DTYPES = DTYPE_NAMES_BY_SAFETENSORS
_Read = tuple[str, int, Any, int | None]
"""One tensor read: (name, offset in the shard, destination buffer, expected crc32c)."""
_RECORD_ERRORS = (OSError, EOFError, ValueError, KeyError, IndexError, TypeError, CacheError)
"""What a damaged record or shard raises while it is read (a CorruptRecordError)."""
UNSAFE_EXTS = frozenset({"pth", "pt", "pyd", "pkl", "pickle", "ckpt", "bin", "npy", "npz"})
"""Extensions webdataset's default handlers (or their usual loaders) unpickle."""


def _step_text(step: int | None) -> str:
    return "" if step is None else f" step {step}"


def _describe(e: BaseException) -> str:
    """One line for a failed read (the caller names shard and record)."""
    if isinstance(e, CacheError):
        return e.message
    if isinstance(e, FileNotFoundError):
        return f"shard file {e.filename} is missing"
    if isinstance(e, KeyError):
        return str(e.args[0]) if e.args else "KeyError"
    if type(e) in (ValueError, EOFError, IndexError):  # raised here, already worded
        return str(e)
    return f"{type(e).__name__}: {e}"


class WebDatasetSource:
    """Random access into published tar shards: positioned reads at manifest offsets
    (`os.pread` locally, ranged GETs on an object store; `wandistill.io.storage`).

    Thread-safe: `pread` has no shared file position, and releases the GIL while it waits on the
    disk, so a thread pool reads at close to the device's speed. Every read is checked against
    the record's checksums (see the module docstring) and fails with `CorruptRecordError`.
    """

    def __init__(self, cache: str | Path | Storage) -> None:
        self.store = cache if isinstance(cache, Storage) else open_storage(cache)
        self.cache = self.store.url
        self._headers: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._headers_lock = threading.Lock()
        self._rels: dict[tuple[str, str], str] = {}

    # ------------------------------------------------------------------ files

    def rel(self, entry: WdsEntry) -> str:
        """The shard's name in the cache; a manifest `file` outside the cache is refused.

        Checked once per (shard, file) and kept: the check resolves symlinks (a `realpath`,
        ~30 us), which the training reader would otherwise pay on every sample."""
        key = (entry.name, entry.file)
        rel = self._rels.get(key)
        if rel is None:
            rel = self._rels[key] = self._checked_rel(entry)
        return rel

    def _checked_rel(self, entry: WdsEntry) -> str:
        rel = entry.file
        what = f"shard {entry.name}: manifest file"
        if isinstance(self.store, LocalStorage):
            inside(self.store.root, rel, what, CacheError)
        elif problem := rel_path_problem(rel):  # an object store has no links to follow
            raise CacheError(f"{what} {rel!r} {problem}; refused", fix="restore the manifest")
        return rel

    def path(self, entry: WdsEntry) -> str:
        """The shard's path or URL."""
        return self.store.name(self.rel(entry))

    def check_file(self, entry: WdsEntry) -> str | None:
        """Why this shard cannot be read at all (missing, wrong size, bad path), or None."""
        try:
            rel = self.rel(entry)
        except CacheError as e:
            return e.message
        size = self.store.size(rel)
        if size is None:
            return f"shard {entry.name}: file {entry.file} is missing"
        if size != entry.bytes:
            return (
                f"shard {entry.name}: file {entry.file} has {size} bytes, the manifest "
                f"says {entry.bytes} (truncated or replaced)"
            )
        return None

    def _pread(self, rel: str, offset: int, size: int, what: str) -> bytes:
        data = self.store.read_range(rel, offset, size)
        if len(data) != size:
            raise EOFError(
                f"short read of {what} ({len(data)} of {size} bytes at offset {offset}): "
                "the shard is truncated"
            )
        return data

    # ------------------------------------------------------------------ headers

    def _parse_header(
        self, entry: WdsEntry, i: int, head: bytes, *, typed: bool = False
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Check a record's header bytes (length prefix + JSON) and split off its metadata.

        A header whose crc32c matches the (schema-checked, sealed) manifest entry is the one the
        writer produced from typed tensors: on the training hot path it is only parsed (strict
        JSON, ~7 us), and `_span` checks each tensor it uses. Any other header (a cache without
        checksums), and every header `verify` reads (`typed`), is also checked against the
        schema (~17 us more; docs/reliability.md)."""
        crcs = entry.crc32c
        if crcs is not None and crc32c(head) != crcs[i][0]:
            raise ValueError(
                "safetensors header fails its crc32c check (the header bytes changed, or the "
                "manifest's offsets were edited)"
            )
        typed = typed or crcs is None
        table = _checked_json(head[8:], "safetensors header", dict[str, Any])
        meta = table.pop(_META, None) or {}
        if typed:
            _checked_json(None, "safetensors __metadata__", _Metadata, meta)
            _checked_json(None, "safetensors header", _Table, table)  # typed; used as read
        if META_KEY not in meta:
            return table, None  # written before checksums existed
        own = _checked_json(meta[META_KEY], "safetensors metadata", OwnMeta if typed else Any)
        key, sums = (own.key, own.crc32c) if typed else (own["key"], own["crc32c"])
        if key != entry.keys[i]:
            raise ValueError(f"the data belongs to record {key} (manifest keys edited?)")
        return table, sums

    def _header_len(self, entry: WdsEntry, i: int, prefix: bytes) -> int:
        length = entry.offsets[i][1]
        hlen = int.from_bytes(prefix[:8], "little")
        if len(prefix) < 8 or hlen <= 0 or 8 + hlen > length or hlen > MAX_HEADER_BYTES:
            raise ValueError(
                f"bad safetensors header length {hlen} (record is {length} bytes): the record "
                "bytes changed, or the manifest's offsets were edited"
            )
        return hlen

    def header(self, entry: WdsEntry, i: int) -> tuple[int, dict[str, Any], dict[str, Any] | None]:
        """Record i's safetensors header: (absolute data start, tensor table, checksums).

        Kept for the last HEADER_CACHE records read: a committed shard never changes, and a
        training epoch reads each record once per recorded step, so this saves a read (a GET
        round trip on an object store) and a parse per sample. The key holds what the manifest
        says about the record, so an edited entry is read afresh."""
        crcs = entry.crc32c
        key = (entry.name, i, *entry.offsets[i][:2], crcs[i][0] if crcs else None)
        with self._headers_lock:
            found = self._headers.get(key)
            if found is not None:
                self._headers.move_to_end(key)
                return found
        found = self._read_header(entry, i)
        with self._headers_lock:
            self._headers[key] = found
            while len(self._headers) > HEADER_CACHE:
                self._headers.popitem(last=False)
        return found

    def _read_header(
        self, entry: WdsEntry, i: int
    ) -> tuple[int, dict[str, Any], dict[str, Any] | None]:
        off, length = entry.offsets[i][:2]
        rel = self.rel(entry)
        want = min(length, HEAD_READ)
        head = self.store.read_range(rel, off, want)  # one read covers the header almost always
        if len(head) < min(want, 8):
            raise EOFError(f"short read of the safetensors header at offset {off}: truncated")
        hlen = self._header_len(entry, i, head)
        if 8 + hlen > len(head):
            if len(head) < want:
                raise EOFError(f"short read of the safetensors header at offset {off}: truncated")
            head += self._pread(rel, off + len(head), 8 + hlen - len(head), "the header")
        table, sums = self._parse_header(entry, i, head[: 8 + hlen])
        return off + 8 + hlen, table, sums

    def _span(
        self,
        entry: WdsEntry,
        i: int,
        base: int,
        table: dict[str, Any],
        sums: dict[str, Any] | None,
        name: str,
        step: int | None,
    ) -> tuple[int, int, torch.dtype, list[int], int | None]:
        """(absolute offset, bytes, dtype, shape, expected crc32c) of a tensor or one step row."""
        info = table.get(name)
        if info is None:
            raise KeyError(f"no tensor {name!r} in the record")
        dtype = DTYPES_BY_NAME[_ST_DTYPES[info["dtype"]]]
        a, b = info["data_offsets"]
        shape = list(info["shape"])
        nbytes = dtype.itemsize
        for n in shape:
            nbytes *= n
        if b - a != nbytes or a < 0 or base + b > entry.offsets[i][0] + entry.offsets[i][1]:
            raise ValueError(f"{name!r}: header offsets {a}..{b} do not fit shape {shape}")
        want = sums.get(name) if sums is not None else None
        if step is not None:
            if not shape or not 0 <= step < shape[0]:
                raise IndexError(
                    f"{name!r} holds {shape[0] if shape else 0} recorded steps, step {step} was "
                    "asked (manifest settings.record_steps edited?)"
                )
            row = nbytes // shape[0]
            a, nbytes, shape = a + step * row, row, shape[1:]
            if sums is not None:
                want = want[step] if isinstance(want, list) and step < len(want) else None
        return base + a, nbytes, dtype, shape, want

    # ------------------------------------------------------------------ reads

    def read_blob(self, entry: WdsEntry, i: int) -> bytes:
        off, length = entry.offsets[i][:2]
        return self._pread(self.rel(entry), off, length, "the safetensors member")

    def read_meta(self, entry: WdsEntry, i: int) -> RecordMeta:
        _, _, joff, jlen = entry.offsets[i]
        data = self._pread(self.rel(entry), joff, jlen, "the json member")
        crcs = entry.crc32c
        if crcs is not None and crc32c(data) != crcs[i][1]:
            raise ValueError("json member fails its crc32c check")
        meta = _checked_json(data, "json member", dict[str, Any])
        typed: RecordMeta = _checked_json(None, "json member", RecordMeta, meta)
        if typed.key != entry.keys[i]:
            raise ValueError(f"json member names key {typed.key!r} (manifest keys edited?)")
        return typed

    def read_ranges(
        self, entry: WdsEntry, i: int, wanted: dict[str, int | None]
    ) -> dict[str, tuple[bytes, str, list[int]]]:
        """Raw bytes of the named tensors; for a name mapped to a step index, only that row.

        Returns name -> (bytes, dtype name, shape) without touching torch, so callers decide
        where tensors are built (pinned memory, a worker thread, ...).
        """
        try:
            base, table, sums = self.header(entry, i)
            rel = self.rel(entry)
            out: dict[str, tuple[bytes, str, list[int]]] = {}
            for name, step in wanted.items():
                pos, n, dtype, shape, want = self._span(entry, i, base, table, sums, name, step)
                data = self._pread(rel, pos, n, repr(name))
                if sums is not None and crc32c(data) != want:
                    raise ValueError(f"{name!r}{_step_text(step)} fails its crc32c check")
                out[name] = (data, DTYPE_NAMES[dtype], shape)
            return out
        except CorruptRecordError:
            raise
        except (OSError, EOFError, ValueError, KeyError, IndexError, TypeError, CacheError) as e:
            if is_transient(e):  # EMFILE and the like: about the process, not the record
                raise
            raise CorruptRecordError(entry.name, entry.keys[i], _describe(e)) from None

    def read_tensors(
        self, entry: WdsEntry, i: int, wanted: dict[str, int | None]
    ) -> dict[str, torch.Tensor]:
        """Named tensors (one step of a step field) read straight into fresh tensors.

        One positioned read per tensor lands the bytes in the tensor's own memory (`preadv`
        locally; on an object store the ranged GETs of a sample go out together). Each tensor
        or row is checked against its crc32c before it is returned.
        """
        try:
            rel, spans = self._spans(entry, i, wanted)
            out = {name: empty(tuple(s[3]), s[2]) for name, s in spans.items()}
            self._fill(rel, wanted, spans, {n: BatchBuffers.raw(t) for n, t in out.items()})
            return out
        except Exception as e:
            raise self._corrupt(entry, i, e) from None

    def read_batch(
        self, samples: list[tuple[WdsEntry, int, dict[str, int | None]]], out: BatchBuffers
    ) -> list[BaseException | None]:
        """Read each (entry, record, wanted) sample straight into its row of `out` (the
        training reader's hot path): headers first (kept, see `header`), then one positioned
        read per tensor or step row into the batch tensor, each checked against its crc32c.
        Returns each sample's error (a `CorruptRecordError`), or None."""
        plans: list[tuple[str, dict[str, Any]] | None] = []
        errors: list[BaseException | None] = []
        for entry, i, wanted in samples:
            try:
                plans.append(self._spans(entry, i, wanted))
                errors.append(None)
            except Exception as e:
                plans.append(None)
                errors.append(self._corrupt(entry, i, e))
        shapes = [
            None if p is None else {n: (tuple(s[3]), s[2]) for n, s in p[1].items()} for p in plans
        ]
        problems = out.allocate(shapes)
        # One read_into per shard file for the whole batch: on an object store its ranges go
        # out as one concurrent `cat_ranges`.
        groups: dict[str, list[tuple[int, list[_Read]]]] = {}
        for b, plan in enumerate(plans):
            if plan is None:
                continue
            if problems[b] is not None:
                errors[b] = self._corrupt(*samples[b][:2], ValueError(problems[b]))
                continue
            reads = self._reads(plan[1], {n: out.raw_row(b, n) for n in plan[1]})
            groups.setdefault(plan[0], []).append((b, reads))
        for rel, group in groups.items():
            with contextlib.suppress(OSError):  # only a hint; the read reports errors
                self.store.will_need(rel, [(r[1], r[2].nbytes) for _, rs in group for r in rs])
        for rel, group in groups.items():
            try:
                got: list[int] | None = self.store.read_into(
                    rel, [(r[1], r[2]) for _, rs in group for r in rs]
                )
            except Exception:  # the file as a whole: read each sample alone to say which
                got = None
            k = 0
            for b, reads in group:
                entry, i, wanted = samples[b]
                try:
                    if got is None:
                        mine = self.store.read_into(rel, [(r[1], r[2]) for r in reads])
                    else:
                        mine = got[k : k + len(reads)]
                    self._check(wanted, reads, mine)
                except Exception as e:
                    errors[b] = self._corrupt(entry, i, e)
                k += len(reads)
        return errors

    def _spans(
        self, entry: WdsEntry, i: int, wanted: dict[str, int | None]
    ) -> tuple[str, dict[str, tuple[int, int, torch.dtype, list[int], int | None]]]:
        """(shard name, name -> `_span`) of the named tensors of record i."""
        base, table, sums = self.header(entry, i)
        spans = {n: self._span(entry, i, base, table, sums, n, s) for n, s in wanted.items()}
        if sums is not None:  # a tensor the checksums do not list fails its check
            spans = {n: (*s[:4], -1 if s[4] is None else s[4]) for n, s in spans.items()}
        return self.rel(entry), spans

    def _fill(
        self,
        rel: str,
        wanted: dict[str, int | None],
        spans: dict[str, tuple[int, int, torch.dtype, list[int], int | None]],
        dest: dict[str, Any],
    ) -> None:
        """One positioned read per span into its destination, then its crc32c check."""
        reads = self._reads(spans, dest)
        self._check(wanted, reads, self.store.read_into(rel, [(r[1], r[2]) for r in reads]))

    @staticmethod
    def _reads(
        spans: dict[str, tuple[int, int, torch.dtype, list[int], int | None]],
        dest: dict[str, Any],
    ) -> list[_Read]:
        """(name, offset, destination, expected crc32c) of each non-empty span; a destination
        is a writable uint8 numpy view of the span's size."""
        return [(n, spans[n][0], raw, spans[n][4]) for n, raw in dest.items() if spans[n][1]]

    @staticmethod
    def _check(wanted: dict[str, int | None], reads: list[_Read], got: list[int]) -> None:
        """Each read complete and matching its crc32c."""
        for (name, _, raw, want), n in zip(reads, got, strict=True):
            if n != raw.nbytes:
                raise EOFError(
                    f"short read of {name!r} ({n} of {raw.nbytes} bytes): the shard is truncated"
                )
            if want is not None and crc32c(raw) != want:
                raise ValueError(
                    f"{name!r}{_step_text(wanted[name])} fails its crc32c check (its bytes "
                    "changed after they were written)"
                )

    @staticmethod
    def _corrupt(entry: WdsEntry, i: int, e: BaseException) -> BaseException:
        """A read failure as the CorruptRecordError naming shard and record (a failure that is
        not about the data, e.g. a bug, as it is)."""
        if isinstance(e, CorruptRecordError) or not isinstance(e, _RECORD_ERRORS):
            return e
        if is_transient(e):
            return e
        return CorruptRecordError(entry.name, entry.keys[i], _describe(e))

    def _checked_record(self, entry: WdsEntry, i: int) -> Record:
        """Read and check a whole record: header, every tensor and row, the json member."""
        blob = self.read_blob(entry, i)
        hlen = self._header_len(entry, i, blob)
        _, sums = self._parse_header(entry, i, blob[: 8 + hlen], typed=True)
        tensors = st_load(blob)
        if sums is not None:
            if set(sums) != set(tensors):
                raise ValueError(f"checksums list {sorted(sums)}, the record has {sorted(tensors)}")
            got = tensor_checksums(tensors)
            for name, want in sums.items():
                if got[name] == want:
                    continue
                if isinstance(want, list) and isinstance(got[name], list):
                    pairs = zip(got[name], want, strict=False)
                    bad = [s for s, (x, y) in enumerate(pairs) if x != y]
                    where = f" step {bad[0]}" if bad else " (row count)"
                else:
                    where = ""
                raise ValueError(f"{name!r}{where} fails its crc32c check")
        return Record.from_parts(self.read_meta(entry, i), tensors)

    def read_record(self, entry: WdsEntry, i: int) -> Record:
        try:
            return self._checked_record(entry, i)
        except CorruptRecordError:
            raise
        except Exception as e:  # safetensors raises its own error types on a bad blob
            if is_transient(e):
                raise
            raise CorruptRecordError(entry.name, entry.keys[i], _describe(e)) from None

    # ------------------------------------------------------------------ verify

    def entry_problems(self, entry: WdsEntry) -> list[str]:
        """Backend fields of a manifest entry that do not fit its record count."""
        name, n = entry.name, len(entry.keys)
        problems = []
        for field_name, width in (("offsets", 4), ("crc32c", 2)):
            rows = getattr(entry, field_name)
            if rows is None and field_name == "crc32c":
                continue
            if not isinstance(rows, list) or len(rows) != n:
                got = len(rows) if isinstance(rows, list) else type(rows).__name__
                problems.append(
                    f"shard {name}: manifest lists {got} {field_name} rows for {n} keys "
                    "(manifest edited?)"
                )
            elif not all(
                isinstance(r, list)
                and len(r) == width
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in r)
                for r in rows
            ):
                problems.append(
                    f"shard {name}: manifest {field_name} rows must be {width} non-negative "
                    "integers each (manifest edited?)"
                )
        return problems

    def member_problems(self, entry: WdsEntry) -> tuple[list[str], dict[str, str]]:
        """Walk the tar headers (never extracting): (shard-level problems, key -> problem).

        Every member must be `<listed key>.json` or `<listed key>.safetensors`, a regular file,
        at the offsets the manifest lists. Unsafe names (absolute, `..`) and anything else
        (a `.pth`, a link, a stray file) are reported; nothing is decoded.
        """
        name = entry.name
        index = {k: i for i, k in enumerate(entry.keys)}
        shard: list[str] = []
        per_key: dict[str, str] = {}
        seen: dict[str, tuple[int, int]] = {}
        complete = True
        try:
            with (
                self.store.open_read(self.rel(entry)) as f,
                tarfile.open(fileobj=f, mode="r:") as tar,
            ):
                for m in tar:
                    problem = member_name_problem(m.name)
                    if problem:
                        shard.append(f"shard {name}: member {m.name!r} {problem}; refused")
                        continue
                    if not m.isreg():
                        shard.append(
                            f"shard {name}: member {m.name!r} is not a regular file "
                            "(link or device); refused"
                        )
                        continue
                    key, _, ext = m.name.partition(".")
                    if "/" in m.name or key not in index or ext not in MEMBER_EXTS:
                        last = m.name.rsplit(".", 1)[-1].lower()
                        why = (
                            "pickle-backed: never decode it"
                            if last in UNSAFE_EXTS
                            else "not a record listed in the manifest"
                            if ext in MEMBER_EXTS
                            else "a wandistill shard holds only <key>.json and <key>.safetensors"
                        )
                        shard.append(f"shard {name}: unexpected member {m.name!r} ({why})")
                        continue
                    if m.name in seen:
                        shard.append(f"shard {name}: member {m.name!r} appears twice")
                        continue
                    seen[m.name] = (m.offset_data, m.size)
        except (tarfile.TarError, OSError, EOFError) as e:
            complete = False
            shard.append(f"shard {name}: tar headers unreadable after {len(seen)} members ({e})")
        for key, i in index.items():
            o = entry.offsets[i]
            for ext, want in (("safetensors", (o[0], o[1])), ("json", (o[2], o[3]))):
                got = seen.get(f"{key}.{ext}")
                if got is None:
                    if complete:
                        per_key.setdefault(key, f"member {key}.{ext} is missing from the tar")
                elif got != want:
                    per_key.setdefault(
                        key,
                        f"manifest offsets put {ext} at {want[0]} ({want[1]} bytes), the tar "
                        f"has it at {got[0]} ({got[1]} bytes) (manifest edited?)",
                    )
        return shard, per_key

    def frame_digest(self, entry: WdsEntry, rel: str) -> str:
        """sha256 of the shard's bytes outside its records' tensor data (schema 3's
        `frame_sha256`): each record's data starts after its safetensors header, whose length is
        read from the file (a changed length moves the frame, so the digest fails). The file
        must have the entry's size (the schema keeps every offset inside it)."""
        skips, size = [], entry.bytes
        for st_off, length, _, _ in entry.offsets:
            prefix = self.store.read_range(rel, st_off, min(8, length))
            head = 8 + int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
            skips.append((st_off + min(head, length), st_off + length))
        sha, pos = hashlib.sha256(), 0
        with self.store.open_read(rel) as f:
            for skip_from, skip_to in [*sorted(skips), (size, size)]:
                f.seek(pos)
                while pos < skip_from and (chunk := f.read(min(1 << 22, skip_from - pos))):
                    sha.update(chunk)
                    pos += len(chunk)
                pos = max(pos, skip_to)
        return sha.hexdigest()

    def verify(self, entry: WdsEntry) -> list[str]:
        """Checksum the shard, walk its members, then read and check every record.

        Shard-level problems first, then at most one line per record, naming shard and key.
        """
        name = entry.name
        problems = self.entry_problems(entry)
        if problems:
            return problems  # offsets cannot be trusted: nothing more to read by them
        try:
            rel = self.rel(entry)
        except CacheError as e:
            return [e.message]
        size = self.store.size(rel)
        if size is None:
            return [f"shard {name}: file {entry.file} is missing"]
        if size != entry.bytes:
            problems.append(f"shard {name}: {size} bytes on disk, manifest says {entry.bytes}")
        # the records' tensor data is crc32c-checked below; the frame covers every other byte
        if size == entry.bytes and self.frame_digest(entry, rel) != entry.frame_sha256:
            problems.append(
                f"shard {name}: sha256 mismatch in its frame (tar headers or padding, "
                ".json members or safetensors headers changed after it was written, or the "
                "manifest's frame_sha256 was edited)"
            )
        shard_level, per_key = self.member_problems(entry)
        problems.extend(shard_level)
        for i, key in enumerate(entry.keys):
            detail = per_key.get(key)
            if detail is None:
                try:
                    rec = self._checked_record(entry, i)
                    for tname, t in rec.tensors().items():
                        if t.is_floating_point() and not bool(t.float().isfinite().all()):
                            raise ValueError(f"{tname!r} holds non-finite values")
                except Exception as e:  # every decode failure is reported, none is fatal here
                    detail = _describe(e)
            if detail is not None:
                problems.append(f"shard {name} record {key}: {detail}")
        return problems

    def close(self) -> None:
        self.store.close()


# ---------------------------------------------------------------------- stock webdataset reads


class UnsafeMemberError(CacheError):
    """A webdataset member wandistill will not decode (pickle-backed, unknown, unsafe name)."""


class CorruptMemberError(CacheError):
    """A member read with stock webdataset whose bytes fail the checksums written with it."""


def checked_tensors(blob: bytes) -> dict[str, torch.Tensor]:
    """Decode a record's `.safetensors` member and check every tensor (and step row) against the
    crc32c the writer put in its header, so a flipped byte raises instead of returning wrong
    numbers. Members written before checksums existed carry none and are returned unverified."""
    try:
        hlen = int.from_bytes(blob[:8], "little")
        if len(blob) < 8 or hlen <= 0 or 8 + hlen > len(blob):
            raise ValueError(f"bad header length {hlen} for a {len(blob)}-byte member")
        meta = json.loads(blob[8 : 8 + hlen]).get("__metadata__") or {}
        own = json.loads(meta[META_KEY]) if META_KEY in meta else None
        tensors = st_load(blob)
    except Exception as e:  # safetensors / json raise their own types on damaged bytes
        raise CorruptMemberError(
            f"a .safetensors member cannot be decoded ({type(e).__name__}: {e})",
            fix="run `wandistill cache verify` on the cache",
        ) from None
    if own is None:
        return tensors
    want, got = own.get("crc32c", {}), tensor_checksums(tensors)
    bad = sorted(n for n in set(want) | set(got) if want.get(n) != got.get(n))
    if bad:
        name = bad[0]
        w, g = want.get(name), got.get(name)
        pairs = zip(w, g, strict=False) if isinstance(w, list) and isinstance(g, list) else ()
        rows = [i for i, (a, b) in enumerate(pairs) if a != b]
        where = f" step {rows[0]}" if rows else ""
        raise CorruptMemberError(
            f"record {own.get('key')}: tensor {name!r}{where} fails its crc32c check (its bytes "
            f"changed after they were written; {len(bad)} tensor(s) differ)",
            fix="run `wandistill cache verify` on the cache; restore the shard",
        )
    return tensors


_SAFE_DECODERS: dict[str, Callable[[bytes], Any]] = {
    "json": json.loads,
    "safetensors": checked_tensors,
    "txt": lambda data: data.decode("utf-8"),
}


class SafeDecoder:
    """Decode wandistill shards read with stock webdataset, with no pickle anywhere.

    `.decode(safe_decoder())`: a webdataset handler `(".ext", bytes)`; it decodes `.json`,
    `.safetensors` and `.txt` and raises `UnsafeMemberError` for every other extension, so
    webdataset's default post-handlers (which unpickle `.pth`/`.pyd`) are never reached.
    `.map(safe_decoder())`: decodes a whole sample the same way and also refuses a sample whose
    `__key__` is an absolute path or contains `..`, or whose members name another record.

    Checksums are verified by default: every tensor (every step row of x_t, teacher output,
    timesteps, features) against the crc32c in its own header (`CorruptMemberError` on a
    mismatch). `verify=False` skips that (e.g. to salvage what is readable of a damaged shard).
    """

    def __init__(self, *, verify: bool = True, cache: str | Path | None = None) -> None:
        self.verify = verify
        self.codec: Any = None
        """With `cache`: its fields' storage options, so tensors come back decoded (fp8 with
        its scale, bf16, ... -> the dtype the record had; wandistill/cache/encoding.py)."""
        if cache is not None:
            from wandistill.cache.encoding import RecordCodec
            from wandistill.cache.manifest import read_manifest

            self.codec = RecordCodec(read_manifest(cache).fields)

    def __call__(self, key_or_sample: str | dict[str, Any], data: bytes | None = None) -> Any:
        if isinstance(key_or_sample, dict):
            return self.decode_sample(key_or_sample)
        return self.decode_member(key_or_sample, data if data is not None else b"")

    def decode_member(self, key: str, data: bytes) -> Any:
        ext = key.rsplit(".", 1)[-1].lower()
        decode = _SAFE_DECODERS.get(ext)
        if decode is None:
            why = "pickle-backed" if ext in UNSAFE_EXTS else "not a wandistill member"
            raise UnsafeMemberError(
                f"refusing to decode member extension {ext!r} ({why}); wandistill shards hold "
                "only .json and .safetensors members",
                fix="run `wandistill cache verify` on the cache",
            )
        if ext == "safetensors" and not self.verify:
            tensors = st_load(data)
        else:
            tensors = decode(data)
        if ext == "safetensors" and self.codec is not None:
            return self.codec.decode(tensors)
        return tensors

    def decode_sample(self, sample: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in sample.items():
            if k.startswith("__"):
                if k == "__key__" and (problem := member_name_problem(str(v))):
                    raise UnsafeMemberError(f"refusing sample {str(v)!r}: its name {problem}")
                out[k] = v
                continue
            out[k] = self.decode_member(k, v)
        meta = out.get("json")
        if self.verify and isinstance(meta, dict) and "__key__" in out:
            if meta.get("key") not in (None, out["__key__"]):
                raise CorruptMemberError(
                    f"sample {out['__key__']}: its .json member names record {meta.get('key')!r}",
                    fix="run `wandistill cache verify` on the cache",
                )
        return out


def safe_decoder(*, verify: bool = True, cache: str | Path | None = None) -> SafeDecoder:
    """A decoder for stock webdataset reads of a cache: `.decode(safe_decoder())` or `.map(...)`;
    every tensor is checked against its crc32c unless `verify=False`. Pass `cache` (its
    directory) to get tensors decoded from the cache's storage dtypes; without it they come back
    as stored (an fp8 field with its `scale.<field>` tensor)."""
    return SafeDecoder(verify=verify, cache=cache)


def iter_members(path: str | Path) -> Iterator[tarfile.TarInfo]:
    """List a tar's members (never extracting), refusing absolute and `..` names and links."""
    with tarfile.open(path, "r:") as tar:
        for m in tar:
            problem = member_name_problem(m.name)
            if problem:
                raise UnsafeMemberError(f"tar {str(path)!r}: member {m.name!r} {problem}")
            if not m.isreg():
                raise UnsafeMemberError(f"tar {str(path)!r}: member {m.name!r} is not a file")
            yield m


def tensor_from_bytes(data: bytes, dtype: str, shape: list[int]) -> torch.Tensor:
    """A writable tensor over a copy of `data` (frombuffer refuses empty and read-only buffers)."""
    tdtype = DTYPES_BY_NAME[dtype]
    if not data:
        return torch.empty(shape, dtype=tdtype)
    return torch.frombuffer(bytearray(data), dtype=tdtype).reshape(shape)
