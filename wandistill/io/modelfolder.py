"""Model folders on disk, read without running anything in them: safetensors weights, no code.

wandistill loads weights from safetensors only (a `.bin` / `.pt` / `.ckpt` is a pickle, and
unpickling runs code) and never runs code shipped in a model folder (no `trust_remote_code`,
ever). This module holds the checks both rooms need; it imports neither diffusers nor the teacher
package, so the student room (`student.init_from_teacher` reads teacher tensors) can use it too:

* `read_safetensors`: one weight file's header, validated (size, JSON, dtypes, shapes, offsets
  inside the file) before any library maps the file;
* `read_weights`: a component's weights as the libraries will load them (`<stem>.safetensors`
  or a sharded `<stem>.safetensors.index.json`), refusing pickle-only folders with the
  conversion to run;
* `code_files` / `refuse_custom_code`: `.py` files anywhere in a folder;
* `load_pretrained`: the one `from_pretrained` call, local files and safetensors only.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from wandistill.checks.validate import (
    MiB,
    OpenSchema,
    Schema,
    check,
    label,
    load_json_file,
    parse_json,
    read_capped,
)
from wandistill.errors import UsageError

SAFETENSORS_BYTES: Mapping[str, int] = {
    **dict.fromkeys(("F64", "I64", "U64", "C64"), 8),
    **dict.fromkeys(("F32", "I32", "U32"), 4),
    **dict.fromkeys(("F16", "BF16", "I16", "U16"), 2),
    **dict.fromkeys(("I8", "U8", "BOOL"), 1),
    **dict.fromkeys(("F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "F8_E5M2FNUZ", "F8_E8M0"), 1),
}
"""Bytes per element of every safetensors dtype code torch can load."""
COMPONENT_CLASSES: Mapping[str, tuple[str, str]] = {
    "text_encoder": ("transformers", "UMT5EncoderModel"),
    "transformer": ("diffusers", "WanTransformer3DModel"),
    "transformer_2": ("diffusers", "WanTransformer3DModel"),
    "vae": ("diffusers", "AutoencoderKLWan"),
}
"""The components of a Wan teacher folder and the (library, class) that loads each. Here, not in
teacher/, because recipe parsing (`wandistill.placement`) needs the names too."""
FLOAT_CODES = frozenset({"F64", "F32", "F16", "BF16"})

MAX_HEADER_BYTES = 100_000_000
"""The safetensors library's own cap on a header."""
UNSAFE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
"""Weight formats that are pickles underneath: never loaded."""
CODE_SUFFIXES = (".py", ".pyc")
_SAMPLE = 64 * 1024
M = TypeVar("M", bound=BaseModel)
_SHARD_NAME = re.compile(r"^[\w.\-]+\.safetensors$")


# --------------------------------------------------------------------------- safetensors files


class TensorInfo(Schema):
    """One tensor entry of a safetensors header."""

    model_config = ConfigDict(frozen=True)

    dtype: Literal[tuple(SAFETENSORS_BYTES)]  # type: ignore[valid-type]
    shape: list[Annotated[int, Field(ge=0)]] = Field(max_length=16)
    data_offsets: list[Annotated[int, Field(ge=0)]] = Field(min_length=2, max_length=2)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * SAFETENSORS_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class SafetensorsFile:
    """A validated safetensors file: its tensors and a cheap identity digest."""

    path: Path
    size: int
    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str]
    digest: str
    """sha256 of header + size + first and last 64 KiB of data: identifies the checkpoint
    without reading gigabytes (see TeacherFolder's fingerprint)."""


