"""GEARBX's output-entropy monitor (sections 3, 4, 10, 11; defaults from section 16).

Per request: a rolling mean of the last ``window`` token entropies picks low / mid / high against
``theta_low`` / ``theta_high``; leaving an extreme gear needs the mean to cross its threshold by
``hysteresis``; a gear is held at least ``min_gear_duration`` tokens; two consecutive entropies
above ``catastrophic_fraction * log2 V`` fall back to high at once. Thresholds are given for a
32K reference vocabulary and scaled by ``log2 V / log2 32768``, unless calibrated from prefill
entropies (percentiles p30 / p60, capped at 0.06 / 0.12 log2 V), which are already in this
vocabulary's bits. The cold-start gear comes from the prompt classifier.

Two choices the paper leaves open, made here:

- ``min_gear_duration`` has no number in the paper (runs of "8-30 tokens" are typical); the
  default is 4.
- The catastrophic fallback ignores the minimum duration: it is a safety exit.
- The prompt is prefilled at the high gear (``prefill``), not at the cold-start gear: the
  prefill makes the first token, and a short plain prompt's low cold-start gear (int4) there
  changed the answer's first token against full precision (measured: "The capital of France
  is" -> " located" instead of " Paris"). The cold-start gear applies from the first decode
  step. Prefill is a multi-token matmul, where the paper itself prefers dense kernels (7.2)
  and where packed CPU kernels are slower than dense ones; gears save decode bandwidth.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_adaptive.config import GearbxSettings
from vllm_adaptive.gears import HIGH, LOW, MID
from vllm_adaptive.precision.calibration import percentile_thresholds
from vllm_adaptive.precision.policies.base import GearPolicy, RequestGearState
from vllm_adaptive.precision.prompt_classifier import cold_start_level


@dataclass
class GearbxState(RequestGearState):
    window: list[float] | None = None


class GearbxMonitor(GearPolicy):
    name = "gearbx"

    def __init__(self, vocab_size: int, settings: GearbxSettings | None = None) -> None:
        super().__init__(vocab_size)
        s = settings or GearbxSettings()
        if s.theta_low >= s.theta_high:
            raise ValueError(
                f"gearbx.theta_low ({s.theta_low}) must be below theta_high ({s.theta_high})"
            )
        self.settings = s
        self.log_v = math.log2(vocab_size)
        scale = self.log_v / math.log2(s.vocab_ref)
        self.theta_low = s.theta_low * scale
        self.theta_high = s.theta_high * scale
        self.calibrated = False
        self.catastrophic = s.catastrophic_fraction * self.log_v

    # -- calibration ---------------------------------------------------------------------------
    @property
    def wants_calibration(self) -> bool:
        return self.settings.calibration == "first_prefill" and not self.calibrated

    def calibrate(self, entropies: Sequence[float]) -> None:
        s = self.settings
        self.theta_low, self.theta_high = percentile_thresholds(
            entropies,
            self.vocab_size,
            p_low=s.p_low,
            p_high=s.p_high,
            min_band=s.min_band,
            cap_low=s.cap_low,
            cap_high=s.cap_high,
        )
        self.calibrated = True

    # -- per request ---------------------------------------------------------------------------
    def reads_prompt(self) -> bool:
        return self.settings.cold_start

    def start(self, prompt_text: str | None) -> GearbxState:
        level = cold_start_level(prompt_text) if (self.settings.cold_start and prompt_text) else MID
        return GearbxState(level=level, window=[])

    def prefill_level(self, state: RequestGearState) -> int:
        return HIGH if self.settings.prefill == "high" else state.level

    def classify(self, mean: float, current: int) -> int:
        """Section 3.3: thresholds, with a hysteresis margin for leaving an extreme gear."""
        h = self.settings.hysteresis
        if current == LOW and mean <= self.theta_low + h:
            return LOW
        if current == HIGH and mean >= self.theta_high - h:
            return HIGH
        if mean <= self.theta_low:
            return LOW
        if mean >= self.theta_high:
            return HIGH
        return MID

    def observe(self, state: GearbxState, entropy_bits: float) -> int:
        s = self.settings
        window = state.window
        window.append(entropy_bits)
        if len(window) > s.window:
            del window[0]
        state.tokens_in_gear += 1
        mean = sum(window) / len(window)
        target = self.classify(mean, state.level)
        if len(window) >= 2 and s.lookahead:
            slope = (window[-1] - window[0]) / (len(window) - 1)
            state.prewarm = self.classify(mean + s.lookahead * slope, target)
        catastrophic = len(window) >= 2 and min(window[-2:]) > self.catastrophic
        if catastrophic:
            target = HIGH
        if target != state.level and (catastrophic or state.tokens_in_gear >= s.min_gear_duration):
            state.level = target
            state.tokens_in_gear = 0
            state.shifts += 1
        return state.level

    def describe(self) -> dict:
        return {
            **self.settings.model_dump(),
            "policy": self.name,
            "theta_low": round(self.theta_low, 4),
            "theta_high": round(self.theta_high, 4),
            "calibrated": self.calibrated,
        }
