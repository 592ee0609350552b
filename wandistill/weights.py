"""Safetensors only: weights in a pickle-based format are refused before anything loads them.

A `.bin` / `.pt` / `.pth` / `.ckpt` file is a pickle, and unpickling runs code. Every load of
a student, a checkpoint or a teacher component reads safetensors (`use_safetensors=True` on
`from_pretrained`, `safetensors.safe_open` / `load_file` elsewhere); `require_safetensors` turns
the library's error for a folder that has only pickle weights into one line naming the file and
the one-time conversion, done by the user where they trust the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from wandistill.errors import UsageError

UNSAFE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def unsafe_weights(folder: Path) -> list[str]:
    """Pickle-format weight files directly in `folder` when it has no .safetensors file."""
    try:
        names = sorted(p.name for p in folder.iterdir() if p.is_file())
    except OSError:
        return []
    if any(n.endswith(".safetensors") for n in names):
        return []
    return [n for n in names if n.endswith(UNSAFE_SUFFIXES)]


def require_safetensors(folder: str | Path, what: str, components: tuple[str, ...] = ()) -> None:
    """Refuse `folder` (or its `components` subfolders) holding only pickle-format weights."""
    root = Path(folder)
    for sub in [root / c for c in components] or [root]:
        found = unsafe_weights(sub)
        if found:
            raise UsageError(
                f"{what} {str(sub)!r} has only pickle-format weights ({found[0]}); wandistill "
                "loads safetensors only, since loading a pickle can run code",
                fix=f"convert it once, where you trust the file: {_conversion(sub)}",
            )


def _conversion(folder: Path) -> str:
    """The command that rewrites `folder` as safetensors with its own library."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    config = config if isinstance(config, dict) else {}
    archs = config.get("architectures")
    if isinstance(config.get("_class_name"), str):
        cls = f"diffusers.{config['_class_name']}"
    elif isinstance(archs, list) and archs and isinstance(archs[0], str):
        cls = f"transformers.{archs[0]}"
    else:
        return (
            "python -c \"import torch, safetensors.torch as st; st.save_file(torch.load('<file>', "
            "weights_only=True), '<file stem>.safetensors')\""
        )
    lib = cls.split(".")[0]
    return (
        f"python -c \"import {lib}; {cls}.from_pretrained('{folder}')"
        f".save_pretrained('{folder}', safe_serialization=True)\""
    )
