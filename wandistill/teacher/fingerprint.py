"""Identify a teacher folder without hashing its weights.

A 14B teacher is ~60 GB; hashing it would take minutes for every precompute. The configs plus
every safetensors header (tensor names, dtypes, shapes, byte offsets) and file size pin down the
architecture and the checkpoint layout; two different fine-tunes of one architecture differ in
size-identical bytes only, which is why the header digest also covers the first and last 64 KiB
of every weight file (cheap, and it catches a swapped checkpoint).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from wandistill.digest import component_digests
from wandistill.errors import UsageError


def teacher_fingerprint(path: str | Path) -> dict[str, Any]:
    """{"fingerprint": hex, "components": {name: {file: digest}}, "path": str}."""
    root = Path(path)
    index = root / "model_index.json"
    if not index.is_file():
        raise UsageError(
            f"teacher {str(root)!r} is not a diffusers folder (no model_index.json)",
            fix="pass a local Wan diffusers folder (e.g. from `wandistill teacher make-tiny`)",
        )
    model_index = json.loads(index.read_text(encoding="utf-8"))
    components: dict[str, dict[str, str]] = {
        "model_index": {"model_index.json": hashlib.sha256(index.read_bytes()).hexdigest()}
    }
    for name, spec in sorted(model_index.items()):
        sub = root / name
        if name.startswith("_") or not isinstance(spec, list) or not sub.is_dir():
            continue
        components[name] = component_digests(sub)
    blob = json.dumps(components, sort_keys=True).encode()
    return {
        "fingerprint": hashlib.sha256(blob).hexdigest(),
        "components": components,
        "path": str(root.resolve()),
    }
