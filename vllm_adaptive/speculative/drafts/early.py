"""Adapter-free early-layer drafts (LayerSkip's self-speculation, DEED): the first ``depth``
blocks of the target, then its final norm and LM head. The baseline M2R2's adapters must beat.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_adaptive.speculative.drafts.head import DraftHead


class EarlyLayersDraft:
    def __init__(self, model: Any, depth: int, head_precision: str = "full") -> None:
        parts = model.adaptive_parts()
        num_layers = parts.num_layers
        if depth >= num_layers:
            raise ValueError(
                f"adaptive.speculative.layers: {depth} >= the model's {num_layers} layers "
                "(a draft as deep as the target saves nothing)"
            )
        self.depth = depth
        self.head = DraftHead(model, head_precision)
        self.name = f"early{depth}"
        self.embed = parts.embed
        self.layers = [layer.block for layer in parts.layers[:depth]]
        self.norm = parts.final_norm

    def forward(self, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states of one draft position (rows = requests)."""
        hidden = self.embed(token_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def resident_bytes(self) -> int:
        return self.head.resident_bytes()
