"""The order engines are timed in, and what is reported over the rounds.

On a shared 2-core machine the speed of one engine drifts by tens of percent over minutes
(other processes, frequency, caches). Timing the engines in ABBA order (stock, configs...,
then reversed) puts every pair of engines equally often first and last, so a linear drift
cancels in their ratio; the ratio is taken per round (the two figures measured closest in
time) and reported as the median over rounds with its spread.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def abba_order(n_engines: int, round_index: int) -> list[int]:
    """Engine indices in the order round ``round_index`` (0-based) times them: 0..n-1 in even
    rounds, reversed in odd ones (rounds 0 and 1 together are one ABBA block)."""
    order = list(range(n_engines))
    return order[::-1] if round_index % 2 == 1 else order


def abba_schedule(n_engines: int, rounds: int) -> list[list[int]]:
    """Every round's order (see ``abba_order``)."""
    return [abba_order(n_engines, r) for r in range(rounds)]


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default 'linear' method)."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles and range of per-round values (all equal for one round)."""
    if not values:
        raise ValueError("spread of no values")
    v = sorted(values)
    return {
        "median": statistics.median(v),
        "q1": _quantile(v, 0.25),
        "q3": _quantile(v, 0.75),
        "min": v[0],
        "max": v[-1],
        "n": len(v),
    }


def ratios_per_round(run: Sequence[float], reference: Sequence[float]) -> list[float]:
    """``run[r] / reference[r]`` for every round measured by both."""
    if len(run) != len(reference):
        raise ValueError(f"rounds differ: {len(run)} against {len(reference)}")
    return [a / b for a, b in zip(run, reference, strict=True)]
