"""GEARBX percentile calibration of the entropy thresholds (sections 4.1, 4.2, 16.2).

For sorted entropy samples ``e_1..e_n`` (n >= 5)::

    theta_low  = max(e[floor(n p_low) - 1], 0.01)
    theta_high = e[min(n - 1, floor(n p_high))]

with p_low = 0.30, p_high = 0.60; a band narrower than ``min_band`` (0.2 bits) is widened around
its centre; the PyTorch backend then caps the thresholds at ``0.06 log2 V`` (low) and
``0.12 log2 V`` (high).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MIN_SAMPLES = 5


def percentile_thresholds(
    entropies: Sequence[float],
    vocab_size: int,
    *,
    p_low: float = 0.30,
    p_high: float = 0.60,
    min_band: float = 0.2,
    cap_low: float | None = 0.06,
    cap_high: float | None = 0.12,
) -> tuple[float, float]:
    """``(theta_low, theta_high)`` in bits from prefill entropies."""
    e = sorted(float(x) for x in entropies if x > 0 and math.isfinite(x))
    n = len(e)
    if n < MIN_SAMPLES:
        raise ValueError(f"calibration needs at least {MIN_SAMPLES} positive entropies, got {n}")
    low = max(e[max(int(n * p_low) - 1, 0)], 0.01)
    high = e[min(n - 1, int(n * p_high))]
    if high - low < min_band:
        centre = (low + high) / 2
        low, high = max(centre - min_band / 2, 0.01), centre + min_band / 2
    log_v = math.log2(vocab_size)
    if cap_low is not None:
        low = min(low, cap_low * log_v)
    if cap_high is not None:
        high = min(high, cap_high * log_v)
    if high <= low:  # the caps can cross a wide calibrated band; keep the order
        high = low + min_band
    return low, high
