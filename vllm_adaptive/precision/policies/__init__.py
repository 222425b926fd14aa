"""Gear policies: one file per paper. ``build_policy`` turns the config into one."""

from __future__ import annotations

from typing import Any

from vllm_adaptive.precision.policies.base import GearPolicy, RequestGearState
from vllm_adaptive.precision.policies.fixed import FixedGear
from vllm_adaptive.precision.policies.gearbx import GearbxMonitor, GearbxSettings
from vllm_adaptive.precision.policies.quicksilver import QuickSilverSettings, QuickSilverTiers

__all__ = [
    "FixedGear",
    "GearPolicy",
    "GearbxMonitor",
    "GearbxSettings",
    "QuickSilverSettings",
    "QuickSilverTiers",
    "RequestGearState",
    "build_policy",
]


def build_policy(precision: Any, vocab_size: int) -> GearPolicy:
    """The policy named by a ``PrecisionConfig``."""
    if precision.policy == "fixed":
        return FixedGear(vocab_size)
    if precision.policy == "gearbx":
        return GearbxMonitor(vocab_size, precision.gearbx)
    if precision.policy == "quicksilver":
        return QuickSilverTiers(vocab_size, precision.quicksilver)
    raise ValueError(f"unknown precision policy {precision.policy!r}")
