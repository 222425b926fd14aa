"""What every section of the adaptive config shares: the strict base model, the error type and
the names of the managed linears."""

from __future__ import annotations

from vllm_adaptive.gears import (
    Precision,
    precision_rank,
)
from vllm_adaptive.strict_model import StrictModel

#: Key of the adaptive section inside vLLM's `additional_config`.
ADDITIONAL_CONFIG_KEY = "adaptive"


class AdaptiveConfigError(ValueError):
    """A bad adaptive config; the message names the offending key."""


_Strict = StrictModel

#: The managed linears of a decoder layer, by the names the model interface gives them
#: (``models/interface.py``; vLLM's fused module names), and the LM head.
MANAGED_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
LAYER_MODULES = MANAGED_MODULES[:4]
GearMap = tuple[Precision, Precision, Precision]


def _check_gear_order(gears: GearMap, where: str) -> None:
    ranks = [precision_rank(g) for g in gears]
    if ranks != sorted(ranks):
        raise ValueError(f"{where}: gears go from the cheapest (low) to the most precise (high)")
