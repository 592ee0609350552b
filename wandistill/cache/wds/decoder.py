"""Reading a cache with stock webdataset: `safe_decoder()` decodes only wandistill's members,
checked against their checksums, never through webdataset's pickle-backed handlers."""

from __future__ import annotations

import json
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load

from wandistill.cache.wds.format import META_KEY, UNSAFE_EXTS, member_name_problem, tensor_checksums
from wandistill.errors import CacheError


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
        tensors = st_load(data) if ext == "safetensors" and not self.verify else decode(data)
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
