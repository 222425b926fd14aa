"""``propagate`` (CALM): a token that stops after ``D`` blocks gets K/V at every later layer,
projected from its exit state through that layer's norm, K/V projection and rotary embedding
(`backfill.propagate_kv`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_adaptive.depth.backfill import propagate_kv
from vllm_adaptive.depth.kv_strategies.base import KvState, KvStrategy

if TYPE_CHECKING:
    from vllm_adaptive.models.interface import ModelParts


class PropagateStrategy(KvStrategy):
    name = "propagate"
    fills_every_layer = True
    model_needs = "recomputes K/V from exit states through the block recipe's attention"

    def exited(
        self,
        state: KvState,
        parts: ModelParts,
        stream: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        count: int,
    ) -> None:
        L = state.num_layers
        if count >= L:
            return
        have = torch.full((stream.shape[0],), count, dtype=torch.long, device=stream.device)
        state.counters.propagated_kv += propagate_kv(
            parts.layers, stream, slots, positions, have, L, state.attention.write_kv
        )
