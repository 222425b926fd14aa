"""Per-request depth state (budget, thresholds, depths so far) and per-request telemetry.

A request's depth settings are resolved once, when it joins the persistent batch: its
``adaptive_*`` keys arrive already parsed (`batch_mirror.notify` parses them once per request
for every mechanism), and `DepthRequests` turns them into a `DepthRequest` holding what the
runtime's plan reads (``off``, the EMAD ``thresholds`` of its budget). The runtime owns a
`DepthRequests` and calls it; nothing here calls the runtime back.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_adaptive.batch_mirror import SlotMirror
from vllm_adaptive.overrides import RequestOverrides

logger = logging.getLogger("vllm.adaptive.depth")


@dataclass
class DepthRequest:
    tag: str
    prompt_len: int
    budget: float | None  # the request's override, None: the engine's
    off: bool
    thresholds: np.ndarray
    depths: list[int] = field(default_factory=list)  # depth of each generated token
    capped_prefill: int | None = None
    resumed: bool = False  # admitted with generated tokens: resumed after preemption
    mode_off: bool = False  # adaptive_mode "off" (a budget of 1.0 stops exits, not fusion)
    #: no token of it can stop early: off, or an EMAD-only engine whose thresholds for its
    #: budget all lie below what the proxy can output (a budget of 1.0)
    quiet: bool = False

    def record(self, num_layers: int, engine_budget: float) -> dict[str, Any]:
        hist: dict[str, int] = {}
        for d in self.depths:
            hist[str(d)] = hist.get(str(d), 0) + 1
        return {
            "tag": self.tag,
            "mechanism": "depth",
            "prompt_tokens": self.prompt_len,
            "generated_tokens": len(self.depths),
            "budget": self.budget if self.budget is not None else engine_budget,
            "budget_override": self.budget is not None,
            "mode": "off" if self.off else "on",
            "num_layers": num_layers,
            "mean_depth": float(np.mean(self.depths)) if self.depths else None,
            "exit_histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
            "depths": list(self.depths),
            "capped_prefill_depth": self.capped_prefill,
            "finished_at": time.time(),
        }


class BudgetThresholds:
    """EMAD's per-probe thresholds for a budget (None: the engine's), from the exit profile."""

    def __init__(self, profile: Any, engine_budget: float) -> None:
        self.profile = profile
        self.engine_budget = engine_budget
        self._cache: dict[float, np.ndarray] = {}

    def can_pass(self, thresholds: np.ndarray) -> bool:
        """Some probe's threshold is within the proxy's range: the exit signal may pass."""
        return bool((thresholds >= self.profile.proxy_floor).any())

    def __call__(self, budget: float | None) -> np.ndarray:
        b = self.engine_budget if budget is None else budget
        if b not in self._cache:
            self._cache[b] = self.profile.thresholds_for(b)
        return self._cache[b]


class DepthRequests:
    """Mirror of the persistent batch (see `batch_mirror`) holding `DepthRequest`s."""

    def __init__(
        self,
        *,
        num_layers: int,
        thresholds: BudgetThresholds,
        signal_names: tuple[str, ...],
        telemetry_path: str | None,
    ) -> None:
        self.num_layers = num_layers
        self.thresholds = thresholds
        self.engine_budget = thresholds.engine_budget
        self.signal_names = signal_names
        self.uses_budget = "emad" in signal_names
        self.emad_only = signal_names == ("emad",)
        self.telemetry_path = telemetry_path
        self.mirror: SlotMirror[DepthRequest] = SlotMirror(self._new, self._finish)
        self.finished: list[dict[str, Any]] = []
        self.max_finished = 4096
        self.finished_count = 0
        self.seen = 0
        self._lock = threading.Lock()
        self._warned_budget = False

    def _new(self, o: RequestOverrides, prompt_ids: list[int] | None, out: Any) -> DepthRequest:
        self.seen += 1
        # A budget of 1.0 means no exits whatever the signal: with EMAD combined with another
        # signal (combine "any"), 1.0 would otherwise only silence EMAD.
        off = o.mode == "off" or (o.depth_budget is not None and o.depth_budget >= 1.0)
        if o.depth_budget is not None and not self.uses_budget:
            # validate_params sees no engine config, so this cannot be a 400: honour the one
            # budget every signal understands (1.0: no exits) and say what is ignored.
            if o.depth_budget < 1.0 and not self._warned_budget:
                self._warned_budget = True
                logger.warning(
                    "vllm-adaptive depth: adaptive_depth_budget=%s ignored: budgets set EMAD "
                    "thresholds and this engine's exit signal is %s (only 1.0, no exits, applies)",
                    o.depth_budget,
                    "+".join(self.signal_names),
                )
        thresholds = self.thresholds(1.0 if off else o.depth_budget)
        return DepthRequest(
            tag=o.request_tag or f"req{self.seen}",
            prompt_len=len(prompt_ids or ()),
            budget=o.depth_budget,
            off=off,
            quiet=off or (self.emad_only and not self.thresholds.can_pass(thresholds)),
            thresholds=thresholds,
            resumed=bool(out),
            mode_off=o.mode == "off",
        )

    def _finish(self, req: DepthRequest) -> None:
        rec = req.record(self.num_layers, self.engine_budget)
        self.finished.append(rec)
        del self.finished[: -self.max_finished]
        self.finished_count += 1
        if self.telemetry_path:
            with open(self.telemetry_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        exchange("append_request_record", rec)

    def update_batch(self, batch_update: Any) -> int:
        """Apply the batch's changes; how many requests finished."""
        with self._lock:
            before = self.finished_count
            self.mirror.apply(batch_update)
            return self.finished_count - before

    def rows(self, num_reqs: int) -> list[DepthRequest] | None:
        return self.mirror.rows(num_reqs)

    def observe(
        self,
        states: list[DepthRequest] | None,
        samples: np.ndarray,
        decode: np.ndarray,
        depth: list[int],
    ) -> None:
        """Depth of the token each row produced this step (prefill rows: only the row's last
        chunk produces a token, ``samples``; its depth is the prefill depth)."""
        if states is None:
            return
        for r, req in enumerate(states):
            if not samples[r]:
                continue
            if not decode[r] and int(depth[r]) < self.num_layers:
                req.capped_prefill = int(depth[r])
            req.depths.append(int(depth[r]))

    def records(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(finished, running) per-request records."""
        live = [
            r.record(self.num_layers, self.engine_budget)
            for _, r in sorted(self.mirror.slots.items())
        ]
        return list(self.finished), live


def exchange(fn: str, payload: dict[str, Any]) -> None:
    """Hand telemetry to the frontend (metrics, HTTP route); never fails a step."""
    try:
        from vllm_adaptive import telemetry_exchange
    except ImportError:
        return
    try:
        getattr(telemetry_exchange, fn)(payload)
    except Exception:  # telemetry must not break serving
        logger.exception("vllm-adaptive: telemetry export")
