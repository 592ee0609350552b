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
import difflib
import functools
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from wandistill.checks.validate import OpenSchema, Schema, check, label
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

__all__ = [
    "COMPONENT_CLASSES",
    "CONFIG_NAMES",
    "Component",
    "ModelIndex",
    "SchedulerConfig",
    "TeacherFolder",
    "TextEncoderConfig",
    "TransformerConfig",
    "VaeConfig",
    "config_folder",
    "validate_config",
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


def _fix(rel: str) -> str:
    return (
        f"restore {rel} from the Wan diffusers repository the folder came from, or rebuild the "
        "folder (`wandistill teacher make-tiny` for a tiny one)"
    )


# --------------------------------------------------------------------------- typed files

Dim = Annotated[int, Field(gt=0, le=1 << 20)]
"""A width, channel count or vocabulary size: positive, and not absurd (2^20)."""
Count = Annotated[int, Field(gt=0, le=1024)]
"""Layers, heads, blocks."""
Small = Annotated[float, Field(gt=0, lt=1)]
Prob = Annotated[float, Field(ge=0, lt=1)]
_TYPED = ConfigDict(frozen=True, populate_by_name=True)
"""On top of `Schema` (strict, finite floats, unknown keys refused: model_index.json) or
`OpenSchema` (unknown keys kept: the library configs, which hold many more)."""
_REF_FIX = (
    "a WanPipeline folder lists text_encoder [transformers, UMT5EncoderModel], tokenizer, "
    "vae [diffusers, AutoencoderKLWan], scheduler and transformer [diffusers, "
    "WanTransformer3DModel] (Wan 2.2 A14B: transformer_2 too)"
)


def _ref(library: str, classes: str, *, optional: bool = False) -> Any:
    """A model_index.json entry: [library, class], checked against what wandistill loads."""
    extra = {"fix": _REF_FIX, "library": library, "classes": classes}
    if optional:
        return Field(
            default_factory=lambda: [None, None],
            min_length=2,
            max_length=2,
            json_schema_extra=extra,
        )
    return Field(min_length=2, max_length=2, json_schema_extra=extra)


Ref = list[str | None]
_PIPELINE_PARTS = ("text_encoder", "tokenizer", "vae", "scheduler", "transformer", "transformer_2")


class ModelIndex(Schema):
    """model_index.json of a WanPipeline folder."""

    model_config = _TYPED

    class_name: Literal["WanPipeline"] = Field("WanPipeline", alias="_class_name")
    text_encoder: Ref = _ref("transformers", "UMT5EncoderModel")
    tokenizer: Ref = _ref("transformers", r"\w*Tokenizer(Fast)?")
    vae: Ref = _ref("diffusers", "AutoencoderKLWan")
    scheduler: Ref = _ref("diffusers", r"\w+Scheduler")
    transformer: Ref = _ref("diffusers", "WanTransformer3DModel")
    transformer_2: Ref = _ref("diffusers", "WanTransformer3DModel", optional=True)
    boundary_ratio: Small | None = Field(
        None,
        json_schema_extra={"fix": "Wan 2.2 A14B uses 0.875; it must lie strictly between 0 and 1"},
    )
    expand_timesteps: bool = False

    @model_validator(mode="before")
    @classmethod
    def _drop_metadata(cls, value: Any) -> Any:
        """`_diffusers_version`, `_name_or_path`, ...: informational, not checked."""
        if isinstance(value, dict):
            return {k: v for k, v in value.items() if not k.startswith("_") or k == "_class_name"}
        return value

    @field_validator(
        *("text_encoder", "tokenizer", "vae", "scheduler"), "transformer", "transformer_2"
    )
    @classmethod
    def _known_class(cls, ref: Ref, info: Any) -> Ref:
        extra = cls.model_fields[info.field_name].json_schema_extra
        assert isinstance(extra, dict)
        library, classes = extra["library"], extra["classes"]
        if info.field_name == "transformer_2" and ref == [None, None]:
            return ref
        if ref[0] != library or not re.fullmatch(str(classes), str(ref[1])):
            want = f"[{library!r}, {classes!r}]" if "\\" not in str(classes) else library
            raise ValueError(f"wandistill loads this component as {want}")
        return ref

    def present(self, name: str) -> bool:
        return getattr(self, name, [None, None])[0] is not None


class TransformerConfig(OpenSchema):
    """transformer/config.json (and transformer_2): WanTransformer3DModel's arguments, with the
    library's defaults."""

    model_config = _TYPED

    class_name: Literal["WanTransformer3DModel"] = Field(
        "WanTransformer3DModel", alias="_class_name"
    )
    patch_size: list[Annotated[int, Field(gt=0, le=64)]] = Field(
        default_factory=lambda: [1, 2, 2], min_length=3, max_length=3
    )
    num_attention_heads: Count = 40
    attention_head_dim: Dim = 128
    in_channels: Dim = 16
    out_channels: Dim = 16
    text_dim: Dim = 4096
    freq_dim: Dim = 256
    ffn_dim: Dim = 13824
    num_layers: Count = 40
    cross_attn_norm: bool = True
    qk_norm: str | None = "rms_norm_across_heads"
    eps: Small = 1e-6
    image_dim: Dim | None = None
    added_kv_proj_dim: Dim | None = None
    rope_max_seq_len: Dim = 1024
    pos_embed_seq_len: Dim | None = None


class VaeConfig(OpenSchema):
    """vae/config.json: AutoencoderKLWan's arguments, with the library's defaults."""

    model_config = _TYPED

    class_name: Literal["AutoencoderKLWan"] = Field("AutoencoderKLWan", alias="_class_name")
    base_dim: Dim = 96
    decoder_base_dim: Dim | None = None
    z_dim: Dim = 16
    dim_mult: list[Count] = Field(default_factory=lambda: [1, 2, 4, 4], min_length=1, max_length=8)
    num_res_blocks: Count = 2
    attn_scales: list[float] = Field(default_factory=list, max_length=8)
    temperal_downsample: list[bool] = Field(
        default_factory=lambda: [False, True, True], max_length=8
    )
    dropout: Prob = 0.0
    latents_mean: list[float] = Field(default_factory=lambda: [0.0] * 16, max_length=1024)
    latents_std: list[Annotated[float, Field(gt=0)]] = Field(
        default_factory=lambda: [1.0] * 16, max_length=1024
    )
    is_residual: bool = False
    in_channels: Dim = 3
    out_channels: Dim = 3
    patch_size: Annotated[int, Field(gt=0, le=64)] | None = None
    scale_factor_temporal: Annotated[int, Field(gt=0, le=64)] = 4
    scale_factor_spatial: Annotated[int, Field(gt=0, le=64)] = 8

    @model_validator(mode="after")
    def _one_statistic_per_channel(self) -> VaeConfig:
        if not len(self.latents_mean) == len(self.latents_std) == self.z_dim:
            raise ValueError(
                f"latents_mean ({len(self.latents_mean)}) and latents_std "
                f"({len(self.latents_std)}) must have z_dim = {self.z_dim} entries"
            )
        return self


class TextEncoderConfig(OpenSchema):
    """text_encoder/config.json: the UMT5 encoder's config (transformers UMT5Config keys)."""

    model_config = _TYPED

    model_type: Literal["umt5"] = "umt5"
    vocab_size: Dim = 250112
    d_model: Dim = 512
    d_kv: Dim = 64
    d_ff: Dim = 1024
    num_layers: Count = 8
    num_heads: Count = 6
    relative_attention_num_buckets: Count = 32
    relative_attention_max_distance: Dim = 128
    dropout_rate: Prob = 0.1
    layer_norm_epsilon: Small = 1e-6
    initializer_factor: Annotated[float, Field(gt=0, le=1e3)] = 1.0
    feed_forward_proj: str = "gated-gelu"
    tie_word_embeddings: bool = True


class SchedulerConfig(OpenSchema):
    """scheduler/scheduler_config.json: a diffusers scheduler class and its numbers."""

    model_config = _TYPED

    class_name: str = Field(
        alias="_class_name",
        json_schema_extra={"fix": "name a diffusers scheduler (Wan: UniPCMultistepScheduler)"},
    )
    num_train_timesteps: Annotated[int, Field(gt=0, le=1_000_000)] = 1000
    flow_shift: Annotated[float, Field(gt=0, le=1000)] | None = None
    shift: Annotated[float, Field(gt=0, le=1000)] | None = None
    solver_order: Annotated[int, Field(ge=1, le=3)] | None = None

    @field_validator("class_name")
    @classmethod
    def _a_diffusers_scheduler(cls, name: str) -> str:
        import diffusers

        known = sorted(n for n in dir(diffusers) if n.endswith("Scheduler"))
        found = getattr(diffusers, name, None) if name in known else None
        if found is None or not issubclass(found, diffusers.SchedulerMixin):
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"not a diffusers scheduler class{hint}")
        return name


