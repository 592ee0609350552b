"""What a train step holds, per token and per parameter: the student's sizes and the workload.

Parameter counts are exact and analytic (no model is built: a 14B meta model takes ~20 s to
construct): `StudentSize.from_config` counts a diffusers `WanTransformer3DModel` from its config
(tests compare it with the built module). LoRA adapters are counted the way peft adds them:
`rank x (in + out)` for every `nn.Linear` whose name matches a target (peft's suffix rule).

Activations (`activation_bytes`) are a per-block estimate from the token count
`tokens = latent frames x (latent h / 2) x (latent w / 2)` (Wan's patch 1x2x2), the width `D`
and the FFN width `F`:

* no checkpointing, fp32: `83 D + 5.8 F` bytes per token per block, plus `490 x head_dim`
  bytes per token outside the blocks (patch embedding, RoPE tables, output, loss);
* bf16 autocast: half the per-block term, plus autocast's cache of bf16 copies of the trained
  fp32 weights (2 bytes per trained parameter, counted by the plan beside the activations);
* gradient checkpointing (diffusers' per-block `torch.utils.checkpoint`): each block keeps its
  fp32 input, `4 D` bytes per token, and backward recomputes one block at a time (one block of
  the no-checkpointing term).

Calibrated on this project's CPU (torch 2.13, diffusers 0.42, one thread): peak RSS over one
forward + backward of a random student, width 512 (8 heads x 64), 1,024 tokens, minus its
gradients (`python tests/bench/train_memory.py --calibrate`; MiB):

    blocks  ffn   ckpt   bf16   measured  formula
         2  2048  no     no       139.4    136.8
         4  2048  no     no       256.2    243.0
         8  2048  no     no       483.1    455.4
         4  4096  no     no       310.8    289.4
         4  2048  no     yes      170.8    173.4
         8  2048  no     yes      334.5    311.7
         2  2048  yes    no       134.0     87.7
         8  2048  yes    no       255.6     99.7

Without checkpointing the formula is within 7% (under). With checkpointing the CPU's RSS grows
by ~20 D bytes per block instead of 4 D: glibc keeps the backward's freed per-block tensors
resident, where CUDA's caching allocator reuses them; the plan keeps the 4 D figure (what
checkpointing holds) and the CPU figure is the one to revisit with a GPU measurement.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_LORA_TARGETS",
    "StudentSize",
    "TrainShape",
    "activation_bytes",
    "linear_shapes",
]

#: The linears diffusers' Wan LoRAs target (attention q/k/v/out of both attentions, the FFN).
DEFAULT_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")

#: Calibrated constants (module docstring): bytes per token per block, per unit of D and F.
ACT_D, ACT_F = 83.0, 5.8
ACT_OUTSIDE_PER_HEAD_DIM = 490.0
CKPT_D = 4.0
BF16_ACT_RATIO = 0.5


def _dims(config: Mapping[str, Any]) -> tuple[int, int, int]:
    """(width D, ffn F, head_dim) of a Wan transformer config."""
    head_dim = int(config["attention_head_dim"])
    return int(config["num_attention_heads"]) * head_dim, int(config["ffn_dim"]), head_dim


def linear_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """Every nn.Linear of one block and of the model outside the blocks: name -> (in, out).

    Block names are relative ("attn1.to_q"); the others are full ("proj_out")."""
    d, f, _ = _dims(config)
    shapes: dict[str, tuple[int, int]] = {}
    for attn in ("attn1", "attn2"):
        for proj in ("to_q", "to_k", "to_v", "to_out.0"):
            shapes[f"{attn}.{proj}"] = (d, d)
    added = config.get("added_kv_proj_dim")
    if added:
        shapes["attn2.add_k_proj"] = (int(added), d)
        shapes["attn2.add_v_proj"] = (int(added), d)
    shapes["ffn.net.0.proj"] = (d, f)
    shapes["ffn.net.2"] = (f, d)
    return shapes


def _outside_params(config: Mapping[str, Any]) -> int:
    """Parameters outside the blocks: patch embedding, condition embedder, output head."""
    d, _, _ = _dims(config)
    patch = math.prod(config.get("patch_size") or (1, 2, 2))
    cin = int(config.get("in_channels", 16))
    cout = int(config.get("out_channels") or cin)
    freq, text = int(config.get("freq_dim", 256)), int(config.get("text_dim", 4096))
    n = cin * d * patch + d  # patch_embedding (Conv3d)
    n += freq * d + d + d * d + d  # time_embedder
    n += d * 6 * d + 6 * d  # time_proj
    n += text * d + d + d * d + d  # text_embedder
    image = config.get("image_dim")
    if image:  # image_embedder: norm1, ff (image -> image), norm2; FP32LayerNorms with affine
        n += 2 * image + image * image + image + image * d + d + 2 * d
    n += d * cout * patch + cout * patch  # proj_out
    return n + 2 * d  # scale_shift_table


def _largest_param(config: Mapping[str, Any]) -> int:
    """Elements of the student's largest tensor: a block linear's weight, the text embedder's
    first linear (text_dim x D), the time projection (6D x D) or the patch embedding's kernel."""
    d, _, _ = _dims(config)
    patch = math.prod(config.get("patch_size") or (1, 2, 2))
    cin = int(config.get("in_channels", 16))
    text = int(config.get("text_dim", 4096))
    image = int(config.get("image_dim") or 0)
    linears = [i * o for i, o in linear_shapes(config).values()]
    return max(*linears, text * d, 6 * d * d, cin * d * patch, image * image, image * d)


