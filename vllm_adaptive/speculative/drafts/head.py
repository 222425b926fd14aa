"""The draft's LM head: the model's own (tied) head at full precision or as a packed copy.

The head is the largest single matrix of a small model (49152 x 576 on the default one, as
much as 8 of its blocks), so a draft that runs few blocks spends much of its time here.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_adaptive.kernels.matmul import bound_kernel, choose_path_cached
from vllm_adaptive.kernels.packed import PackedWeight, quantize


class DraftHead:
    def __init__(self, model: Any, precision: str, group_size: int = 32, symmetric: bool = False):
        self.precision = precision
        self.vocab = int(model.config.vocab_size)
        self.packed: PackedWeight | None = None
        if precision != "full":
            w = model.lm_head.weight.detach()[: self.vocab]
            if precision == "int8":
                self.packed = quantize(w, 8, None, symmetric=True, check_double_quant=False)
            else:
                self.packed = quantize(
                    w, 4, group_size, symmetric=symmetric, check_double_quant=False
                )

    def logits(self, model: Any, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the vocabulary for final-normed ``hidden``."""
        if self.packed is None:
            return model.compute_logits(hidden)[:, : self.vocab]
        path = choose_path_cached(self.packed, hidden.shape[0], hidden.dtype)
        return bound_kernel(self.packed, path, hidden.dtype)(hidden.contiguous())

    def resident_bytes(self) -> int:
        if self.packed is None:
            return 0
        from vllm_adaptive.precision.tiers import packed_resident_bytes

        return packed_resident_bytes(self.packed)
