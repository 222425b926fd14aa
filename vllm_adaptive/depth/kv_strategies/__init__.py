"""KV strategies: what happens to the K/V of the layers an exited token skipped.

One class per `adaptive.depth.kv_strategy` value, all implementing `KvStrategy` (`base.py`,
which lists the hooks the depth runtime calls); `build_kv_strategy` makes the configured one.
See docs/kv-strategies.md for what each does.
"""

from __future__ import annotations

from typing import Any

from vllm_adaptive.depth.kv_strategies.base import KvState, KvStrategy, PlanDraft
from vllm_adaptive.depth.kv_strategies.mask import MaskStrategy
from vllm_adaptive.depth.kv_strategies.monotone import MonotoneStrategy
from vllm_adaptive.depth.kv_strategies.propagate import PropagateStrategy
from vllm_adaptive.depth.kv_strategies.recompute import RecomputeStrategy
from vllm_adaptive.depth.kv_strategies.river import RiverStrategy

STRATEGIES: dict[str, type[KvStrategy]] = {
    cls.name: cls
    for cls in (
        MonotoneStrategy,
        MaskStrategy,
        PropagateStrategy,
        RecomputeStrategy,
        RiverStrategy,
    )
}


def kv_strategy_class(name: str) -> type[KvStrategy]:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown kv_strategy {name!r} (one of {', '.join(STRATEGIES)})") from None


def build_kv_strategy(depth_config: Any) -> KvStrategy:
    """The strategy instance for an `adaptive.depth` config section."""
    return kv_strategy_class(depth_config.kv_strategy).from_config(depth_config)


__all__ = [
    "STRATEGIES",
    "KvState",
    "KvStrategy",
    "MaskStrategy",
    "MonotoneStrategy",
    "PlanDraft",
    "PropagateStrategy",
    "RecomputeStrategy",
    "RiverStrategy",
    "build_kv_strategy",
    "kv_strategy_class",
]
