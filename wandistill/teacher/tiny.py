"""A tiny, randomly initialised Wan teacher written in the real diffusers folder layout.

Why this exists: the tests, the CI and the offline demo need a teacher that goes through exactly
the same code path as `Wan-AI/Wan2.1-T2V-1.3B-Diffusers` or `Wan-AI/Wan2.2-T2V-A14B-Diffusers`
(`WanPipeline.from_pretrained(folder)`, per-component `save_pretrained` folders, `model_index.json`,
a T5-style tokenizer, a UMT5 text encoder, a Wan VAE, a UniPC flow scheduler and one or two Wan
transformers), yet must build in seconds on a CPU with no network access: nothing here downloads
weights or tokenizers. The weights are random, so samples are noise-like, but they are finite,
non-trivial and byte-for-byte reproducible from the seed, which is what caches and tests need.

`make_tiny_teacher(path)` writes the Wan 2.1 layout; `make_tiny_teacher(path, wan22=True)` adds
`transformer_2/` and `boundary_ratio` (0.875, as in Wan2.2-T2V-A14B) to make a two-expert teacher.
`TINY_DEFAULTS` holds sampling sizes that suit it (`pipe(prompt, **TINY_DEFAULTS, ...)`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from wandistill.io.fsutil import fsync_dir, fsync_tree
from wandistill.runtime.workarounds import t5_tokenizer_class

__all__ = [
    "BOUNDARY_RATIO",
    "TINY_DEFAULTS",
    "TRANSFORMER_CONFIG",
    "TEXT_ENCODER_CONFIG",
    "VAE_CONFIG",
    "SCHEDULER_CONFIG",
    "build_components",
    "check_target",
    "derived_seed",
    "make_tiny_teacher",
    "NotATeacherError",
    "write_teacher",
]

#: Sampling sizes that suit the tiny teacher: `height`/`width` are multiples of 16 (VAE stride 8
#: times patch 2, as `WanPipeline.check_inputs` demands), `num_frames` is 4k+1 (VAE temporal stride
#: 4), and the prompt is padded to 32 tokens. One step at these sizes takes milliseconds on a CPU.
TINY_DEFAULTS: Mapping[str, int] = MappingProxyType(
    {"height": 32, "width": 32, "num_frames": 1, "max_sequence_length": 32}
)

#: Wan2.2-T2V-A14B's `model_index.json` value: `transformer` (high-noise expert) denoises
#: timesteps >= 0.875 * 1000, `transformer_2` (low-noise expert) the rest.
BOUNDARY_RATIO = 0.875

#: UMT5 encoder: umt5-xxl's non-size settings (gated-gelu, scalable attention, eps 1e-6),
#: shrunk. `vocab_size` must be >= the tokenizer's vocabulary (checked when building).
TEXT_ENCODER_CONFIG: Mapping[str, Any] = MappingProxyType(
    {
        "vocab_size": 256,
        "d_model": 32,
        "d_kv": 8,
        "num_heads": 4,
        "num_layers": 2,
        "num_decoder_layers": 2,
        "d_ff": 64,
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 16,
        "dropout_rate": 0.0,
        "layer_norm_epsilon": 1e-6,
        "feed_forward_proj": "gated-gelu",
        "scalable_attention": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
    }
)

#: Wan VAE as in diffusers' own Wan pipeline tests: 8x spatial, 4x temporal compression, 16 latents.
VAE_CONFIG: Mapping[str, Any] = MappingProxyType(
    {
        "base_dim": 3,
        "z_dim": 16,
        "dim_mult": [1, 1, 1, 1],
        "num_res_blocks": 1,
        "temperal_downsample": [False, True, True],
    }
)

#: Wan DiT as in diffusers' own Wan pipeline tests; `text_dim` equals the text encoder's d_model.
#: `rope_max_seq_len` keeps the real 1024 (the RoPE tables are non-persistent buffers, so it costs
#: nothing on disk) so that any resolution the real teacher accepts also works here.
TRANSFORMER_CONFIG: Mapping[str, Any] = MappingProxyType(
    {
        "patch_size": (1, 2, 2),
        "num_attention_heads": 2,
        "attention_head_dim": 12,
        "in_channels": 16,
        "out_channels": 16,
        "text_dim": TEXT_ENCODER_CONFIG["d_model"],
        "freq_dim": 256,
        "ffn_dim": 32,
        "num_layers": 2,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6,
        "rope_max_seq_len": 1024,
    }
)

#: Mirrors `scheduler/scheduler_config.json` of Wan-AI/Wan2.1-T2V-1.3B-Diffusers (and the Wan 2.2
#: A14B folders): UniPC, flow prediction on flow sigmas, shift 3.0; the rest are UniPC defaults.
SCHEDULER_CONFIG: Mapping[str, Any] = MappingProxyType(
    {
        "num_train_timesteps": 1000,
        "prediction_type": "flow_prediction",
        "use_flow_sigmas": True,
        "flow_shift": 3.0,
        "solver_order": 2,
        "solver_type": "bh2",
        "predict_x0": True,
        "lower_order_final": True,
        "final_sigmas_type": "zero",
        "timestep_spacing": "linspace",
    }
)

# Tokenizer vocabulary: T5 specials first (<pad>=0, </s>=1, <unk>=2), the SentencePiece word
# boundary, common English words as "▁word" pieces, then single printable-ASCII characters so
# any ASCII word still tokenizes; characters outside the vocabulary fall back to <unk>.
_PAD, _EOS, _UNK = "<pad>", "</s>", "<unk>"
_SPACE = "\u2581"
_WORDS: tuple[str, ...] = tuple(
    """
    a an the and or of to in on at by for with from over under near into out up down is are was
    be it its this that these there his her their he she they we you i my your not no very
    cat cats dog dogs bird fish horse cow man woman person people child girl boy face hand eye
    car boat train plane road street city house room door window tree trees flower grass water
    sea ocean river lake beach sky cloud clouds sun moon star night day light rain snow fire
    mountain forest field garden park red green blue yellow white black brown orange gray pink
    big small little old young new happy slowly quickly walking running flying swimming sitting
    standing playing dancing looking camera shot close view video scene background style color
    colors bright dark high quality detailed cinematic realistic photo art painting moving
    """.split()
)
_CHARS: str = string.ascii_letters + string.digits + string.punctuation


def _tokenizer_vocab(extra_words: tuple[str, ...] = ()) -> list[tuple[str, float]]:
    """Unigram pieces with log-probability scores: whole words beat spelling them out."""
    vocab: list[tuple[str, float]] = [(_PAD, 0.0), (_EOS, 0.0), (_UNK, 0.0), (_SPACE, -4.0)]
    words = (*_WORDS, *extra_words)
    vocab += [(f"{_SPACE}{w}", -5.0 - 0.01 * i) for i, w in enumerate(words)]
    vocab += [(c, -8.0) for c in _CHARS]
    pieces = [p for p, _ in vocab]
    if len(set(pieces)) != len(pieces):  # pragma: no cover - guards edits to the word list
        raise AssertionError("duplicate tokenizer pieces")
    return vocab


def _build_tokenizer(extra_words: tuple[str, ...] = ()) -> Any:
    """A T5-style (SentencePiece Unigram) fast tokenizer built offline with `tokenizers`.

    `extra_words` become whole-word pieces after the common English ones (a trained teacher's
    grammar words); the default vocabulary is the random tiny teacher's.

    The backend mirrors what `transformers` builds for T5 (Unigram with unk id 2, whitespace split
    then Metaspace, `$A </s>` post-processing), so reloading `tokenizer.json` through
    `T5TokenizerFast`/`AutoTokenizer` gives the same tokenizer in transformers 4.x and 5.x.
    """
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import Unigram
    from transformers import T5TokenizerFast

    vocab = _tokenizer_vocab(extra_words)
    backend = Tokenizer(Unigram(vocab, unk_id=2, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme="always", split=True),
        ]
    )
    backend.decoder = decoders.Metaspace(replacement=_SPACE, prepend_scheme="always", split=True)
    backend.post_processor = processors.TemplateProcessing(
        single=["$A", _EOS], pair=["$A", _EOS, "$B", _EOS], special_tokens=[(_EOS, 1)]
    )
    return T5TokenizerFast(
        tokenizer_object=backend,
        pad_token=_PAD,
        eos_token=_EOS,
        unk_token=_UNK,
        extra_ids=0,
        additional_special_tokens=[],
        model_max_length=512,
    )


def derived_seed(seed: int, component: str) -> int:
    """A distinct, platform-independent seed per component (same seed -> same weights)."""
    digest = hashlib.sha256(f"wandistill-tiny-teacher:{seed}:{component}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def _variance_preserving_(module: torch.nn.Module) -> None:
    """Redraw every Linear weight from N(0, 1/fan_in), keeping activations near unit scale.

    PyTorch's default (Kaiming-uniform, a=sqrt(5)) shrinks each layer's output by ~1/sqrt(3); in a
    random Wan DiT that leaves the prediction almost independent of the prompt (~1% change) and
    of the timestep. With this init both matter (~20% and ~50% of the output's spread), so the
    tiny teacher behaves like a conditional model in tests, while outputs stay finite and O(1).
    """
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, torch.nn.Linear):
                sub.weight.normal_(0.0, sub.in_features**-0.5)


def build_components(seed: int, wan22: bool, extra_words: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every component of a WanPipeline, each drawn from its own derived seed.

    `extra_words` extend the tokenizer's whole-word pieces (see `_build_tokenizer`).
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = _build_tokenizer(extra_words)
    if len(tokenizer) > TEXT_ENCODER_CONFIG["vocab_size"]:  # pragma: no cover - config guard
        raise AssertionError(
            f"tokenizer has {len(tokenizer)} tokens but the text encoder only "
            f"{TEXT_ENCODER_CONFIG['vocab_size']}"
        )

    def transformer(name: str) -> Any:
        torch.manual_seed(derived_seed(seed, name))
        model = WanTransformer3DModel(**TRANSFORMER_CONFIG)
        _variance_preserving_(model)
        return model.eval()

    # fork_rng: seeding here must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derived_seed(seed, "text_encoder"))
        text_encoder = UMT5EncoderModel(UMT5Config(**TEXT_ENCODER_CONFIG)).eval()
        torch.manual_seed(derived_seed(seed, "vae"))
        vae = AutoencoderKLWan(**VAE_CONFIG).eval()
        transformer_1 = transformer("transformer")
        transformer_2 = transformer("transformer_2") if wan22 else None

    return {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder,
        "vae": vae,
        "scheduler": UniPCMultistepScheduler(**SCHEDULER_CONFIG),
        "transformer": transformer_1,
        "transformer_2": transformer_2,
        "boundary_ratio": BOUNDARY_RATIO if wan22 else None,
    }


class NotATeacherError(FileExistsError):
    """The target exists and is no teacher folder: never replaced, even with overwrite."""


def check_target(path: Path, overwrite: bool) -> None:
    """Refuse to clobber an existing teacher (unless `overwrite`) or anything that is not one."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_dir() and not path.is_symlink():
        if (path / "model_index.json").exists():
            if not overwrite:
                raise FileExistsError(
                    f"{path} already holds a teacher (model_index.json); "
                    "pass overwrite=True to replace it"
                )
            return
        if not any(path.iterdir()):
            return
    raise NotATeacherError(
        f"{path} exists and is not a diffusers teacher folder (no model_index.json); "
        "refusing to replace it"
    )


def _normalise_model_index(folder: Path) -> None:
    """Name the tokenizer `T5TokenizerFast` in model_index.json, as the real Wan folders do
    (`workarounds.t5_tokenizer_class`: transformers 4 and 5 disagree on `T5Tokenizer`)."""
    index_path = folder / "model_index.json"
    fixed = t5_tokenizer_class(json.loads(index_path.read_text(encoding="utf-8")))
    if fixed is not None:
        index_path.write_text(json.dumps(fixed, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def make_tiny_teacher(
    path: str | Path, *, wan22: bool = False, seed: int = 0, overwrite: bool = False
) -> Path:
    """Write a tiny random Wan teacher to `path` and return it; loadable with `WanPipeline`.

    `wan22=True` adds a second expert (`transformer_2/`, same config, other weights) and
    `boundary_ratio=0.875` to model_index.json, like Wan2.2-T2V-A14B. The same `seed` gives
    byte-identical `*.safetensors`. The folder is built in a hidden temp sibling and renamed into
    place, so `path` is either absent or complete. An existing teacher at `path` raises
    `FileExistsError` unless `overwrite=True`; a non-empty folder without model_index.json always
    raises.
    """
    from diffusers import WanPipeline

    path = Path(path).absolute()
    check_target(path, overwrite)
    return write_teacher(path, WanPipeline(**build_components(seed, wan22)), overwrite=overwrite)


def write_teacher(
    path: Path, pipe: Any, *, overwrite: bool, extra_json: Mapping[str, Any] | None = None
) -> Path:
    """`pipe.save_pretrained` into a hidden temp sibling, then rename it onto `path`.

    `extra_json` adds top-level JSON files (name -> object) next to model_index.json. `path` is
    either absent or a complete teacher at every moment; `overwrite` swaps an old teacher out.
    """
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    if tmp.exists():  # an unfinished build by a dead process with our pid: gone, or we stop
        shutil.rmtree(tmp)
    try:
        pipe.save_pretrained(tmp, safe_serialization=True)
        _normalise_model_index(tmp)
        for name, obj in (extra_json or {}).items():
            (tmp / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
        fsync_tree(tmp)

        check_target(path, overwrite)  # again: another writer may have finished meanwhile
        if path.is_dir() and any(path.iterdir()):
            # overwrite: park the old teacher under a unique hidden name, swap, then delete it.
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.replace(path, old)
            try:
                os.replace(tmp, path)
            except BaseException:
                os.replace(old, path)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
