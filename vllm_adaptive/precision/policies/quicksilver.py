"""QuickSilver's Adaptive Matryoshka Quantization tiers (section 2.5, appendix E.1-E.2, E.9).

Entropy is min-max normalized and cut at ``tau_low`` = 0.3 / ``tau_high`` = 0.6: above
``tau_high`` the high tier (8 bits), between the two the mid tier (4 bits), below ``tau_low``
the low tier (2 bits).

The paper normalizes over the tokens of a teacher-forced minibatch (8 x 512 tokens), where every
token's entropy is known at once. In decoding one token per request exists per step, so the
normalization set here is the request's last ``history`` token entropies (the current one
included): the same min-max rule over a sliding window of the request's own tokens. Until
``min_history`` entropies exist the scale is unknown and the request stays at the high tier.

Signal: the paper reads entropy at a mid layer (layer 15 of 30) of the token being computed.
Here the signal is the output entropy of the previous step of the request (as GEARBX), which
costs nothing extra; the tiers apply to the layer groups the config routes (by default, as in the
paper, the second half of the layers; the first half runs the high tier).
"""

from __future__ import annotations

from vllm_adaptive.config import QuickSilverSettings
from vllm_adaptive.gears import HIGH, LOW, MID
from vllm_adaptive.precision.policies.base import GearPolicy, RequestGearState


class QuickSilverTiers(GearPolicy):
    name = "quicksilver"

    def __init__(self, vocab_size: int, settings: QuickSilverSettings | None = None) -> None:
        super().__init__(vocab_size)
        s = settings or QuickSilverSettings()
        if s.tau_low >= s.tau_high:
            raise ValueError(
                f"quicksilver.tau_low ({s.tau_low}) must be below tau_high ({s.tau_high})"
            )
        if s.min_history > s.history:
            raise ValueError("quicksilver.min_history must not exceed quicksilver.history")
        self.settings = s

    def reads_prompt(self) -> bool:
        return False

    def start(self, prompt_text: str | None) -> RequestGearState:
        return RequestGearState(level=HIGH)

    def normalized(self, history: list[float]) -> float | None:
        lo, hi = min(history), max(history)
        if hi - lo <= 1e-6:
            return None
        return (history[-1] - lo) / (hi - lo)

    def observe(self, state: RequestGearState, entropy_bits: float) -> int:
        s = self.settings
        state.history.append(entropy_bits)
        if len(state.history) > s.history:
            del state.history[0]
        state.tokens_in_gear += 1
        h = self.normalized(state.history) if len(state.history) >= s.min_history else None
        if h is None:
            level = HIGH if len(state.history) < s.min_history else state.level
        elif h > s.tau_high:
            level = HIGH
        elif h >= s.tau_low:
            level = MID
        else:
            level = LOW
        if level != state.level:
            state.level = level
            state.tokens_in_gear = 0
            state.shifts += 1
        return state.level

    def describe(self) -> dict:
        return {"policy": self.name, **self.settings.model_dump()}
