"""Digests of model component folders, cheap enough for 60 GB teachers.

Configs and tokenizer files are hashed whole; a safetensors file by its header (tensor names,
dtypes, shapes, offsets), its size and its first and last 64 KiB of data, which pins down the
architecture and catches a swapped checkpoint without reading the weights. Shared by the teacher's
fingerprint (precompute) and export, which checks that the teacher it links is the one the cache
was made with.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_SAMPLE = 64 * 1024
_CONFIG_SUFFIXES = (".json", ".txt", ".model")


def file_digest(path: Path) -> str:
    """sha256 of a config file, or of a safetensors file's header, size and ends."""
    h = hashlib.sha256()
    if path.suffix == ".safetensors":
        size = path.stat().st_size
        with open(path, "rb") as f:
            hlen = int.from_bytes(f.read(8), "little")
            h.update(f.read(hlen))
            h.update(size.to_bytes(8, "little"))
            h.update(f.read(_SAMPLE))
            f.seek(max(8 + hlen, size - _SAMPLE))
            h.update(f.read(_SAMPLE))
    else:
        h.update(path.read_bytes())
    return h.hexdigest()


def component_digests(folder: Path) -> dict[str, str]:
    """{relative file: digest} of one component folder (configs, tokenizer files, weights)."""
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and (p.suffix == ".safetensors" or p.suffix in _CONFIG_SUFFIXES)
    )
    return {str(p.relative_to(folder)): file_digest(p) for p in files}
