"""Phase 1 of precompute: prompts -> UMT5 embeddings trimmed to their true token count.

Mirrors `WanPipeline._get_t5_prompt_embeds` step for step (same cleaning, tokenisation and
zero-padding rule) so that re-padding a stored embedding gives exactly what the pipeline feeds
its transformer; the test suite holds us to bit-equality with `encode_prompt`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from diffusers.utils.torch_utils import get_module_execution_device


@dataclass(slots=True)
class Encoded:
    embeds: list[torch.Tensor]
    """One [L_i, D] tensor per prompt, L_i = its true token count (eos included)."""
    truncated: list[bool]
    """Whether the prompt had more tokens than max_sequence_length and was cut."""


@torch.no_grad()
def encode_trimmed(
    tokenizer: object,
    text_encoder: torch.nn.Module,
    prompts: list[str],
    *,
    max_sequence_length: int,
    dtype: torch.dtype,
) -> Encoded:
    cleaned = [prompt_clean(p) for p in prompts]
    inputs = tokenizer(  # type: ignore[operator]
        cleaned,
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    full = tokenizer(cleaned, add_special_tokens=True)["input_ids"]  # type: ignore[operator]
    ids, mask = inputs.input_ids, inputs.attention_mask
    seq_lens = mask.gt(0).sum(dim=1).long()
    device = get_module_execution_device(text_encoder)
    hidden = text_encoder(ids.to(device), mask.to(device)).last_hidden_state
    hidden = hidden.to(dtype=dtype, device="cpu")
    return Encoded(
        embeds=[h[:n].clone() for h, n in zip(hidden, seq_lens.tolist(), strict=True)],
        truncated=[len(f) > max_sequence_length for f in full],
    )
