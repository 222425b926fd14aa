"""``mask`` (QuickSilver KV skipping, D-LLM): attention at layer ``l`` leaves out cached slots
whose depth record is ``<= l``; the plan finds the layer below which every cached slot of the
step is visible, and the masked attention backend (`attention/masked_backend.py`) reads the
record through `mask_context`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm_adaptive.depth.kv_strategies.base import KvStrategy, PlanDraft
from vllm_adaptive.depth.mask_context import StepMask

if TYPE_CHECKING:
    from vllm_adaptive.models.interface import ModelParts


class MaskStrategy(KvStrategy):
    name = "mask"
    needs_masked_attention = True
    model_needs = "masks slots in the plugin's attention backend, which has no sliding window"

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
        low = runtime.record.context_min(block_row, pos)
        self._see(runtime, draft, low)

    def plan_prefill(self, runtime: Any, draft: PlanDraft, row: int, low: int | None) -> None:
        # masked slots are left out by attention, nothing to cap
        self._see(runtime, draft, low)

    @staticmethod
    def _see(runtime: Any, draft: PlanDraft, low: int | None) -> None:
        L = runtime.num_layers
        draft.all_visible_below = min(draft.all_visible_below, low if low is not None else L)

    def step_mask(self, runtime: Any, plan: Any) -> StepMask | None:
        if plan.all_visible_below >= runtime.num_layers:
            if plan.fusion is not None:
                # fusion may mask this step's own slots from its layer on (runtime._peel
                # swaps in the query positions then); below it, vLLM's fused op
                return StepMask(runtime.record.depth, runtime.num_layers)
            return None
        runtime.counters.masked_steps += 1
        return StepMask(runtime.record.depth, plan.all_visible_below)
