"""Engine counters of a precision engine, handed to the frontend like the depth runtime's.

The controller calls three hooks from vLLM's own loop (``step_started`` at the step plan,
``observed`` for each sampled row, ``request_finished`` when a request leaves the batch).
Totals go to ``engine-<pid>.json`` and finished requests' records to ``requests.jsonl``
(:mod:`vllm_adaptive.telemetry_exchange`), where the frontend's ``vllm_adaptive:*`` metrics and
``GET /v1/adaptive/requests/{tag}`` read them. Every decode token of a precision engine runs
every decoder layer, so the depth metrics count it at full depth; the gear metrics
(``gear_tokens``, ``gear_shifts``) are this module's own.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("vllm.adaptive.precision")

#: Seconds between two writes of the engine stats file (finished requests force one).
EXPORT_INTERVAL_S = 1.0


@dataclass
class PrecisionCounters:
    steps: int = 0
    decode_tokens: int = 0  # tokens sampled by decode steps (not the one a prefill makes)
    first_tokens: int = 0  # tokens sampled by the step that finished a prompt's prefill
    gear_tokens: dict[str, int] = field(default_factory=dict)  # decode tokens by gear
    gear_shifts: int = 0  # gear changes between consecutive decode tokens of a request
    requests_finished: int = 0
    decision_seconds: float = 0.0  # step plans, entropies and policy updates
    forward_seconds: float = 0.0  # from the step plan to the sampled rows' logits


class PrecisionTelemetry:
    """Counters, their export, and the hand-over of finished requests' records."""

    def __init__(
        self, num_layers: int | None, describe: dict[str, Any], writes: bool = True
    ) -> None:
        """``writes``: this process exports the engine's stats (readers sum the files of all
        engine processes, so only one rank of an engine writes)."""
        self.num_layers = num_layers
        self.describe = describe  # policy name and routing: constant per engine
        self.counters = PrecisionCounters()
        self._step_t0: float | None = None
        self._last_export = 0.0
        self._writes = writes

    def step_started(self, plan_seconds: float) -> None:
        self._step_t0 = time.perf_counter()
        self.counters.steps += 1
        self.counters.decision_seconds += plan_seconds

    def observed(self, rows: list[tuple[str, bool, bool]], seconds: float) -> None:
        """``(gear, decode, shifted)`` of each token sampled this step: the gear name of the
        step that made it, whether a decode step made it (not the prefill that makes a
        request's first token), and whether its gear differs from the request's previous
        decode token's."""
        c = self.counters
        for gear, decode, shifted in rows:
            if not decode:
                c.first_tokens += 1
                continue
            c.decode_tokens += 1
            c.gear_tokens[gear] = c.gear_tokens.get(gear, 0) + 1
            c.gear_shifts += shifted
        c.decision_seconds += seconds
        if self._step_t0 is not None:
            c.forward_seconds += time.perf_counter() - self._step_t0
            self._step_t0 = None
        self.export()

    def request_finished(self, record: dict[str, Any]) -> None:
        self.counters.requests_finished += 1
        if self._writes:
            _exchange("append_request_record", record)
        self.export(force=True)

    def engine_stats(self) -> dict[str, Any]:
        c = self.counters
        full = self.num_layers
        return {
            "mechanism": "precision",
            **self.describe,
            "num_layers": full,
            "steps": c.steps,
            "decode_tokens": c.decode_tokens,
            "first_tokens": c.first_tokens,
            # every decode token runs every layer: the depth metrics count it at full depth
            "layers_executed": c.decode_tokens * full if full else None,
            "exit_tokens": {str(full): c.decode_tokens} if full and c.decode_tokens else {},
            "gear_tokens": dict(sorted(c.gear_tokens.items())),
            "gear_shifts": c.gear_shifts,
            "requests_finished": c.requests_finished,
            "decision_seconds": c.decision_seconds,
            "forward_seconds": c.forward_seconds,
        }

    def export(self, force: bool = False) -> None:
        """Write the engine stats file, at most once a second unless forced."""
        now = time.monotonic()
        if self._writes and (force or now - self._last_export >= EXPORT_INTERVAL_S):
            self._last_export = now
            _exchange("write_engine_stats", self.engine_stats())


def _exchange(fn: str, payload: dict[str, Any]) -> None:
    """Hand telemetry to the frontend; never fails a step."""
    try:
        from vllm_adaptive import telemetry_exchange

        getattr(telemetry_exchange, fn)(payload)
    except Exception:  # telemetry must not break serving
        logger.exception("vllm-adaptive: precision telemetry export")
