"""The MoE layer's compute and the tiered runtime that feeds it (no vLLM imports).

Routing (docs/moe.md): top-k of the router logits on the MLP input; the MLP output is the plain
sum of the selected experts' ``down_e(silu(gate_e(x)) * up_e(x))``, no gate weights. Only the
experts some token of the batch selected are computed, each once on the rows of the tokens that
selected it (grouped per expert), and the per-expert outputs are summed in ascending expert
order in float32 whatever order the experts were computed in, so the all-resident model and the
tiered one (which computes READY experts first) give the same bits.

:class:`MoeRuntime` is the policy over :mod:`vllm_adaptive.moe.tiers`: at each layer it demands
that layer's experts (hits, misses, on-demand loads hard-pinned), asks the predictor for the
next layers' experts and prefetches them (soft pins), then computes the ready experts first and
waits for the others, and finally releases the layer's soft pins. It also scores every
prediction against the experts the predicted layer really needed (recall, precision per
lookahead distance) and exports its counters (:meth:`MoeRuntime.engine_stats`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vllm_adaptive.moe.predictors import ExpertPredictor
from vllm_adaptive.moe.tiers import READY, FastTier

logger = logging.getLogger("vllm.adaptive.moe")

ExpertOutput = tuple[int, torch.Tensor, torch.Tensor]  # (expert, token rows, output rows)


def expert_rows(w: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E, m, H] view of a permuted ``gate_proj``/``up_proj`` weight [E*m, H]: expert e is
    rows ``e*m:(e+1)*m``."""
    return w.view(num_experts, w.shape[0] // num_experts, w.shape[1])


def expert_cols(w: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E, H, m] view of a permuted ``down_proj`` weight [H, E*m]: expert e is columns
    ``e*m:(e+1)*m``."""
    return w.view(w.shape[0], num_experts, w.shape[1] // num_experts).permute(1, 0, 2)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int) -> torch.Tensor:
    """Bool [T, E]: each token's ``top_k`` largest router logits (ties to the lower index)."""
    logits = F.linear(x, router)
    idx = logits.topk(top_k, dim=-1).indices
    return torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, idx, True)


