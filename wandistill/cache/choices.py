"""What a recipe may choose about a cache, as plain values: checked by `wandistill.config`
when a recipe is parsed, with no tensor library loaded (`encoding` and `multi` use them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from wandistill.errors import ConfigError

FP8 = "float8_e4m3fn"
STORE_DTYPES: dict[str, str | None] = {
    "model": None,
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp8": FP8,
}
"""Recipe name -> stored dtype (`model`: as computed, no conversion)."""
TRAJECTORY = ("xt", "teacher_out", "final_latent", "features")
"""Fields whose stored dtype the recipe chooses (`features`: every `feature.<name>`)."""
COMPRESSIONS = ("none", "zstd")
ZARR_ONLY = (
    "needs cache.backend = 'zarr' (a webdataset record is read by byte range, one recorded step "
    "at a time, which a compressed member would defeat)"
)
"""Why compression is refused for webdataset (the recipe check and the writer say the same)."""


def check_weights(weights: Sequence[Any], caches: int) -> list[float]:
    """`train.cache_weights` as floats: empty (no weighting) or one positive number a cache."""
    if not weights:
        return []
    if len(weights) != caches:
        raise ConfigError(
            f"train.cache_weights has {len(weights)} weights for {caches} caches",
            fix="give one weight per --cache, in the same order, or none",
        )
    for i, w in enumerate(weights):
        ok = isinstance(w, int | float) and not isinstance(w, bool)
        if not ok or not math.isfinite(w) or w <= 0:
            raise ConfigError(
                f"train.cache_weights[{i}]={w!r} is not a positive number",
                fix="give each cache a weight > 0 (its share of each epoch's samples), e.g. "
                "--set 'train.cache_weights=[2, 1]'",
            )
    return [float(w) for w in weights]
