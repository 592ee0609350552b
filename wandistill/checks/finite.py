"""Non-finite numbers never reach a cache, a checkpoint or an exported student.

One NaN in a teacher output silently poisons every student trained on that record; one NaN
optimizer step turns every weight into NaN, and the next checkpoint would keep only that. So:

- precompute checks each teacher tensor where it is made (the text embedding per prompt, the
  teacher output and the next latent per denoising step, each recorded feature) and refuses the
  batch, naming the prompt, its key and the step; the cache writer refuses any record with a
  non-finite tensor as a last line (`refuse_nonfinite_record`), so nothing non-finite is ever
  committed, whoever writes;
- train checks the loss terms and the gradient norm of every step before the optimizer applies
  it (one all-reduce, so every DDP rank stops at the same step), and the weights before every
  checkpoint (so the newest checkpoint is always a good one, and the final student with it).

Every refusal is a `NonFiniteError` (exit 1): one line naming what, where and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from wandistill.errors import WandistillError


class NonFiniteError(WandistillError):
    """A NaN or inf where a number must be finite; nothing non-finite was written."""


def is_finite(t: torch.Tensor) -> bool:
    """One `torch.aminmax` pass, no temporary the size of `t`: a NaN propagates into both the
    min and the max, and an inf is one of them, so both are finite exactly when every element
    is. It runs on every byte the cache writer writes, so speed matters: for an 81-frame Wan
    480p step block (16.8M bf16 values, 2 threads) it took 1.0 ms, against 50.7 ms for the float64
    sum this used before and 35.9 ms for `isfinite(t).all()` (measured 2026-11-23)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return bool(torch.isfinite(t).all())
    lo, hi = torch.aminmax(t.detach())
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def bad_rows(t: torch.Tensor) -> list[int]:
    """Indices along dim 0 whose values are not all finite."""
    if not t.is_floating_point() or t.dim() == 0:
        return [] if is_finite(t) else [0]
    return torch.nonzero(~torch.isfinite(t.reshape(t.shape[0], -1)).all(dim=1)).flatten().tolist()


def _kind(t: torch.Tensor) -> str:
    return "nan" if bool(torch.isnan(t).any()) else "inf"


def check_batch(
    what: str,
    t_B: torch.Tensor,
    prompts: Sequence[tuple[str, str, Any]],
    *,
    step: int | None = None,
    timestep: float | None = None,
) -> None:
    """Refuse a batch whose tensor `t_B` (one row per prompt) holds a NaN or inf.

    `prompts`: (key, prompt text, line) per row, so the error names the prompt to look at."""
    if is_finite(t_B):
        return
    rows = bad_rows(t_B) or [0]
    key, text, line = prompts[rows[0]]
    text = text if len(text) <= 60 else text[:57] + "..."
    where = (
        ""
        if step is None
        else f" at step {step}" + ("" if timestep is None else f" (t={timestep:g})")
    )
    others = f" and {len(rows) - 1} other prompt(s) of the batch" if len(rows) > 1 else ""
    raise NonFiniteError(
        f"{what} is not finite ({_kind(t_B)}){where} for prompt {text!r} (line {line}, "
        f"key {key}){others}: the batch is refused, nothing of it was written",
        fix="try teacher.dtype=bf16 or fp32 (fp16 overflows), a lower sampler.guidance_scale, or "
        "check the teacher weights; committed records are kept, re-run to resume",
    )


def refuse_nonfinite_record(key: str, tensors: dict[str, torch.Tensor], step_fields: Iterable[str]):
    """The cache writer's last line: a record with a NaN / inf tensor is never committed. The
    error names the field (and the recorded-step row of a per-step field)."""
    steps = set(step_fields)
    for name, t in tensors.items():
        if is_finite(t):
            continue
        rows = bad_rows(t) if name in steps or name.startswith("feature.") else []
        row = f" at recorded step {rows[0]}" if rows else ""
        raise NonFiniteError(
            f"record {key}: {name}{row} is not finite ({_kind(t)}); refused, it is not written "
            "to the cache",
            fix="the producer (teacher) made a NaN / inf; committed records are kept",
        )


# --------------------------------------------------------------------------- training


def check_step(
    info: Any,
    step: int,
    terms: dict[str, torch.Tensor | float],
    grad_norm: torch.Tensor,
    last_checkpoint: int,
) -> None:
    """Before step `step` is applied: stop every rank if any rank's loss or gradient is not finite.

    A collective (every rank calls it every step): the ranks agree through one all-reduce, then,
    only on failure, gather what each saw, so every rank raises the same error at the same step
    and none is left waiting in a collective."""
    from wandistill.runtime import dist

    mine = [  # this rank's non-finite loss terms (and gradient norm), as `name=value`
        f"{k if k in ('loss', 'grad_norm') else 'loss_' + k}={float(v):g}"
        for k, v in {**terms, "grad_norm": grad_norm}.items()
        if not math.isfinite(float(v))
    ]
    if not dist.all_reduce_max(info, 1.0 if mine else 0.0):
        return
    seen = dist.all_gather_json(info, mine)
    where = "; ".join(f"rank {r}: {', '.join(p)}" for r, p in enumerate(seen) if p)
    kept = f"checkpoint-{last_checkpoint}" if last_checkpoint else "no checkpoint yet"
    raise NonFiniteError(
        f"non-finite loss at step {step} ({where}): training stopped before applying it; the "
        f"newest checkpoint ({kept}) is kept and no student was exported",
        fix='lower train.optim.lr, keep train.optim.grad_clip on, try mixed_precision="no", or '
        "check the cache (`wandistill cache verify`); then --resume",
    )


def check_weights(info: Any, step: int, named: dict[str, Iterable[torch.Tensor]]) -> None:
    """Before a checkpoint (and so the final student) is written: refuse non-finite weights.

    A collective, so every rank stops together; nothing is written."""
    from wandistill.runtime import dist

    bad = [name for name, tensors in named.items() if not all(is_finite(t) for t in tensors)]
    if not dist.all_reduce_max(info, 1.0 if bad else 0.0):
        return
    seen = sorted({n for view in dist.all_gather_json(info, bad) for n in view})
    raise NonFiniteError(
        f"the {' and '.join(seen)} weights are not finite after step {step}: no checkpoint of "
        "them is written; the newest checkpoint on disk is kept",
        fix="lower train.optim.lr, keep train.optim.grad_clip on; then --resume",
    )