def expert_forward(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` of one expert; ``gate_up`` is [2m, H] (gate rows first),
    ``down`` [H, m]."""
    m = down.shape[1]
    h = F.linear(x, gate_up)
    return F.linear(F.silu(h[:, :m]) * h[:, m:], down)


def combine(outputs: list[ExpertOutput], like: torch.Tensor) -> torch.Tensor:
    """Sum the experts' outputs per token, in ascending expert order, in float32 (or wider)."""
    dtype = torch.promote_types(like.dtype, torch.float32)
    acc = torch.zeros(like.shape, dtype=dtype, device=like.device)
    for _, rows, y in sorted(outputs, key=lambda o: o[0]):
        acc.index_add_(0, rows, y.to(dtype))
    return acc.to(like.dtype)


def moe_resident(
    x: torch.Tensor,
    mask: torch.Tensor,
    weights: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """The all-resident MoE MLP: ``weights(e)`` gives expert e's (gate_up, down)."""
    outputs = []
    for e in mask.any(0).nonzero().flatten().tolist():
        rows = mask[:, e].nonzero().flatten()
        outputs.append((e, rows, expert_forward(x[rows], *weights(e))))
    return combine(outputs, x)


@dataclass
class PredictionStats:
    """Per lookahead distance: experts predicted, needed and both (summed over layer-steps)."""

    predicted: dict[int, int] = field(default_factory=dict)
    needed: dict[int, int] = field(default_factory=dict)
    correct: dict[int, int] = field(default_factory=dict)

    def add(self, distance: int, predicted: set[int], needed: set[int]) -> None:
        for d, n in (
            (self.predicted, len(predicted)),
            (self.needed, len(needed)),
            (self.correct, len(predicted & needed)),
        ):
            d[distance] = d.get(distance, 0) + n

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for d in sorted(self.predicted):
            out[str(d)] = {
                "predicted": self.predicted[d],
                "needed": self.needed[d],
                "correct": self.correct[d],
                "recall": self.correct[d] / self.needed[d] if self.needed[d] else 0.0,
                "precision": self.correct[d] / self.predicted[d] if self.predicted[d] else 0.0,
            }
        return out


class MoeRuntime:
    """Tiered experts for every MoE layer of one model (see the module docstring)."""

    def __init__(
        self,
        tier: FastTier,
        predictor: ExpertPredictor,
        num_layers: int,
        num_experts: int,
        top_k: int,
        info: dict | None = None,
    ) -> None:
        self.tier, self.predictor = tier, predictor
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.info = dict(info or {})
        self.predictions = PredictionStats()
        self._pending: dict[int, dict[int, set[int]]] = {}  # layer -> distance -> experts
        self.tokens = 0  # tokens through the MoE stack (rows of layer 0)
        self.steps = 0
        self.forward_seconds = 0.0
        self._last_export = 0.0

    # -- one layer ----------------------------------------------------------------------------

    def layer(
        self, layer: int, x: torch.Tensor, residual: torch.Tensor | None, mask: torch.Tensor
    ) -> torch.Tensor:
        tier = self.tier
        tier.current_layer = layer
        needed = mask.any(0).nonzero().flatten().tolist()
        if layer == 0:
            self.tokens += x.shape[0]
        deferred = []
        for e in needed:
            if not tier.demand((layer, e)):
                deferred.append(e)
        tier.cancel_prefetches(layer)  # queued for this layer or earlier and not needed: too late
        self._score(layer, set(needed))
        if self.predictor.name != "none":
            for j, experts in sorted(self.predictor.predict(layer, x, residual).items()):
                self._pending.setdefault(j, {})[j - layer] = set(experts)
                for e in experts:
                    tier.start_load((j, e), soft=True)
        ready = [e for e in needed if e not in deferred]
        ready.sort(key=lambda e: tier.state((layer, e)) != READY)  # READY ones first
        outputs = []
        for e in ready + deferred:
            key = (layer, e)
            if e in deferred:
                tier.load_blocking(key)
            tier.acquire(key)
            w = tier.views(key)
            rows = mask[:, e].nonzero().flatten()
            outputs.append((e, rows, expert_forward(x[rows], w["gate_up"], w["down"])))
            tier.unpin(key)
        tier.release_soft(layer)
        return combine(outputs, x)

    def _score(self, layer: int, needed: set[int]) -> None:
        for distance, predicted in self._pending.pop(layer, {}).items():
            self.predictions.add(distance, predicted, needed)

    def resize(self, slots: int, eviction: str | None = None) -> None:
        """Replace the fast tier by an empty one of ``slots`` over the same slow tier (between
        steps): every resident expert's pages are dropped, so the next loads are cold."""
        from vllm_adaptive.moe.tiers import FastTier

        old = self.tier
        old.drain()
        old.loader.shutdown()
        for key in list(old.where):
            old.slow.drop(key)
        self.tier = FastTier(old.slow, slots, eviction=eviction or old.eviction)
        self._pending.clear()

    def set_predictor(self, predictor: ExpertPredictor) -> None:
        """Swap the predictor between steps; pending predictions and soft pins are dropped."""
        self.predictor = predictor
        self._pending.clear()
        self.tier.release_soft()

    # -- telemetry ----------------------------------------------------------------------------

    def end_step(self, seconds: float) -> None:
        self.steps += 1
        self.forward_seconds += seconds
        self._pending.clear()  # predictions past the last layer never get scored
        self.tier.cancel_prefetches()  # every layer has run: queued prefetches are useless
        now = time.monotonic()
        if now - self._last_export >= 1.0:
            self._last_export = now
            export_engine_stats(self.engine_stats())

    def reset_stats(self) -> None:
        from vllm_adaptive.moe.tiers import TierStats

        self.tier.stats = TierStats()
        self.tier.slow.bytes_read = 0
        self.predictions = PredictionStats()
        self.tokens = self.steps = 0
        self.forward_seconds = 0.0

    def stats(self) -> dict:
        s = self.tier.stats.as_dict()
        demanded = s["hits"] + s["misses"]
        return {
            **self.info,
            "eviction": self.tier.eviction,
            "loader_cpus": sorted(self.tier.loader.cpus) if self.tier.loader.cpus else None,
            "predictor": self.predictor.name,
            "lookahead": self.predictor.lookahead,
            "slots": self.tier.num_slots,
            "experts": self.num_layers * self.num_experts,
            "tokens": self.tokens,
            "steps": self.steps,
            "forward_seconds": self.forward_seconds,
            **s,
            "hit_rate": s["hits"] / demanded if demanded else None,
            "stall_seconds_per_token": s["stall_seconds"] / self.tokens if self.tokens else None,
            "prediction": self.predictions.summary(),
        }

    def engine_stats(self) -> dict:
        """The totals the metrics export (``vllm_adaptive.engine.metrics``), JSON-able."""
        s = self.tier.stats
        return {
            "mechanism": "moe",
            "moe_tokens": self.tokens,
            "moe_hits": s.hits,
            "moe_misses": s.misses,
            "moe_loads": s.loads,
            "moe_evictions": s.evictions,
            "moe_prefetches": s.prefetches,
            "moe_prefetch_promoted": s.prefetch_promoted,
            "moe_prefetch_cancelled": s.prefetch_cancelled,
            "moe_stall_seconds": s.stall_seconds,
            "moe_bytes_read": s.bytes_read,
            "moe_violations": s.violations,
            "forward_seconds": self.forward_seconds,
        }


def export_engine_stats(stats: dict) -> None:
    """Hand totals to the frontend's metrics; never fails a step."""
    try:
        from vllm_adaptive import telemetry_exchange

        telemetry_exchange.write_engine_stats(stats)
    except Exception:
        logger.exception("vllm-adaptive moe: telemetry export")
