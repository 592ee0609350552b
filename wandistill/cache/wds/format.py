"""The webdataset shard layout and its checksums: member names, tar blocks, crc32c per tensor
(and per step row), the checks a record's JSON pieces pass (see `wandistill.cache.wds`)."""

from __future__ import annotations

import tarfile
from pathlib import PurePosixPath
from typing import Annotated, Any

import google_crc32c
import numpy as np
import torch
from pydantic import StringConstraints

from wandistill.cache.contract import (
    is_step_field,
    tensor_bytes,
)
from wandistill.cache.files import Name, TensorInfo
from wandistill.checks.validate import MiB, check, parse_json
from wandistill.errors import CacheError

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


UNSAFE_EXTS = frozenset({"pth", "pt", "pyd", "pkl", "pickle", "ckpt", "bin", "npy", "npz"})
"""Extensions webdataset's default handlers (or their usual loaders) unpickle."""


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
