"""What a folder is, read from its files: the claim's bookkeeping names, whose a folder is
(`owner`, `model_evidence`), and our temps left by dead writers (`remove_stale_temps`). Moved out
of `outputs.py`, which claims folders from these answers."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

PURPOSES = ("cache", "run", "eval", "sample", "export")
MARKER = ".wandistill.json"
LOCK = ".wandistill.lock"
HOLDER = ".wandistill.holder.json"
BOOKKEEPING = frozenset({MARKER, LOCK, HOLDER})
"""Files the claim itself keeps in a folder; a folder holding only these is empty."""
MARKER_FORMAT = "wandistill-output"
RUN_SETTINGS = "run.json"
"""A run's resolved settings. Not `config.json`: model loaders (`from_pretrained(run_dir)`) take a
config.json for a model's own config and fail confusingly on ours."""
LEGACY_RUN_SETTINGS = "config.json"
"""Where runs made before `run.json` kept their settings: still adopted and resumed."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5")
_TEMP = re.compile(r"\..+\.tmp|.+\.[0-9a-f]{32}\.partial")
"""Our temps (`.<name>.<pid>-<tid>.tmp`, `.<prefix>.<random>.tmp`) and zarr 3 LocalStore's
(`<key>.<uuid4 hex>.partial`, zarr/storage/_local.py `_atomic_write`)."""


# --------------------------------------------------------------------------- what a folder is


def model_evidence(folder: Path, *, strict: bool) -> str | None:
    """Why `folder` looks like a model folder, or None. Not strict (folders we own, ancestors):
    model_index.json, or config.json next to weights. Strict: also any weight file."""
    if (folder / "model_index.json").is_file():
        return "it holds model_index.json"
    try:
        weights = sorted(
            p.name for p in folder.iterdir() if p.name.endswith(WEIGHT_SUFFIXES) and p.is_file()
        )
    except OSError:
        return None
    if weights and (folder / "config.json").is_file():
        return f"it holds config.json and {weights[0]}"
    if weights and strict:
        return f"it holds weights: {weights[0]}"
    return None


def owner(folder: Path) -> str | None:
    """The purpose wandistill made `folder` for (its marker, else an earlier version's own
    files); "?" for an unreadable marker; None for a folder wandistill did not make."""
    if (folder / MARKER).exists() or (folder / MARKER).is_symlink():
        data = _read_json(folder / MARKER)
        purpose = data.get("purpose") if data.get("format") == MARKER_FORMAT else None
        return purpose if purpose in PURPOSES else "?"
    try:
        return _legacy_owner(folder)
    except OSError:  # unreadable: not provably ours
        return None


def _legacy_owner(folder: Path) -> str | None:
    """Earlier versions wrote no marker; their folders are known by files only they write."""
    if _is_legacy_cache(folder):
        return "cache"
    if is_run_settings(folder / LEGACY_RUN_SETTINGS) and (
        (folder / "checkpoints").is_dir() or (folder / "metrics.jsonl").is_file()
    ):
        return "run"
    if (folder / "eval.json").is_file() and "latent_mse" in _read_json(folder / "eval.json"):
        return "eval"
    if _read_json(folder / "wandistill_export.json").get("format") == "wandistill-export":
        return "export"  # student.export's own marker, written before claims existed
    names = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    pngs = {n for n in names if re.fullmatch(r"\d{4}\.png", n)}
    if pngs and names <= pngs | {"grid.png"} | BOOKKEEPING:
        return "sample"
    return None


def is_run_settings(path: Path) -> bool:
    """A run's settings file (run.json, or a legacy run's config.json): a "train" object."""
    return path.is_file() and isinstance(_read_json(path).get("train"), dict)


def _is_legacy_cache(folder: Path) -> bool:
    """A wandistill manifest.json: its "format" comes first, so a bounded read of its head
    decides (a real manifest can be tens of MB)."""
    from wandistill.cache.contract import FORMAT_NAME, MANIFEST_NAME

    path = folder / MANIFEST_NAME
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8", "replace")
    except OSError:
        return False
    return re.match(rf'\s*\{{\s*"format"\s*:\s*"{FORMAT_NAME}"', head) is not None


def _has_content(folder: Path) -> bool:
    """Anything but our bookkeeping and empty directories (links count as content)."""
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        if any(here != folder or f not in BOOKKEEPING for f in files):
            return True
        if any((here / d).is_symlink() for d in dirs):
            return True
    return False


def _read_json(path: Path, limit: int = 1 << 24) -> dict[str, Any]:
    """A small regular JSON file as a dict; {} for anything else (FIFOs, links to devices and
    huge files are never read)."""
    try:
        if not path.is_file() or path.stat().st_size > limit:
            return {}
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _printable(text: object) -> str:
    """One line, whatever a file name or a holder file holds (newlines, escapes)."""
    return str(text).encode("unicode_escape").decode("ascii")[:200]


# --------------------------------------------------------------------------- dead writers


def is_temp(name: str) -> bool:
    return _TEMP.fullmatch(name) is not None


def remove_stale_temps(folder: Path) -> list[Path]:
    """Delete the temp files and folders of dead writers under `folder` (call with the lock
    held). Links are never followed; a nested folder claimed on its own is left to its owner."""
    removed: list[Path] = []
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        if here != folder and (here / MARKER).exists():
            dirs[:] = []
            continue
        temps = [name for name in (*dirs, *files) if is_temp(name)]
        dirs[:] = [d for d in dirs if not is_temp(d)]  # never walked into
        for path in [here / name for name in temps]:
            with contextlib.suppress(FileNotFoundError):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
            removed.append(path)
    return removed