def read_safetensors(path: Path, *, what: str = "weight file") -> SafetensorsFile:
    """Read and check one .safetensors file's header; UsageError naming the file otherwise."""
    name = label(what, path)
    fix = f"re-download or re-save {str(path.parent)!r}: the weight file is damaged"
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            prefix = f.read(8)
            hlen = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if hlen < 0 or hlen > MAX_HEADER_BYTES or 8 + hlen > size:
                raise UsageError(
                    f"{name} is not a safetensors file (header length {hlen}, file {size} bytes)",
                    fix=fix,
                )
            header = f.read(hlen)
            h = hashlib.sha256(header)
            h.update(size.to_bytes(8, "little"))
            h.update(f.read(_SAMPLE))
            f.seek(max(8 + hlen, size - _SAMPLE))
            h.update(f.read(_SAMPLE))
    except OSError as e:
        raise UsageError(f"cannot read {name}: {e.strerror or e}", fix=fix) from None
    value = parse_json(header, f"{name} (header)", fix=fix, max_depth=4)
    if not isinstance(value, dict):
        raise UsageError(f"{name}: the header is not a JSON object", fix=fix)
    meta = value.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise UsageError(f"{name}: __metadata__ must map names to strings", fix=fix)
    tensors: dict[str, TensorInfo] = {}
    data_bytes = size - 8 - hlen
    for key, entry in value.items():
        info = check(TensorInfo, entry, f"{name}: tensor {key!r}", fix=fix)
        start, end = info.data_offsets
        if not start <= end <= data_bytes or end - start != info.nbytes:
            raise UsageError(
                f"{name}: tensor {key!r} claims bytes {start}..{end} for {info.nbytes} bytes of "
                f"{info.dtype}{info.shape}, but the file holds {data_bytes} data bytes "
                "(truncated or damaged)",
                fix=fix,
            )
        tensors[key] = info
    return SafetensorsFile(path, size, tensors, meta, h.hexdigest())


# --------------------------------------------------------------------------- reading once


class Reader:
    """Reads each file of a model folder once, within caps: bytes, parsed JSON, safetensors
    headers. TeacherFolder keeps one per `open`, so the fingerprint hashes the very bytes that
    were validated; it also adds a check on every parsed JSON file (`check`)."""

    SMALL_BYTES = 4 * MiB
    """Config files (real Wan configs are a few KiB)."""
    BIG_BYTES = 64 * MiB
    """tokenizer.json (UMT5's is ~16 MiB), index files, text and sentencepiece files."""

    def __init__(self, what: str = "weight file") -> None:
        self.what = what
        self.blobs: dict[Path, bytes] = {}
        self.values: dict[Path, Any] = {}
        self.headers: dict[Path, SafetensorsFile] = {}

    def fix(self, path: Path) -> str:
        return f"re-download or restore {str(path)!r}"

    def cap(self, path: Path) -> int:
        """Config files are small (4 MiB cap); tokenizer.json and index files may be large."""
        big = path.suffix != ".json" or path.name == "tokenizer.json"
        return self.BIG_BYTES if big or path.name.endswith(".index.json") else self.SMALL_BYTES

    def check(self, path: Path, value: Any) -> None:
        """Hook: refuse a parsed JSON value (TeacherFolder: entries that point at code)."""

    def blob(self, path: Path) -> bytes:
        if path not in self.blobs:
            self.blobs[path] = read_capped(
                path, what=self.what, fix=self.fix(path), max_bytes=self.cap(path)
            )
        return self.blobs[path]

    def json(self, path: Path) -> Any:
        if path not in self.values:
            value = parse_json(self.blob(path), label(self.what, path), fix=self.fix(path))
            self.check(path, value)
            self.values[path] = value
        return self.values[path]

    def model(self, path: Path, model: type[M], fix: str | None = None) -> tuple[M, Any]:
        """(typed, parsed) for a JSON file; `fix` defaults to the reader's for that path."""
        value = self.json(path)
        where = label(self.what, path)
        return check(model, value, where, fix=fix or self.fix(path)), value

    def header(self, path: Path) -> SafetensorsFile:
        if path not in self.headers:
            self.headers[path] = read_safetensors(path, what=self.what)
        return self.headers[path]

    def digest(self, path: Path) -> str:
        """The file's identity: safetensors as `SafetensorsFile.digest`, others sha256."""
        if path.suffix == ".safetensors":
            return self.header(path).digest
        return hashlib.sha256(self.blob(path)).hexdigest()


# --------------------------------------------------------------------------- a component's weights


class WeightIndex(OpenSchema):
    """`<stem>.safetensors.index.json` of a sharded checkpoint."""

    model_config = ConfigDict(frozen=True)

    metadata: dict[str, Any] = Field(default_factory=dict)
    weight_map: dict[str, str] = Field(
        min_length=1,
        json_schema_extra={"fix": "re-download the index: it must map every tensor to a shard"},
    )


