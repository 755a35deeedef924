"""Small statistics shared by the benchmark scripts (no third-party imports)."""

from __future__ import annotations

from typing import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """q-th percentile (0..100) with linear interpolation (numpy's default method);
    None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
