"""Write webdataset shards: each record's `.json` + `.safetensors` members streamed into a tar
through `webdataset.TarWriter`, hashing every byte outside the tensor data on the way."""

from __future__ import annotations

import contextlib
import hashlib
import json
import tarfile
from typing import Any, BinaryIO

import webdataset as wds

from wandistill.cache.contract import (
    Record,
    canonical_json,
    tensor_bytes,
)
from wandistill.cache.wds.format import BLOCK, META_KEY, _padded, crc32c, tensor_checksums
from wandistill.io.storage import Storage
from wandistill.runtime.workarounds import safetensors_header


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
    def __init__(self, store: Storage) -> None:
        self.store = store

    def begin(self, name: str) -> None:
        self.rel = f"shards/{name}.tar"
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
