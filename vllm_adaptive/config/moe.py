"""The ``moe`` section: the MoEfied model's expert tiers and predictors."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from vllm_adaptive.config.base import (
    _Strict,
)


class MoeConfig(_Strict):
    """Expert offloading for a MoEfied model (docs/moe.md, issue 19): every expert's weights in
    a slow tier (a memory-mapped file whose pages are dropped on eviction), a fast tier of at
    most ``capacity`` of them, and a predictor that prefetches the next layers' experts.
    Without this section a MoEfied model keeps every expert resident (the reference)."""

    predictor: Literal["none", "pregate", "m2r2"] = "none"
    """"none": on-demand loads only; "pregate": layer j's router on layer l's MLP input
    (Pre-gated MoE) names the experts of layers l+1..l+lookahead ahead of time; "m2r2": layer
    j's router on trained adapters' estimate of layer j's residual (``m2r2_adapters``)."""
    m2r2_adapters: str | None = None
    """Directory of the "m2r2" predictor's adapters (`vllm-adaptive moe train-m2r2`); checked
    against the model, its top-k and the lookahead at engine start."""
    lookahead: int = Field(1, ge=1)
    """How many layers ahead the predictor prefetches (d)."""
    capacity: float | None = Field(None, gt=0.0, le=1.0)
    """Fast-tier size as a fraction of all experts (default 1.0: every expert fits)."""
    eviction: Literal["cyclic", "lru"] = "cyclic"
    """Fast-tier eviction: "cyclic" (the expert whose layer comes back last in the fixed layer
    order goes first: Belady's choice when a step's experts outgrow the tier), or "lru". Cyclic
    is the default because layers run in a cycle: LRU then evicts the layer needed next, and
    a predictor's prefetches made it reload every expert each step (docs/moe-runtime.md,
    "Eviction policy")."""
    fast_tier_bytes: int | None = Field(None, ge=1)
    """Fast-tier size in bytes (instead of ``capacity``)."""
    slow_tier_dir: str | None = None
    """Directory of the slow-tier file (written at load, removed at exit); default: a new
    temporary directory. Put it on a real disk: a tmpfs has no page cache to drop."""

    @model_validator(mode="after")
    def _check(self) -> MoeConfig:
        if self.capacity is not None and self.fast_tier_bytes is not None:
            raise ValueError('give "capacity" (a fraction) or "fast_tier_bytes", not both')
        if self.predictor == "none" and "lookahead" in self.model_fields_set:
            raise ValueError('"lookahead" is for a predictor; predictor "none" prefetches nothing')
        if self.predictor == "m2r2" and not self.m2r2_adapters:
            raise ValueError(
                'predictor "m2r2" needs "m2r2_adapters": a directory written by '
                "`vllm-adaptive moe train-m2r2`"
            )
        if self.predictor != "m2r2" and self.m2r2_adapters is not None:
            raise ValueError('"m2r2_adapters" is only for predictor "m2r2"')
        return self
