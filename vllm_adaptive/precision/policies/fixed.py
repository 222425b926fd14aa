"""A fixed gear: every token runs one precision. The baseline each adaptive policy is judged by."""

from __future__ import annotations

from vllm_adaptive.gears import HIGH
from vllm_adaptive.precision.policies.base import GearPolicy, RequestGearState


class FixedGear(GearPolicy):
    """Always the high level; the config maps all three levels to the fixed precision."""

    name = "fixed"
    reads_entropy = False

    def reads_prompt(self) -> bool:
        return False

    def start(self, prompt_text: str | None) -> RequestGearState:
        return RequestGearState(level=HIGH)

    def observe(self, state: RequestGearState, entropy_bits: float | None) -> int:
        state.tokens_in_gear += 1
        return state.level
