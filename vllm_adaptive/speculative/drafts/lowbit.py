"""Low-precision self-drafts: every block of the target with packed int8 / int4 copies of its
own linear weights (the precision issue's formats and kernels), its own norms, rotary embedding
and attention modules, and its KV cache. The full-precision model verifies.

On this project's CPU a one-token int4 / int8 matmul with bfloat16 activations is about 3x
faster than the bf16 one, while verifying k+1 tokens costs about as much as one, which is what
makes this draft the likeliest lossless speed-up here. With float32 activations the packed
kernels have no fast path (docs/packed-kernels.md) and the draft is slower than the target.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm_adaptive.config import SpeculativeConfig
from vllm_adaptive.depth.exit_river import ExitRiver
from vllm_adaptive.speculative.drafts.head import DraftHead

logger = logging.getLogger("vllm.adaptive.speculative")


class LowBitDraft:
    def __init__(self, model: Any, settings: SpeculativeConfig) -> None:
        parts = model.adaptive_parts()
        layers = parts.layers
        # ExitRiver holds packed copies of blocks entry..L-1 and runs a block with them while
        # sharing the backbone's norms, rotary and attention: entry 0 is the whole model.
        precision = settings.draft_precision
        self.copies = ExitRiver(
            layers, 0, settings.group_size, settings.symmetric, precision=precision
        )
        self.head = DraftHead(
            model, settings.head_precision, settings.group_size, settings.symmetric
        )
        self.name = f"lowbit-{self.copies.quantizer}"
        if parts.head.weight.dtype == torch.float32 and precision in ("int8", "int4"):
            logger.warning(
                "vllm-adaptive speculative: float32 model: weight-only packed kernels have no fast "
                "float32 path on CPU, so the %s draft is slower than the model itself (use "
                "precision w8a8 or fp16, or bfloat16)",
                self.copies.quantizer,
            )
        self.embed = parts.embed
        self.blocks = list(zip(layers, self.copies.river_ops(layers), strict=True))
        self.norm = parts.final_norm

    def forward(self, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states of one draft position (rows = requests)."""
        hidden = self.embed(token_ids)
        residual = None
        for layer, linears in self.blocks:
            hidden, residual = layer.recipe.run_with(layer, linears, positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def resident_bytes(self) -> int:
        return self.copies.resident_bytes() + self.head.resident_bytes()
