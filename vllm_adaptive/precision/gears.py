"""Precisions a gear can name, and the three policy levels that map onto them.

A policy outputs a *level*: 0 (low: cheapest), 1 (mid) or 2 (high: most precise), as GEARBX's
low / mid / high gears. Which precision a level means is configuration: GEARBX uses
(int4, int8, full), QuickSilver (int2, int4, int8); a layer group may map the levels its own way.
"""

from __future__ import annotations

from typing import Literal

Precision = Literal["full", "int8", "int4", "int2"]
PRECISIONS: tuple[str, ...] = ("int2", "int4", "int8", "full")  # cheapest first
BITS: dict[str, int] = {"int8": 8, "int4": 4, "int2": 2}

LEVELS = 3
LOW, MID, HIGH = 0, 1, 2
LEVEL_NAMES = ("low", "mid", "high")

GEARBX_GEARS: tuple[str, str, str] = ("int4", "int8", "full")
QUICKSILVER_GEARS: tuple[str, str, str] = ("int2", "int4", "int8")


def precision_rank(precision: str) -> int:
    """Order of precisions from cheapest (0) to full (3)."""
    return PRECISIONS.index(precision)
