"""Small statistics shared across apps (pure Python)."""

from __future__ import annotations

import math


def wilson(successes: float, total: float, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95 % by default); (0, 1) when nothing was
    seen. Counts may be fractional (pseudo-counts of a prior)."""
    if total <= 0:
        return 0.0, 1.0
    p = successes / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return max(0.0, centre - half), min(1.0, centre + half)
