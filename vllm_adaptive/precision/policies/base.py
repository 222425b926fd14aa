"""The policy interface: per-request state in, gear level out.

A policy decides *when* a request changes gear; it never sees tensors of the model. The
controller calls, for each request:

- ``start(prompt_text)`` once, when the request joins the batch (cold start);
- ``prefill_level(state)``: the level its prompt is prefilled at, which also makes its first
  token;
- ``observe(state, entropy_bits)`` after every sampled token of that request, with the entropy of
  the distribution the token was sampled from; the returned level is used for the request's next
  forward pass (GEARBX's "output entropy of step t picks the gear of step t+1").

Levels are 0 (low), 1 (mid), 2 (high); see :mod:`vllm_adaptive.gears`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class RequestGearState:
    """What a policy remembers about one request. Policies may subclass it."""

    level: int
    tokens_in_gear: int = 0
    shifts: int = 0
    prewarm: int | None = None  # level the policy expects next (GEARBX section 3.5)
    history: list[float] = field(default_factory=list)  # recent raw entropies (bits)


class GearPolicy(ABC):
    """Decides gear levels from output entropy. One instance per engine."""

    name: str = "base"
    #: the controller computes each sampled row's entropy only for policies that read it (an
    #: entropy over the vocabulary per request per step is not free on a CPU)
    reads_entropy: bool = True

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    @abstractmethod
    def start(self, prompt_text: str | None) -> RequestGearState:
        """State for a new request, with its cold-start level."""

    @abstractmethod
    def observe(self, state: RequestGearState, entropy_bits: float) -> int:
        """Record one token's entropy; return the level for the request's next step."""

    def prefill_level(self, state: RequestGearState) -> int:
        """Level of the steps that prefill a request's prompt (they also make its first token).

        Default: the request's starting level."""
        return state.level

    def reads_prompt(self) -> bool:
        """Whether ``start`` looks at the prompt text (the controller then decodes each new
        request's prompt; otherwise ``start`` gets None)."""
        return True

    @property
    def wants_calibration(self) -> bool:
        """True while the policy wants entropies of prefill positions (see ``calibrate``)."""
        return False

    def calibrate(self, entropies: Sequence[float]) -> None:  # noqa: B027 - optional hook
        """Set thresholds from prefill entropies (engine-wide)."""

    def describe(self) -> dict:
        """Thresholds and settings in effect, for telemetry."""
        return {"policy": self.name}