def _block_params(config: Mapping[str, Any]) -> int:
    d, f, _ = _dims(config)
    n = sum(i * o + o for i, o in linear_shapes(config).values())
    n += 4 * d  # RMSNorm q/k of both attentions (across heads: width D)
    n += 2 * d if config.get("cross_attn_norm", True) else 0  # norm2 (affine)
    if config.get("added_kv_proj_dim"):
        n += d  # norm_added_k
    return n + 6 * d  # scale_shift_table


def _matches(name: str, targets: Sequence[str]) -> bool:
    """peft's rule for a list of target names: the full name, or a suffix after a dot."""
    return any(name == t or name.endswith(f".{t}") for t in targets)


@dataclass(frozen=True, slots=True)
class StudentSize:
    """Parameter counts of one student (one expert), exact for a Wan transformer config."""

    params: int
    """Every parameter of the student (for a LoRA student: the frozen base)."""
    block_params: int
    """One transformer block (what FSDP gathers at a time)."""
    num_blocks: int
    width: int
    ffn_dim: int
    head_dim: int
    adapter_params: int = 0
    """LoRA adapter parameters (0: a full student, every parameter trained)."""
    lora_rank: int = 0
    largest_param: int = 0
    """Elements of the largest tensor (a checkpoint file holds at least that tensor's shard)."""

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], *, lora_rank: int = 0, targets: Sequence[str] = ()
    ) -> StudentSize:
        d, f, head = _dims(config)
        layers = int(config["num_layers"])
        block = _block_params(config)
        adapter = 0
        if lora_rank > 0:
            wanted = tuple(targets) or DEFAULT_LORA_TARGETS
            per_block = sum(
                lora_rank * (i + o)
                for name, (i, o) in linear_shapes(config).items()
                if _matches(f"blocks.0.{name}", wanted)
            )
            adapter = per_block * layers
        return cls(
            params=_outside_params(config) + layers * block,
            block_params=block,
            num_blocks=layers,
            width=d,
            ffn_dim=f,
            head_dim=head,
            adapter_params=adapter,
            lora_rank=lora_rank,
            largest_param=_largest_param(config),
        )

    @property
    def trainable(self) -> int:
        """What gets gradients, optimizer states and an EMA: the adapter, or everything."""
        return self.adapter_params if self.lora_rank > 0 else self.params

    def describe(self) -> str:
        what = f"{self.params / 1e9:.2f}B params, {self.num_blocks} blocks x width {self.width}"
        if self.lora_rank:
            what += f", LoRA rank {self.lora_rank}: {self.adapter_params / 1e6:.1f}M trained"
        return what


@dataclass(frozen=True, slots=True)
class TrainShape:
    """One micro-batch as the student sees it: latent frames x height x width, text tokens."""

    latent_frames: int
    latent_height: int
    latent_width: int
    text_tokens: int = 512
    batch_size: int = 1
    source: str = "recipe"
    """Where the sizes came from: "cache manifest" or "recipe (precompute.sampler)"."""

    @classmethod
    def from_video(
        cls, *, num_frames: int, height: int, width: int, text_tokens: int = 512, **kw: Any
    ) -> TrainShape:
        """Pixel sizes through Wan's VAE (4x in time, 8x in space)."""
        return cls((num_frames - 1) // 4 + 1, height // 8, width // 8, text_tokens, **kw)

    def tokens(self, patch: Sequence[int] = (1, 2, 2)) -> int:
        t, h, w = patch
        return (
            math.ceil(self.latent_frames / t) * (self.latent_height // h) * (self.latent_width // w)
        )

    def describe(self) -> str:
        return (
            f"latents {self.latent_frames}x{self.latent_height}x{self.latent_width} "
            f"({self.tokens():,} tokens), batch {self.batch_size}"
            + f", text {self.text_tokens}; from the {self.source}"
        )


def activation_bytes(
    size: StudentSize, shape: TrainShape, *, bf16: bool, checkpointing: bool
) -> int:
    """Activation memory of one forward + backward of a micro-batch (module docstring)."""
    tokens = shape.batch_size * shape.tokens()
    block = tokens * (ACT_D * size.width + ACT_F * size.ffn_dim)
    if bf16:
        block *= BF16_ACT_RATIO
    outside = tokens * ACT_OUTSIDE_PER_HEAD_DIM * size.head_dim
    if checkpointing:
        kept = size.num_blocks * tokens * CKPT_D * size.width
        return int(kept + block + outside)
    return int(size.num_blocks * block + outside)
