"""Equivalent teacher steps: where the student's error sits on the teacher's own error curve.

R_K says whether the student beats the teacher at K steps; it does not say by how much in the
currency a user pays in, steps. With `--teacher`, eval samples the teacher at several step counts
from the same cached noise and prompts, scores each against the cached N-step final latent, and
places a student's MSE on that curve: "student@4 ~ teacher@6.4" means the student's 4 steps land
as close to teacher@N as 6.4 teacher steps would (interpolated). Outside the curve it says
"< teacher@2" (worse than the fewest steps measured) or "> teacher@N" (better than the most).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EVERY_STEP_UP_TO = 16
"""N at or below this: the curve has every step count 2..N (the teacher runs sum(2..N) steps a
record, 135 at N = 16). Above it, a geometric subset (`curve_steps`)."""


def curve_steps(n: int) -> list[int]:
    """The teacher's step counts on the curve: every one of 2..N when N <= 16, else 2, 3, 4, 6,
    8, 12, 16, 24, 32, ... (each power of two and 1.5 times it) below N, and N itself: the
    teacher's cost stays about 3N steps a record while the curve keeps a point per half-octave,
    which is as finely as an MSE that falls roughly geometrically with steps needs."""
    if n < 2:
        return []
    if n <= EVERY_STEP_UP_TO:
        return list(range(2, n + 1))
    points: set[int] = set()
    s = 2
    while s < n:
        points.update(p for p in (s, s * 3 // 2) if p < n)
        s *= 2
    return sorted(points | {n})


@dataclass(frozen=True, slots=True)
class StepEquivalent:
    """A student's MSE placed on the teacher's curve."""

    steps: float | None
    """Interpolated teacher steps; None outside the curve."""
    text: str
    """'teacher@6.4', '< teacher@2' or '> teacher@16'."""


def place(curve: dict[int, float], mse: float) -> StepEquivalent | None:
    """The teacher step count whose MSE equals `mse`, interpolated between the two measured
    points around it, linear in log MSE (the error falls roughly geometrically with steps; linear
    in MSE where a point is exactly 0, as the re-sampled teacher@N can be). A curve that is not
    monotone is read at its first crossing from the fewest steps. None without a curve."""
    if not curve:
        return None
    steps = sorted(curve)
    first, last = steps[0], steps[-1]
    if mse > curve[first]:
        return StepEquivalent(None, f"< teacher@{first}")
    for lo, hi in zip(steps, steps[1:], strict=False):
        a, b = curve[lo], curve[hi]
        if b <= mse <= a:
            if a == b:
                frac = 0.0
            elif min(a, b, mse) > 0:
                frac = (math.log(a) - math.log(mse)) / (math.log(a) - math.log(b))
            else:
                frac = (a - mse) / (a - b)
            value = lo + frac * (hi - lo)
            return StepEquivalent(value, f"teacher@{value:.1f}".replace(".0", ""))
    if mse == curve[first]:
        return StepEquivalent(float(first), f"teacher@{first}")
    return StepEquivalent(None, f"> teacher@{last}")
