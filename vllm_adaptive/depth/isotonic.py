"""Isotonic regression by pool-adjacent-violators (numpy only).

Used twice: to make per-layer entropy targets non-increasing in depth, and to map the cheap
feature score to an entropy estimate with a monotone function.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def isotonic_fit(
    y: np.ndarray, weights: np.ndarray | None = None, increasing: bool = True
) -> np.ndarray:
    """Weighted least-squares fit of `y` (in its given order) by a monotone sequence."""
    y = np.asarray(y, dtype=np.float64)
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=np.float64)
    if not increasing:
        return -isotonic_fit(-y, w, increasing=True)
    means: list[float] = []
    wsum: list[float] = []
    counts: list[int] = []
    for yi, wi in zip(y, w, strict=True):
        means.append(float(yi))
        wsum.append(float(wi))
        counts.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            m2, w2, c2 = means.pop(), wsum.pop(), counts.pop()
            w1 = wsum[-1]
            means[-1] = (means[-1] * w1 + m2 * w2) / (w1 + w2)
            wsum[-1] = w1 + w2
            counts[-1] += c2
    return np.repeat(np.asarray(means), counts)


@dataclass
class IsotonicMap:
    """Non-decreasing map x -> y as knots; linear between knots, flat outside."""

    x: np.ndarray
    y: np.ndarray

    @classmethod
    def fit(cls, x: np.ndarray, y: np.ndarray, max_knots: int = 512) -> IsotonicMap:
        order = np.argsort(x, kind="stable")
        xs = np.asarray(x, dtype=np.float64)[order]
        fitted = isotonic_fit(np.asarray(y, dtype=np.float64)[order])
        # keep the two ends of every constant block: an exact step function, interpolated
        change = np.flatnonzero(np.diff(fitted) != 0)
        idx = np.unique(np.concatenate([[0, len(xs) - 1], change, change + 1]))
        if len(idx) > max_knots:
            idx = idx[np.linspace(0, len(idx) - 1, max_knots).round().astype(int)]
        return cls(x=xs[idx], y=fitted[idx])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.interp(np.asarray(x, dtype=np.float64), self.x, self.y)
