"""EMAD adaptive depth for the MLX engine: calibrated exits with monotone KV, one token a step.

Mechanism only; decisions come from the shared policies: the exit rule is
``depth/policies/emad_rule.EmadRule`` (numpy in, bool out) on the proxy this module computes in
MLX, and floors and caps come from ``depth/schedule.DepthSchedule``. The profile is the vLLM
path's own file (``vllm-adaptive calibrate``), loaded without torch and checked against the
checkpoint's fingerprint.

A decode step runs the blocks one by one. At each probe layer ``l`` a token stops when ``l`` is
its cap (monotone: the depth of the previous token), or, between its floor and cap, when the
low-rank proxy entropy of its calibrated readout ``a_l * RMSNorm(h) + b_l`` is at or below the
per-probe threshold of its budget. An exited token's logits are the LM head of that readout.
Monotone KV needs no bookkeeping here: a token that stopped at ``l`` wrote K/V in blocks
``1..l`` only, and every later token stops at or before ``l``, so no block ever reads a position
it lacks (mlx-lm keeps one cache per block, each with its own offset). Prompt tokens run every
block. Refresh (a cap that rises) would need back-filled K/V and is refused (`support.py`).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from vllm_adaptive.config import DepthConfig
from vllm_adaptive.depth.exit_profile import ExitProfile
from vllm_adaptive.depth.policies.emad_rule import EmadRule
from vllm_adaptive.depth.requests import DepthRequest
from vllm_adaptive.depth.schedule import DepthSchedule
from vllm_adaptive.depth.stats import DecodeDepthStats
from vllm_adaptive.metal_backend.arch import LlamaLayout
from vllm_adaptive.metal_backend.entropy import entropy_nats
from vllm_adaptive.overrides import RequestOverrides

logger = logging.getLogger("vllm_adaptive.mlx.depth")


def feature_score(z: mx.array, temperature: float, k: int) -> mx.array:
    """``depth/proxies.feature_score`` in MLX: entropy if the mass outside the top-k were
    uniform."""
    z = z.astype(mx.float32) / temperature
    lse = mx.logsumexp(z, axis=-1, keepdims=True)
    top = mx.exp(mx.topk(z, k, axis=-1) - lse)
    head = -(top * mx.log(mx.maximum(top, 1e-30))).sum(-1)
    tail = mx.maximum(1.0 - top.sum(-1), 0.0)
    rest = z.shape[-1] - k
    tail_h = -tail * mx.log(mx.maximum(tail, 1e-30) / rest)
    return head + tail_h


class DepthRunner:
    """Engine-wide: the profile in MLX arrays, the schedule, the rule and counters."""

    def __init__(self, cfg: DepthConfig, layout: LlamaLayout, model_dir: str | Path) -> None:
        profile = ExitProfile.load(cfg.profile, model_dir, framework="numpy")
        if profile.num_layers != layout.num_layers:
            raise ValueError(
                f"adaptive.depth.profile: made for {profile.num_layers} layers, the model has "
                f"{layout.num_layers}"
            )
        self.config = cfg
        self.profile = profile
        self.layout = layout
        self.num_layers = profile.num_layers
        self.schedule = DepthSchedule.for_config(
            tuple(profile.readout_layers), cfg.floor, cfg.refresh
        )
        self.rule = EmadRule(profile.proxy, profile.feature_knots)
        self.budget = cfg.budget if cfg.budget is not None else profile.budget
        self.probe_index = {layer: p for p, layer in enumerate(profile.probe_layers)}
        self.norm_a = mx.array(profile.norm_a)
        self.norm_b = mx.array(profile.norm_b)
        self.v = mx.array(profile.lowrank_v)  # [d, r]
        self.u_t = mx.array(np.ascontiguousarray(profile.lowrank_u.T))  # [r, V]
        self.proxy_floor = profile.proxy_floor
        self._thresholds: dict[float, np.ndarray] = {}
        self.finished: list[dict[str, Any]] = []
        self.max_finished = 4096
        self.seen = 0
        self.stats = DecodeDepthStats()
        self._lock = threading.Lock()
        logger.info(
            "vllm-adaptive mlx depth: profile %s, budget %.3g (%s), probes %s",
            cfg.profile,
            self.budget,
            profile.budget_kind,
            profile.probe_layers,
        )

    def thresholds(self, budget: float | None) -> np.ndarray:
        b = self.budget if budget is None else budget
        if b not in self._thresholds:
            self._thresholds[b] = self.profile.thresholds_for(b)
        return self._thresholds[b]

    # -- per request ---------------------------------------------------------------------------
    def start(self, prompt_len: int, overrides: RequestOverrides) -> DepthRequest:
        self.seen += 1
        off = overrides.mode == "off"
        return DepthRequest(
            tag=overrides.request_tag or f"req{self.seen}",
            prompt_len=prompt_len,
            budget=overrides.depth_budget,
            off=off,
            thresholds=self.thresholds(1.0 if off else overrides.depth_budget),
        )

    def readout(self, p: int, h: mx.array) -> mx.array:
        """The calibrated readout ``a_p * RMSNorm(h) + b_p`` in float32."""
        x = h.astype(mx.float32)
        x = x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + self.layout.eps)
        return x * self.norm_a[p] + self.norm_b[p]

    def proxy_value(self, normed: mx.array) -> mx.array:
        """Per row: the low-rank entropy (nats) or the feature score of the proxy logits."""
        z = (normed @ self.v) @ self.u_t
        if self.profile.proxy == "feature":
            return feature_score(z, self.profile.temperature, self.profile.topk)
        return entropy_nats(z, self.profile.temperature)

    def decode(self, token: int, cache: list[Any], req: DepthRequest) -> mx.array:
        """One decode step of ``token`` (batch 1): logits ``[1, V]``; records the depth."""
        layout = self.layout
        t = len(req.depths)  # tokens generated before this step's (the prefill made one)
        prev = req.depths[-1] if req.depths else self.num_layers
        cap = self.schedule.cap(t, prev)
        floor = self.schedule.floor(t)
        th = req.thresholds
        h = layout.embed(mx.array([[token]]))
        out, depth = None, self.num_layers
        for i, layer in enumerate(layout.layers):
            h = layer(h, None, cache=cache[i])
            count = i + 1
            p = self.probe_index.get(count)
            if p is None:
                continue
            stop = count >= cap
            if not stop and not req.off and floor <= count and th[p] >= self.proxy_floor[p]:
                normed = self.readout(p, h[0])
                value = np.array(self.proxy_value(normed), dtype=np.float64)
                self.stats.probe_evals += 1
                stop = bool(self.rule.exits(value, th[p : p + 1], p)[0])
            if stop:
                out, depth = self.readout(p, h[0]), count
                break
        if out is None:
            logits = layout.head(layout.norm(h))[:, -1]
        else:
            logits = layout.head(out.astype(h.dtype)[None])[:, -1]
        req.depths.append(depth)
        self.stats.observe((depth,))
        return logits

    def prefilled(self, req: DepthRequest) -> None:
        """The prompt's last position made the first token at full depth."""
        req.depths.append(self.num_layers)

    def finish(self, req: DepthRequest) -> dict[str, Any]:
        rec = req.record(self.num_layers, self.budget)
        with self._lock:
            self.finished.append(rec)
            del self.finished[: -self.max_finished]
        if self.config.telemetry_path:
            with open(self.config.telemetry_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        return rec

    def telemetry(self) -> dict[str, Any]:
        return {
            "mechanism": "depth",
            "signal": ["emad"],
            "kv_strategy": "monotone",
            "num_layers": self.num_layers,
            "budget": self.budget,
            "budget_kind": self.profile.budget_kind,
            "probe_layers": self.profile.probe_layers,
            "proxy": self.profile.proxy,
            "proxy_rank": int(self.v.shape[1]),
            **self.stats.summary(),
            "finished": list(self.finished),
        }
