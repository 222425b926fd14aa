"""``monotone`` (EMAD): a decode token runs no deeper than the token before it, so no token
ever reads a layer an earlier token skipped; ``refresh`` raises the cap and backfills."""

from __future__ import annotations

from typing import Any

import torch

from vllm_adaptive.depth.kv_strategies.base import KvStrategy, PlanDraft


class MonotoneStrategy(KvStrategy):
    name = "monotone"

    def plan_decode(
        self,
        runtime: Any,
        model: Any,
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
            c = runtime._refresh(model, block_row, pos, c)
        draft.cap[row] = c
