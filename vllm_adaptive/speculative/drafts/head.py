"""The draft's LM head: the model's own (tied) head at full precision or as a packed copy.

The head is the largest single matrix of a small model (49152 x 576 on the default one, as
much as 8 of its blocks), so a draft that runs few blocks spends much of its time here.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_adaptive.kernels.packed import PackedWeight
from vllm_adaptive.kernels.weights import Weight, autotune_weight, linear, quantize_weight


class DraftHead:
    def __init__(self, model: Any, precision: str, group_size: int = 32, symmetric: bool = False):
        self.precision = precision
        parts = model.adaptive_parts()
        self.vocab = parts.vocab_size
        self.packed: Weight | None = None
        if precision != "full":
            w = parts.head.weight.detach()[: self.vocab]
            self.packed = quantize_weight(w, precision, group_size, symmetric)
            autotune_weight(self.packed)

    def logits(self, model: Any, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the vocabulary for final-normed ``hidden``."""
        if self.packed is None:
            return model.draft_logits(hidden)[:, : self.vocab]
        return linear(self.packed, hidden)

    def resident_bytes(self) -> int:
        if self.packed is None:
            return 0
        from vllm_adaptive.precision.tiers import packed_resident_bytes

        if isinstance(self.packed, PackedWeight):
            return packed_resident_bytes(self.packed)
        return self.packed.resident_bytes()
