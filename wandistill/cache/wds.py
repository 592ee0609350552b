"""webdataset backend: POSIX tar shards, one `<key>.json` + `<key>.safetensors` pair per record.

Shards are written with `webdataset.TarWriter` (no encoder: we hand it bytes, so nothing is ever
pickled) into a temp name, fsynced and renamed. Because every member name is short and the tar
format is USTAR, member data offsets are computable; we record each record's safetensors offset
and length in the manifest so the training reader can `pread` one recorded step directly instead
of streaming the tar. Stock `webdataset.WebDataset` still reads these shards unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import threading
from pathlib import Path
from typing import Any, BinaryIO

import torch
import webdataset as wds
from safetensors.torch import save as st_save

from wandistill.cache.schema import DTYPES_BY_NAME, Record
from wandistill.fsutil import fsync_dir, temp_name

BLOCK = tarfile.BLOCKSIZE


def _padded(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


class _HashingFile:
    """A write-only file object that hashes and counts what passes through to the real file."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

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


class WebDatasetSink:
    suffix = ".tar"

    def __init__(self, cache: Path) -> None:
        self.dir = cache / "shards"

    def begin(self, name: str) -> None:
        self.final = self.dir / f"{name}{self.suffix}"
        self.tmp = temp_name(self.final)
        self.file = open(self.tmp, "wb")  # noqa: SIM115 - closed in end/abort
        self.hashing = _HashingFile(self.file)
        # mtime=0 and fixed owner make shard bytes a pure function of the records.
        self.tar = _DirectTarWriter(
            self.hashing, encoder=False, mtime=0, user="wandistill", group="wandistill"
        )
        self.offsets: list[list[int]] = []

    def add(self, record: Record) -> None:
        meta = json.dumps(record.meta(), ensure_ascii=False).encode()
        blob = st_save(record.tensors())
        start = self.tar.tarstream.offset
        # Members are written in sorted extension order: json, then safetensors.
        json_off = start + BLOCK
        st_off = json_off + _padded(len(meta)) + BLOCK
        self.tar.write({"__key__": record.key, "json": meta, "safetensors": blob})
        assert self.tar.tarstream.offset == st_off + _padded(len(blob)), "tar layout changed"
        self.offsets.append([st_off, len(blob), json_off, len(meta)])

    def end(self) -> dict[str, Any]:
        self.tar.close()
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.final)
        fsync_dir(self.dir)
        return {
            "file": f"shards/{self.final.name}",
            "bytes": self.hashing.size,
            "sha256": self.hashing.sha.hexdigest(),
            "offsets": self.offsets,
        }

    def abort(self) -> None:
        try:
            self.file.close()
        finally:
            if self.tmp.exists():
                self.tmp.unlink()


_ST_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "U8": "uint8",
}


