"""The depth runtime's engine-wide counters: what its telemetry reports beside the decode-depth
statistics every depth engine shares (`stats.py`). The runtime and its KV strategies add to
them; nothing reads them on the hot path."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_adaptive.depth.stats import DecodeDepthStats


@dataclass
class EngineCounters(DecodeDepthStats):
    steps: int = 0
    prefill_tokens: int = 0
    capped_prefills: int = 0
    prefills_with_context: int = 0  # prefill rows attending to earlier slots (chunks, hits)
    backfilled_kv: int = 0
    propagated_kv: int = 0  # (token, layer) K/V written from exit states (propagate)
    river_token_layers: int = 0  # decode token-layers run in the Exit River
    recomputed_kv: int = 0  # token-layers resumed from exit states (recompute)
    masked_steps: int = 0  # steps where some cached slot was masked at some layer
    peels: int = 0
    whole_stack_steps: int = 0  # steps with nothing to decide: every layer as one call
    quiet_steps: int = 0  # of those, steps no request could leave early: no plan was made
    span_steps: int = 0  # steps that probed on compiled spans (one call between probe layers)
    accelerated_rows: int = 0  # (decode token, gate interval) accelerated streams computed
    accelerated_token_layers: int = 0  # decode token-layers run on the accelerated stream
    arla_exits: int = 0  # decode tokens that exited by ARLA (emitting the accelerated state)
    decision_seconds: float = 0.0
    accelerated_seconds: float = 0.0  # the accelerated stream (ARLA), inside the forward
    peel_seconds: float = 0.0
    forward_seconds: float = 0.0
