"""Typed schemas of a Wan teacher folder's JSON files: model_index.json and each component's
config (transformer, VAE, text encoder, scheduler), validated strictly (finite, in range, unknown
keys refused) so a bad config is one line naming the file and field, before any weights load.
`teacher.folder` reads the files through these; `placement.plan` checks config dicts with
`validate_config`."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from wandistill.checks.validate import OpenSchema, Schema, check
from wandistill.errors import UsageError


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
    absent = {"default_factory": lambda: [None, None]} if optional else {}
    return Field(**absent, min_length=2, max_length=2, json_schema_extra=extra)


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
