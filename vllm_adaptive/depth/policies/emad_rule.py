"""EMAD's exit rule on per-row proxy values, framework-neutral (numpy in, bool mask out).

The proxy logits ``U V^T n`` are computed by whichever framework runs the model (torch in the
vLLM runtime, MLX in ``vllm_adaptive/metal_backend``); what they reduce to per row, the
low-rank entropy or the feature score, comes here as a numpy array, and so do the thresholds.
The feature proxy's isotonic map is calibration's own `IsotonicMap`, so the runtime decides on
exactly the entropy estimate the profile's thresholds were simulated with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from vllm_adaptive.depth.isotonic import IsotonicMap

PROXIES = ("lowrank", "feature")


class EmadRule:
    """``exits(values, thresholds, probe)``: proxy entropy (nats) <= the row's threshold."""

    def __init__(self, proxy: str, feature_knots: Sequence[tuple[Any, Any]] | None = None):
        if proxy not in PROXIES:
            raise ValueError(f"unknown EMAD proxy {proxy!r}")
        if proxy == "feature" and not feature_knots:
            raise ValueError("the feature proxy needs the profile's isotonic knots")
        self.proxy = proxy
        self.maps = [
            IsotonicMap(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64))
            for x, y in feature_knots or []
        ]

    def entropy(self, values: np.ndarray, probe: int) -> np.ndarray:
        """Proxy entropy in nats: the low-rank entropy as is, the feature score mapped."""
        if self.proxy == "feature":
            return self.maps[probe](values)
        return np.asarray(values, dtype=np.float64)

    def exits(self, values: np.ndarray, thresholds: np.ndarray, probe: int) -> np.ndarray:
        """Bool per row: proxy entropy <= that row's threshold (tau_l - m_l)."""
        return self.entropy(values, probe) <= np.asarray(thresholds, dtype=np.float64)
