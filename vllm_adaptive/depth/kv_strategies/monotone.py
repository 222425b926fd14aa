"""``monotone`` (EMAD): a decode token runs no deeper than the token before it, so no token
ever reads a layer an earlier token skipped; ``refresh`` raises the cap and backfills."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_adaptive.depth.backfill import backfill
from vllm_adaptive.depth.kv_strategies.base import KvState, KvStrategy, PlanDraft

if TYPE_CHECKING:
    from vllm_adaptive.models.interface import ModelParts


class MonotoneStrategy(KvStrategy):
    name = "monotone"

    def plan_decode(
        self,
        state: KvState,
        parts: ModelParts,
        draft: PlanDraft,
        row: int,
        block_row: torch.Tensor,
        pos: int,
        t: int,
    ) -> None:
        record = state.record
        prev = int(record.read(record.slots(block_row, torch.tensor([pos - 1]))).item())
        if prev <= 0:
            state.warn_once("prev0", "vllm-adaptive depth: unrecorded previous slot")
            prev = state.num_layers
        cap = state.schedule.cap(t, prev)
        if cap > prev:
            cap = refresh(state, parts, block_row, pos, cap)
        draft.cap[row] = cap


def refresh(state: KvState, parts: ModelParts, block_row: torch.Tensor, p: int, cap: int) -> int:
    """Backfill K/V of positions [0, p) up to ``cap`` layers, returning the new cap; the old
    one when the exit states needed are not stored."""
    record, store = state.record, state.store
    if store is None:
        return int(record.read(record.slots(block_row, torch.tensor([p - 1]))).item())
    pos = torch.arange(p, device=block_row.device)
    slots = record.slots(block_row, pos)
    state.counters.backfilled_kv += backfill(
        parts.layers, record, store, slots, pos, cap, state.attention.write_kv
    )
    return cap
