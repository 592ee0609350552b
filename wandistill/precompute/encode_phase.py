"""Phase 1 of precompute: this rank's prompts -> text embeddings, straight to the embedding store.

Embeddings are never gathered in memory: each batch is encoded and handed to the `EmbedStore`
(wandistill/cache/embeds.py), which commits a shard every `cache.shard_records` prompts, so the
phase holds one shard of embeddings at most, a kill keeps every committed shard, and a resume
encodes only what no committed shard holds (the text encoder is not even loaded when nothing is
missing). Batches are the global batches of the denoise phase, so a prompt is always encoded in
the same company (same bits, whatever the world size or the resume point). A prompt's own
negative prompts are encoded with its batch; the recipe's negative prompt alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from wandistill.cache.embeds import EmbedStore, negative_name, own_negative_name
from wandistill.checks.finite import check_batch
from wandistill.precompute.prompts import Prompt
from wandistill.runtime import faults
from wandistill.runtime.progress import Progress
from wandistill.teacher.folder import TeacherFolder


@dataclass(slots=True)
class EncodeJob:
    """What the encode phase needs from the run: no config object."""

    teacher: TeacherFolder
    prompts: Sequence[Prompt]
    keys: Sequence[str]
    batches: Sequence[Sequence[int]]
    """This rank's batches still to denoise (indices into prompts)."""
    negative_prompt: str
    max_sequence_length: int
    dtype: torch.dtype
    load_kw: dict[str, Any]
    rank: int = 0
    show_progress: bool = True


class TextEncoder:
    """The tokenizer and text encoder, loaded on first use (a resume that finds every embedding
    in the store never loads them) and freed by `close()` before the denoiser is loaded."""

    def __init__(self, job: EncodeJob, interruptible: Callable[[], Any]) -> None:
        self.job = job
        self.interruptible = interruptible
        self._loaded: tuple[Any, torch.nn.Module] | None = None

    def encode(self, texts: list[str]) -> Any:
        from wandistill.placement import load as pl
        from wandistill.teacher.encode import encode_trimmed

        with self.interruptible():  # nothing is written while loading or encoding
            if self._loaded is None:
                tok = self.job.teacher.load_tokenizer()
                model = pl.load_component(self.job.teacher, "text_encoder", **self.job.load_kw)
                self._loaded = (tok, model)
            tok, model = self._loaded
            with pl.oom_guard_for(model):
                return encode_trimmed(
                    tok,
                    model,
                    texts,
                    max_sequence_length=self.job.max_sequence_length,
                    dtype=self.job.dtype,
                )

    def close(self) -> None:
        if self._loaded is not None:
            from wandistill.placement import load as pl

            pl.unload(self._loaded[1])
            self._loaded = None


def recipe_negative(job: EncodeJob, store: EmbedStore, encoder: TextEncoder) -> torch.Tensor:
    """The recipe's negative-prompt embedding: from the store, else encoded alone and buffered
    (committed with the first shard, after the cache itself exists)."""
    name = negative_name(job.negative_prompt)
    if not store.has(name):
        neg = encoder.encode([job.negative_prompt]).embeds[0]
        who = [("negative", job.negative_prompt, "recipe sampler.negative_prompt")]
        check_batch("the text embedding", neg[None], who)
        store.add(name, neg)
    return store.get(name)


def missing_batches(job: EncodeJob, store: EmbedStore) -> list[Sequence[int]]:
    """Batches with any embedding (a prompt's, or its own negative's) not in the store."""

    def complete(i: int) -> bool:
        own = job.prompts[i].negative_prompt is not None
        key = job.keys[i]
        return store.has(key) and (not own or store.has(own_negative_name(key)))

    return [b for b in job.batches if not all(complete(i) for i in b)]


def encode_phase(
    job: EncodeJob, store: EmbedStore, encoder: TextEncoder, check_stop: Callable[[], None]
) -> int:
    """Encode every batch the store lacks, committing shards as they fill; returns the number of
    prompts encoded. `check_stop()` raises if a stop was asked (called between batches); on any
    error the complete embeddings already made are committed first."""
    todo = missing_batches(job, store)
    total = sum(len(b) for b in job.batches)
    done = total - sum(len(b) for b in todo)  # encoded by an earlier run: not in the rate
    with Progress(
        total=total, description="encode", enabled=job.show_progress, unit="prompts", initial=done
    ) as bar:
        try:
            for batch in todo:
                _encode_batch(job, store, encoder, batch)
                bar.advance(len(batch))
                if store.full():
                    store.flush()
                check_stop()
            store.flush()
        except BaseException:
            with contextlib.suppress(Exception):  # keep every complete embedding already made
                store.flush()
            raise
    return store.encoded


def _encode_batch(
    job: EncodeJob, store: EmbedStore, encoder: TextEncoder, batch: Sequence[int]
) -> None:
    """One global batch: its prompts together, then its distinct own negatives together."""
    prompts = [job.prompts[i] for i in batch]
    own = sorted({p.negative_prompt for p in prompts if p.negative_prompt is not None})
    enc = encoder.encode([p.text for p in prompts])
    neg = encoder.encode(own) if own else None
    for i, p, e in zip(batch, prompts, enc.embeds, strict=True):
        check_batch("the text embedding", e[None], [(job.keys[i], p.text, p.line)])
    negs = dict(zip(own, neg.embeds, strict=True)) if neg is not None else {}
    for text, e in negs.items():
        first = next(i for i, p in zip(batch, prompts, strict=True) if p.negative_prompt == text)
        who = [(job.keys[first], job.prompts[first].text, job.prompts[first].line)]
        check_batch("the embedding of its own negative prompt", e[None], who)
    for i, p, e, cut in zip(batch, prompts, enc.embeds, enc.truncated, strict=True):
        store.add(job.keys[i], e, truncated=cut)
        if p.negative_prompt is not None:
            store.add(own_negative_name(job.keys[i]), negs[p.negative_prompt])
        store.encoded += 1
        faults.at("precompute", "encoded", store.encoded, job.rank)
