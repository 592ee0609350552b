"""A Wan teacher folder, read once into typed objects: `TeacherFolder.open(path)`.

Everything wandistill knows of a teacher before loading weights comes from here: the pipeline
index, each component's config (typed, validated), the tokenizer files, the scheduler, the
safetensors headers, the fingerprint, the Wan 2.2 experts and boundary, the latent shape. No
other module opens the folder's files; they take a `TeacherFolder` (precompute, plan, placement,
eval, sample). The published config folders (`plan --config`) open the same way with
`TeacherFolder.published(name)`.

`open` reads every file the libraries will later read and refuses, with one line naming the file,
the field and the fix, anything wandistill would not run: custom code (.py files, classes from
libraries other than diffusers/transformers, `auto_map` entries), pickle-only weights, invalid or
oversized or absurdly nested JSON, wrong types, out-of-range or non-finite numbers, missing
components or tokenizer files, an unknown scheduler class, damaged safetensors headers.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wandistill.checks.validate import check, label
from wandistill.errors import UsageError
from wandistill.io.modelfolder import (
    COMPONENT_CLASSES,
    Reader,
    Weights,
    code_files,
    config_mismatch,
    custom_code_error,
    read_weights,
)
from wandistill.teacher.schema import (
    CONFIG_MODELS,
    ModelIndex,
    SchedulerConfig,
    VaeConfig,
    _fix,
)

__all__ = [
    "COMPONENT_CLASSES",
    "CONFIG_NAMES",
    "Component",
    "TeacherFolder",
    "config_folder",
]

WEIGHT_STEMS = {"diffusers": "diffusion_pytorch_model", "transformers": "model"}
CODE_LIBRARIES = ("diffusers", "transformers")
"""The only libraries whose classes a model folder's model_index.json may name."""
CODE_KEYS = ("auto_map", "_auto_map", "custom_pipeline")
"""Config keys that point at code shipped with the model (transformers/diffusers remote code)."""

#: Committed meta configs (`wandistill/teacher/configs/<name>/`), mirroring the Hub folders.
CONFIG_NAMES = ("wan2.1-1.3b", "wan2.1-14b", "wan2.2-a14b")
CONFIGS_DIR = Path(__file__).parent / "configs"

WHAT = "teacher file"
FOLDER_FIX = "pass a local diffusers Wan folder (e.g. from `wandistill teacher make-tiny`)"
_CONFIG_SUFFIXES = (".json", ".txt", ".model")


# --------------------------------------------------------------------------- reading files


class _Files(Reader):
    """The teacher's reader: every file read once; teacher fixes; JSON naming code refused."""

    def __init__(self, root: Path) -> None:
        super().__init__(WHAT)
        self.root = root

    def rel(self, path: Path) -> str:
        return str(path.relative_to(self.root))

    def fix(self, path: Path) -> str:
        return _fix(self.rel(path))

    def check(self, path: Path, value: Any) -> None:
        keys = [k for k in CODE_KEYS if isinstance(value, dict) and k in value]
        if keys:
            raise custom_code_error(self.root, [f"{self.rel(path)}: {keys[0]}"], "teacher")


def _need(path: Path, kind: str = "file") -> Path:
    ok = path.is_file() if kind == "file" else path.is_dir()
    if not ok:
        raise UsageError(
            f"teacher folder is missing {str(path)!r}",
            fix="pass a complete diffusers Wan folder to --teacher",
        )
    return path


# --------------------------------------------------------------------------- the folder


@dataclass(frozen=True, slots=True)
class Component:
    """One model component of the folder: its class, typed config and validated weights."""

    name: str
    library: str
    class_name: str
    path: Path
    config: Any
    """TransformerConfig, VaeConfig or TextEncoderConfig."""
    raw_config: Mapping[str, Any]
    """config.json as written: what the library is given and the cache manifest records."""
    weights: Weights | None
    """None only for configs-only folders (`complete=False`)."""