@dataclass(frozen=True, slots=True)
class Weights:
    """A component's safetensors weights, validated, as `from_pretrained` will load them."""

    folder: Path
    files: tuple[SafetensorsFile, ...]
    index: Path | None
    """The sharded checkpoint's index file, if any."""

    def tensor_files(self) -> dict[str, Path]:
        """Tensor name -> the file that holds it."""
        return {k: f.path for f in self.files for k in f.tensors}

    def tensors(self) -> dict[str, TensorInfo]:
        return {k: v for f in self.files for k, v in f.tensors.items()}

    def numels(self) -> dict[str, tuple[int, str]]:
        """{tensor name: (numel, dtype code)}, what memory planning needs."""
        return {k: (v.numel, v.dtype) for k, v in self.tensors().items()}


def unsafe_files(folder: Path) -> list[Path]:
    """Pickle-based weight files directly in `folder`."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(UNSAFE_SUFFIXES))


def conversion_fix(folder: Path, library: str, class_name: str) -> str:
    """The command that turns a pickle checkpoint into safetensors, to run where it is trusted."""
    return (
        'convert it once, on a machine where you trust the file: python -c "from '
        f"{library} import {class_name} as M; M.from_pretrained('{folder}', use_safetensors="
        f"False).save_pretrained('{folder}', safe_serialization=True)\" (wandistill loads "
        "safetensors only: a .bin/.pt/.ckpt is a pickle and loading it can run code)"
    )


def _own_library(folder: Path) -> tuple[str, str] | None:
    """(library, class) a folder's config.json names, to convert it with its own library."""
    try:
        config, _ = load_json_file(
            folder / "config.json", dict, what="config", fix="", max_bytes=Reader.SMALL_BYTES
        )
    except UsageError:  # unreadable, not JSON, not an object: convert it without a library
        return None
    archs = config.get("architectures")
    if isinstance(config.get("_class_name"), str):
        return "diffusers", config["_class_name"]
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return "transformers", archs[0]
    return None


def require_safetensors(folder: str | Path, what: str, components: tuple[str, ...] = ()) -> None:
    """Refuse `folder` (or its `components` subfolders) holding only pickle-format weights.

    For folders that are not read through `read_weights` (a student folder, a run's export):
    one line naming the pickle file and the conversion in the folder's own library.
    """
    root = Path(folder)
    for sub in [root / c for c in components] or [root]:
        if not sub.is_dir() or any(sub.glob("*.safetensors")) or not (found := unsafe_files(sub)):
            continue
        owner = _own_library(sub)
        fix = (
            conversion_fix(sub, *owner)
            if owner
            else 'convert it once, where you trust the file: python -c "import torch, '
            "safetensors.torch as st; st.save_file(torch.load('<file>', weights_only=True), "
            "'<file stem>.safetensors')\""
        )
        raise unsafe_weights_error(sub, found[0], what, fix)


def unsafe_weights_error(folder: Path, found: Path, what: str, fix: str) -> UsageError:
    """The one message for a folder whose weights are pickles only."""
    return UsageError(
        f"{what} {str(folder)!r} has only pickle-format weights ({found.name}); wandistill "
        "loads safetensors only, since loading a pickle can run code",
        fix=fix,
    )


def read_weights(
    folder: Path,
    stem: str,
    *,
    library: str,
    class_name: str,
    required: bool = True,
    reader: Reader | None = None,
) -> Weights | None:
    """The weights `class_name.from_pretrained(folder, use_safetensors=True)` will load.

    `stem` is the library's file name: `diffusion_pytorch_model` (diffusers) or `model`
    (transformers). A sharded checkpoint's index is validated and every shard it names must exist
    and hold the tensors it is said to hold. Pickle-only folders are refused with the conversion
    command; no weights at all is an error unless `required` is False (configs-only folders).
    `reader`: the caller's, so no file is read twice (default: a fresh one).
    """
    reader = reader or Reader()
    what = reader.what
    single, index = folder / f"{stem}.safetensors", folder / f"{stem}.safetensors.index.json"
    fix = f"re-download {str(folder)!r} (it needs {single.name} or {index.name})"
    header = reader.header
    if index.is_file():
        parsed, _ = reader.model(index, WeightIndex, fix)
        shards = sorted(set(parsed.weight_map.values()))
        bad = [s for s in shards if not _SHARD_NAME.match(s) or not (folder / s).is_file()]
        if bad:
            raise UsageError(
                f"{label(what, index)} names shard {bad[0]!r}, which is not a "
                "safetensors file in that folder",
                fix=fix,
            )
        files = tuple(header(folder / s) for s in shards)
        held = {k: f.path.name for f in files for k in f.tensors}
        wrong = [k for k, s in parsed.weight_map.items() if held.get(k) != s]
        if wrong:
            raise UsageError(
                f"{label(what, index)} maps tensor {wrong[0]!r} to "
                f"{parsed.weight_map[wrong[0]]!r}, which does not hold it",
                fix=fix,
            )
        return Weights(folder, files, index)
    if single.is_file():
        return Weights(folder, (header(single),), None)
    unsafe = unsafe_files(folder) if folder.is_dir() else []
    if unsafe:
        fix = conversion_fix(folder, library, class_name)
        raise unsafe_weights_error(folder, unsafe[0], what, fix)
    if not required:
        return None
    others = sorted(p.name for p in folder.glob("*.safetensors")) if folder.is_dir() else []
    hint = f" (found {', '.join(others[:3])}: variants are not loaded)" if others else ""
    raise UsageError(f"{str(folder)!r} has no {single.name} or {index.name}{hint}", fix=fix)