class WebDatasetSource:
    """Random access into published tar shards with `os.pread` at manifest offsets.

    Thread-safe: `pread` has no shared file position, and releases the GIL while it waits on the
    disk, so a thread pool reads at close to the device's speed.
    """

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _fd(self, entry: dict[str, Any]) -> int:
        fd = self._fds.get(entry["name"])
        if fd is None:
            with self._lock:
                fd = self._fds.get(entry["name"])
                if fd is None:
                    fd = os.open(self.cache / entry["file"], os.O_RDONLY)
                    self._fds[entry["name"]] = fd
        return fd

    def _pread(self, fd: int, offset: int, size: int, where: str) -> bytes:
        data = os.pread(fd, size, offset)
        if len(data) != size:
            raise EOFError(f"{where}: short read ({len(data)} of {size} bytes at {offset})")
        return data

    def header(self, entry: dict[str, Any], i: int) -> tuple[int, dict[str, Any]]:
        """The safetensors header of record i: (absolute data start, tensor table)."""
        off, length = entry["offsets"][i][:2]
        fd = self._fd(entry)
        where = f"shard {entry['name']} record {entry['keys'][i]}"
        hlen = int.from_bytes(self._pread(fd, off, 8, where), "little")
        if hlen <= 0 or 8 + hlen > length:
            raise ValueError(f"{where}: bad safetensors header length {hlen}")
        table = json.loads(self._pread(fd, off + 8, hlen, where))
        table.pop("__metadata__", None)
        return off + 8 + hlen, table

    def read_blob(self, entry: dict[str, Any], i: int) -> bytes:
        off, length = entry["offsets"][i][:2]
        return self._pread(self._fd(entry), off, length, f"shard {entry['name']}")

    def read_meta(self, entry: dict[str, Any], i: int) -> dict[str, Any]:
        _, _, joff, jlen = entry["offsets"][i]
        return json.loads(self._pread(self._fd(entry), joff, jlen, f"shard {entry['name']}"))

    def read_ranges(
        self, entry: dict[str, Any], i: int, wanted: dict[str, int | None]
    ) -> dict[str, tuple[bytes, str, list[int]]]:
        """Raw bytes of the named tensors; for a name mapped to a step index, only that row.

        Returns name -> (bytes, dtype name, shape) without touching torch, so callers decide
        where tensors are built (pinned memory, a worker thread, ...).
        """
        base, table = self.header(entry, i)
        fd = self._fd(entry)
        out: dict[str, tuple[bytes, str, list[int]]] = {}
        for name, step in wanted.items():
            if name not in table:
                raise KeyError(f"shard {entry['name']} record {entry['keys'][i]} has no {name!r}")
            info = table[name]
            a, b = info["data_offsets"]
            shape = list(info["shape"])
            if step is not None:
                row = (b - a) // shape[0]
                a, b, shape = a + step * row, a + (step + 1) * row, shape[1:]
            data = self._pread(fd, base + a, b - a, f"shard {entry['name']} record {i}")
            out[name] = (data, _ST_DTYPES[info["dtype"]], shape)
        return out

    def read_tensors(
        self, entry: dict[str, Any], i: int, wanted: dict[str, int | None]
    ) -> dict[str, torch.Tensor]:
        """Named tensors (one step of a step field) read straight into fresh tensors.

        One `preadv` per tensor lands the bytes in the tensor's own memory: no intermediate
        bytes object, no copy (this is the training reader's hot path).
        """
        base, table = self.header(entry, i)
        fd = self._fd(entry)
        out: dict[str, torch.Tensor] = {}
        for name, step in wanted.items():
            info = table.get(name)
            if info is None:
                raise KeyError(f"shard {entry['name']} record {entry['keys'][i]} has no {name!r}")
            a, b = info["data_offsets"]
            shape = list(info["shape"])
            if step is not None:
                row = (b - a) // shape[0]
                a, b, shape = a + step * row, a + (step + 1) * row, shape[1:]
            t = torch.empty(shape, dtype=DTYPES_BY_NAME[_ST_DTYPES[info["dtype"]]])
            if b > a:
                got = os.preadv(fd, [t.reshape(-1).view(torch.uint8).numpy()], base + a)
                if got != b - a:
                    raise EOFError(
                        f"shard {entry['name']} record {entry['keys'][i]}: short read of {name!r} "
                        f"({got} of {b - a} bytes)"
                    )
            out[name] = t
        return out

    def read_record(self, entry: dict[str, Any], i: int) -> Record:
        from safetensors.torch import load as st_load

        return Record.from_parts(self.read_meta(entry, i), st_load(self.read_blob(entry, i)))

    def verify(self, entry: dict[str, Any]) -> list[str]:
        """Checksum the shard, then decode every record; each problem names shard and key."""
        from safetensors.torch import load as st_load

        path = self.cache / entry["file"]
        name = entry["name"]
        if not path.is_file():
            return [f"shard {name}: file {entry['file']} is missing"]
        problems: list[str] = []
        size = path.stat().st_size
        if size != entry["bytes"]:
            problems.append(f"shard {name}: {size} bytes on disk, manifest says {entry['bytes']}")
        sha = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                sha.update(chunk)
        if sha.hexdigest() != entry["sha256"]:
            problems.append(f"shard {name}: sha256 mismatch (file changed after it was written)")
        for i, key in enumerate(entry["keys"]):
            try:
                tensors = st_load(self.read_blob(entry, i))
                meta = self.read_meta(entry, i)
                if meta.get("key") != key:
                    raise ValueError(f"metadata names key {meta.get('key')!r}")
                for t in tensors.values():
                    if t.is_floating_point() and not bool(t.float().isfinite().all()):
                        raise ValueError("non-finite values")
            except Exception as e:  # every decode failure is reported, none is fatal here
                problems.append(f"shard {name} record {key}: {type(e).__name__}: {e}")
        return problems

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def tensor_from_bytes(data: bytes, dtype: str, shape: list[int]) -> torch.Tensor:
    """A writable tensor over a copy of `data` (frombuffer refuses empty and read-only buffers)."""
    tdtype = DTYPES_BY_NAME[dtype]
    if not data:
        return torch.empty(shape, dtype=tdtype)
    return torch.frombuffer(bytearray(data), dtype=tdtype).reshape(shape)