CONFIG_MODELS: Mapping[str, type[BaseModel]] = {
    "text_encoder": TextEncoderConfig,
    "transformer": TransformerConfig,
    "transformer_2": TransformerConfig,
    "vae": VaeConfig,
}


def validate_config(name: str, config: Mapping[str, Any], *, source: str) -> BaseModel:
    """Component `name`'s config dict as its typed model (`source` names it in errors)."""
    if name not in CONFIG_MODELS:
        raise UsageError(
            f"unknown teacher component {name!r}", fix=f"use one of {', '.join(CONFIG_MODELS)}"
        )
    return check(CONFIG_MODELS[name], dict(config), source, fix=_fix(source))


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
        _check_other_json(files, raw_index)
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
            fingerprint=_fingerprint(files, raw_index),
            flow_shift=flow_shift,
        )

    @classmethod
    def published(cls, name: str) -> TeacherFolder:
        """A committed config folder (`wandistill/teacher/configs/<name>`): configs, no weights."""
        return dataclasses.replace(cls.open(config_folder(name), complete=False), label=name)

    @classmethod
    def coerce(cls, folder: TeacherFolder | str | Path) -> TeacherFolder:
        """`folder` itself, or the folder at that path (or published config name) opened."""
        if isinstance(folder, TeacherFolder):
            return folder
        if str(folder) in CONFIG_NAMES:
            return cls.published(str(folder))
        return cls.open(folder)

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

    @property
    def vae_config(self) -> dict[str, Any]:
        return self.raw_config("vae")

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


def _check_other_json(files: _Files, raw_index: Mapping[str, Any]) -> None:
    """Every JSON file of every component (tokenizer.json, special_tokens_map.json, ...) parses
    within the caps and names no shipped code, even those only a library reads."""
    for paths in _component_files(files, raw_index).values():
        for p in paths:
            if p.suffix == ".json":
                files.json(p)


def _fingerprint(files: _Files, raw_index: Mapping[str, Any]) -> dict[str, Any]:
    index = files.root / "model_index.json"
    components = {"model_index": {"model_index.json": files.digest(index)}}
    for name, paths in _component_files(files, raw_index).items():
        sub = files.root / name
        components[name] = {str(p.relative_to(sub)): files.digest(p) for p in paths}
    blob = json.dumps(components, sort_keys=True).encode()
    return {
        "fingerprint": hashlib.sha256(blob).hexdigest(),
        "components": components,
        "path": str(files.root.resolve()),
    }
