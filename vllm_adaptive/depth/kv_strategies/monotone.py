"""``monotone`` (EMAD): a decode token runs no deeper than the token before it, so no token
ever reads a layer an earlier token skipped; ``refresh`` raises the cap and backfills."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm_adaptive.depth.kv_strategies.base import KvStrategy, PlanDraft

if TYPE_CHECKING:
    from vllm_adaptive.models.interface import ModelParts


class MonotoneStrategy(KvStrategy):
    name = "monotone"

    def plan_decode(
        self,
        runtime: Any,
        parts: ModelParts,
        draft: PlanDraft,
        row: int,
        block_row: torch.Tensor,
        pos: int,
        t: int,
    ) -> None:
        record = runtime.record
        prev = int(record.read(record.slots(block_row, torch.tensor([pos - 1]))).item())
        if prev <= 0:
            runtime.warn_once("prev0", "vllm-adaptive depth: unrecorded previous slot")
            prev = runtime.num_layers
        c = runtime.schedule.cap(t, prev)
        if c > prev:
            c = runtime._refresh(parts, block_row, pos, c)
        draft.cap[row] = c