@dataclass(frozen=True)
class TeacherFolder:
    """A validated Wan teacher folder (see the module docstring). Build with `open`."""

    path: Path
    label: str
    """How plans and errors name it: the folder path, or the published config's name."""
    index: ModelIndex
    components: Mapping[str, Component]
    """text_encoder, transformer, vae and (Wan 2.2 A14B) transformer_2."""
    tokenizer_path: Path | None
    scheduler_config: SchedulerConfig | None
    raw_scheduler_config: Mapping[str, Any] | None
    fingerprint: Mapping[str, Any]
    """{"fingerprint": hex, "components": {name: {file: digest}}, "path": str}: configs, tokenizer
    files and every safetensors header + size + first/last 64 KiB (a 14B teacher is ~60 GB, too
    big to hash; a swapped checkpoint still changes the digest)."""
    flow_shift: float | None = None
    """The recipe's override of the scheduler's flow_shift (None: the folder's)."""

    # ------------------------------------------------------------------ construction

    @classmethod
    def open(
        cls, path: str | Path, *, flow_shift: float | None = None, complete: bool = True
    ) -> TeacherFolder:
        """Read and validate the folder. `complete=False` (planning): weights, tokenizer and
        scheduler may be absent, but whatever is there is still checked."""
        root = Path(path)
        if not str(path) or not root.exists():
            raise UsageError(
                f"teacher folder {str(root)!r} does not exist",
                fix="pass a local diffusers Wan folder with --teacher (nothing is downloaded)",
            )
        if not root.is_dir() or not (root / "model_index.json").is_file():
            raise UsageError(
                f"teacher {str(root)!r} is not a diffusers folder (no model_index.json)",
                fix=FOLDER_FIX,
            )
        files = _Files(root)
        raw_index = _read_index(files)
        where = label(WHAT, root / "model_index.json")
        index = check(ModelIndex, raw_index, where, fix=_fix("model_index.json"))
        components = {
            n: _component(files, n, complete) for n in COMPONENT_CLASSES if index.present(n)
        }
        tokenizer = _tokenizer(files, complete)
        scheduler, raw_scheduler = _scheduler(files, index, complete)
        fingerprint = _fingerprint(files, raw_index)
        if flow_shift is not None and not (math.isfinite(flow_shift) and flow_shift > 0):
            raise UsageError(
                f"flow_shift={flow_shift} must be a positive number",
                fix="set precompute.sampler.flow_shift to e.g. 3.0 (480p) or 5.0 (720p)",
            )
        return cls(
            path=root,
            label=str(root),
            index=index,
            components=components,
            tokenizer_path=tokenizer,
            scheduler_config=scheduler,
            raw_scheduler_config=raw_scheduler,
            fingerprint=fingerprint,
            flow_shift=flow_shift,
        )

    @classmethod
    def published(cls, name: str) -> TeacherFolder:
        """A committed config folder (`wandistill/teacher/configs/<name>`): configs, no weights."""
        return dataclasses.replace(cls.open(config_folder(name), complete=False), label=name)

    @classmethod
    def coerce(cls, folder: TeacherFolder | str | Path, *, complete: bool = True) -> TeacherFolder:
        """`folder` itself, or the folder at that path (or published config name) opened."""
        if isinstance(folder, TeacherFolder):
            return folder
        if str(folder) in CONFIG_NAMES:
            return cls.published(str(folder))
        return cls.open(folder, complete=complete)

    # ------------------------------------------------------------------ components

    def component(self, name: str) -> Component:
        if name not in COMPONENT_CLASSES:
            raise UsageError(
                f"unknown teacher component {name!r}",
                fix=f"use one of {', '.join(COMPONENT_CLASSES)}",
            )
        if name not in self.components:
            raise UsageError(
                f"teacher {self.label!r} has no {name} (model_index.json lists none)",
                fix="pass a Wan 2.2 A14B folder for transformer_2"
                if name == "transformer_2"
                else FOLDER_FIX,
            )
        return self.components[name]

    def config(self, name: str) -> Any:
        """Component `name`'s typed config."""
        return self.component(name).config

    def raw_config(self, name: str) -> dict[str, Any]:
        """Component `name`'s config.json as written (a copy)."""
        return copy.deepcopy(dict(self.component(name).raw_config))

    @property
    def transformer_config(self) -> dict[str, Any]:
        return self.raw_config("transformer")

    def numels(self, name: str) -> dict[str, tuple[int, str]] | None:
        """{tensor: (numel, dtype code)} from the safetensors headers; None without weights."""
        weights = self.component(name).weights
        return weights.numels() if weights is not None else None

    # ------------------------------------------------------------------ sampling facts

    @property
    def boundary_ratio(self) -> float | None:
        """Wan 2.2 A14B: the fraction of num_train_timesteps where transformer_2 takes over.

        None unless the folder has both experts and a boundary (as WanPipeline runs it)."""
        if "transformer_2" in self.components and self.index.boundary_ratio is not None:
            return float(self.index.boundary_ratio)
        return None

    @property
    def experts(self) -> tuple[str, ...]:
        """The denoisers in the order the sampler uses them (high noise first)."""
        return (
            ("transformer", "transformer_2")
            if self.boundary_ratio is not None
            else ("transformer",)
        )

    @property
    def expand_timesteps(self) -> bool:
        return self.index.expand_timesteps

    def latent_shape(self, *, num_frames: int, height: int, width: int) -> tuple[int, ...]:
        """(C, F, H, W) of one latent, as WanPipeline.prepare_latents sizes it."""
        vae: VaeConfig = self.config("vae")
        channels = self.config("transformer").in_channels
        return (
            channels,
            (num_frames - 1) // vae.scale_factor_temporal + 1,
            height // vae.scale_factor_spatial,
            width // vae.scale_factor_spatial,
        )

    def make_scheduler(self, flow_shift: float | None = None) -> Any:
        """A new scheduler from scheduler_config.json, flow_shift overridden if given."""
        if self.scheduler_config is None or self.raw_scheduler_config is None:
            raise UsageError(
                f"teacher {self.label!r} has no scheduler/scheduler_config.json",
                fix="pass a complete diffusers Wan folder to --teacher",
            )
        import diffusers

        cls = getattr(diffusers, self.scheduler_config.class_name)
        overrides = {} if flow_shift is None else {"flow_shift": flow_shift}
        try:
            return cls.from_config(dict(self.raw_scheduler_config), **overrides)
        except (TypeError, ValueError) as e:
            path = self.path / "scheduler" / "scheduler_config.json"
            raise UsageError(
                f"{label(WHAT, path)}: {cls.__name__} refuses it: {e}",
                fix=_fix("scheduler/scheduler_config.json"),
            ) from None

    @functools.cached_property
    def scheduler(self) -> Any:
        """The scheduler this folder samples with (the `flow_shift` override applied); copy it
        before stepping (the sampler does)."""
        return self.make_scheduler(self.flow_shift)

    def load_tokenizer(self) -> Any:
        """The tokenizer, through transformers' AutoTokenizer (local files, no remote code)."""
        from transformers import AutoTokenizer

        if self.tokenizer_path is None:
            raise UsageError(f"teacher {self.label!r} has no tokenizer folder", fix=FOLDER_FIX)
        try:
            return AutoTokenizer.from_pretrained(self.tokenizer_path, local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UsageError(
                f"teacher tokenizer {str(self.tokenizer_path)!r} does not load: {first}",
                fix=_fix("tokenizer/"),
            ) from None


def config_folder(name: str) -> Path:
    """The committed meta-config folder for `name` (one of CONFIG_NAMES)."""
    if name not in CONFIG_NAMES:
        raise UsageError(
            f"--config {name!r} is not a known teacher config",
            fix=f"use one of {', '.join(CONFIG_NAMES)}, or pass --teacher PATH",
        )
    return CONFIGS_DIR / name


# --------------------------------------------------------------------------- open's steps


def _read_index(files: _Files) -> dict[str, Any]:
    """model_index.json parsed; custom code (here or as .py files anywhere) refused first."""
    root = files.root
    found = code_files(root)
    try:
        raw = files.json(root / "model_index.json")
    except UsageError:
        if found:  # code is the bigger problem: name it even if the index is broken too
            raise custom_code_error(root, found, "teacher") from None
        raise
    if isinstance(raw, dict):
        for name, spec in raw.items():
            if isinstance(spec, list) and len(spec) == 2 and spec[0] not in (None, *CODE_LIBRARIES):
                found.append(f"model_index.json: {name} from {spec[0]!r}")
        if isinstance(raw.get("_class_name"), list):
            found.append("model_index.json: a custom pipeline class")
    if found:
        raise custom_code_error(root, found, "teacher")
    if not isinstance(raw, dict):
        raise UsageError(
            f"{label(WHAT, root / 'model_index.json')} is not a JSON object",
            fix=_fix("model_index.json"),
        )
    kind = raw.get("_class_name", "WanPipeline")
    if kind != "WanPipeline":
        raise UsageError(
            f"teacher {str(root)!r} is a {kind}, not a WanPipeline folder",
            fix="pass a Wan 2.1 / 2.2 text-to-video diffusers folder",
        )
    return raw


def _component(files: _Files, name: str, complete: bool) -> Component:
    library, class_name = COMPONENT_CLASSES[name]
    sub = files.root / name
    config, raw = files.model(_need(sub / "config.json"), CONFIG_MODELS[name])
    weights = read_weights(
        sub,
        WEIGHT_STEMS[library],
        library=library,
        class_name=class_name,
        required=complete,
        reader=files,
    )
    if weights is not None:
        mismatch = config_mismatch(weights, library, class_name, raw)
        if mismatch is not None:
            raise UsageError(
                f"teacher file {str(sub / 'config.json')!r} does not match its weights: {mismatch}",
                fix=_fix(f"{name}/config.json"),
            )
    return Component(name, library, class_name, sub, config, raw, weights)


def _tokenizer(files: _Files, complete: bool) -> Path | None:
    """The tokenizer folder, with the files AutoTokenizer needs; its JSON files validated."""
    folder = files.root / "tokenizer"
    if not folder.is_dir():
        if complete:
            _need(folder, "dir")
        return None
    if not any((folder / n).is_file() for n in ("tokenizer.json", "spiece.model")):
        raise UsageError(
            f"teacher tokenizer folder {str(folder)!r} has neither tokenizer.json nor spiece.model",
            fix=_fix("tokenizer/"),
        )
    return folder


def _scheduler(
    files: _Files, index: ModelIndex, complete: bool
) -> tuple[SchedulerConfig | None, dict[str, Any] | None]:
    path = files.root / "scheduler" / "scheduler_config.json"
    if not path.is_file() and not complete:
        return None, None
    typed, raw = files.model(_need(path), SchedulerConfig)
    if typed.class_name != index.scheduler[1]:
        raise UsageError(
            f"{label(WHAT, files.root / 'model_index.json')}: scheduler = "
            f"{index.scheduler[1]!r} but scheduler_config.json holds a {typed.class_name}",
            fix="make the two name the same scheduler class",
        )
    return typed, raw


def _component_files(files: _Files, raw_index: Mapping[str, Any]) -> dict[str, list[Path]]:
    """{component: its config/text/weight files}: every file the fingerprint covers."""
    out: dict[str, list[Path]] = {}
    for name, spec in sorted(raw_index.items()):
        sub = files.root / name
        if name.startswith("_") or not isinstance(spec, list) or not sub.is_dir():
            continue
        out[name] = sorted(
            p
            for p in sub.rglob("*")
            if p.is_file() and (p.suffix == ".safetensors" or p.suffix in _CONFIG_SUFFIXES)
        )
    return out


def _fingerprint(files: _Files, raw_index: Mapping[str, Any]) -> dict[str, Any]:
    """The folder's digest. On the way, every JSON file of every component (tokenizer.json,
    special_tokens_map.json, ...) is parsed: it must be within the caps and name no shipped
    code, even those only a library reads."""
    index = files.root / "model_index.json"
    components = {"model_index": {"model_index.json": files.digest(index)}}
    for name, paths in _component_files(files, raw_index).items():
        sub = files.root / name
        for p in paths:
            if p.suffix == ".json":
                files.json(p)
        components[name] = {str(p.relative_to(sub)): files.digest(p) for p in paths}
    blob = json.dumps(components, sort_keys=True).encode()
    return {
        "fingerprint": hashlib.sha256(blob).hexdigest(),
        "components": components,
        "path": str(files.root.resolve()),
    }