# --------------------------------------------------------------------------- code


def code_files(root: Path) -> list[str]:
    """Every .py / .pyc file under `root`, relative to it."""
    if not root.is_dir():
        return []
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.suffix in CODE_SUFFIXES)


def custom_code_error(root: Path, found: Iterable[str], what: str) -> UsageError:
    shown = list(found)
    return UsageError(
        f"{what} {str(root)!r} contains custom code ({', '.join(shown[:3])}); wandistill never "
        "runs code from model folders",
        fix="remove the .py files or use an official diffusers Wan folder",
    )


def refuse_custom_code(folder: str | Path, what: str = "student") -> None:
    """Refuse a model folder that ships .py files (teachers are checked by TeacherFolder)."""
    found = code_files(Path(folder))
    if found:
        raise custom_code_error(Path(folder), found, what)


# --------------------------------------------------------------------------- loading


def load_pretrained(cls: Any, path: str | Path, **kwargs: Any) -> Any:
    """`cls.from_pretrained(path)` from local safetensors files only.

    Every weight load of the package goes through here (a test scans the source for others):
    `use_safetensors=True` makes diffusers and transformers refuse pickle checkpoints even
    where a folder holds both formats. Callers turn load failures into their own one line.
    """
    return cls.from_pretrained(str(path), local_files_only=True, use_safetensors=True, **kwargs)


def config_mismatch(
    weights: Weights, library: str, class_name: str, config: Mapping[str, Any]
) -> str | None:
    """Where a config.json and its weights disagree (the first tensor whose shape the config
    does not produce), or None. The model is built from the config on the meta device (no
    memory, no weights read) and its tensor shapes compared with the safetensors headers, so a
    config whose dims do not match its weights is one line before any work, not a ValueError
    deep inside `from_pretrained` after the text encoder already ran."""
    import importlib

    from accelerate import init_empty_weights

    cls = getattr(importlib.import_module(library), class_name)
    raw = {k: v for k, v in config.items() if not str(k).startswith("_")}
    try:
        with init_empty_weights(include_buffers=False):
            if library == "diffusers":
                model = cls.from_config(raw)
            else:
                model = cls._from_config(cls.config_class.from_dict(raw))
    except Exception as e:  # the config itself cannot build the model
        return f"it cannot build a {class_name} ({type(e).__name__}: {str(e)[:160]})"
    on_disk = weights.tensors()
    where = weights.tensor_files()
    for name, t in model.state_dict().items():
        info = on_disk.get(name)
        if info is not None and list(info.shape) != list(t.shape):
            return (
                f"{name} is {info.shape} in {str(where[name])!r}, but the config makes it "
                f"{list(t.shape)}"
            )
    return None


__all__ = [
    "COMPONENT_CLASSES",
    "SAFETENSORS_BYTES",
    "SafetensorsFile",
    "Reader",
    "TensorInfo",
    "Weights",
    "code_files",
    "config_mismatch",
    "conversion_fix",
    "custom_code_error",
    "load_pretrained",
    "read_safetensors",
    "read_weights",
    "refuse_custom_code",
    "require_safetensors",
    "unsafe_files",
]
