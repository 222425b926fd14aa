"""``mask`` (QuickSilver KV skipping, D-LLM): attention at layer ``l`` leaves out cached slots
whose depth record is ``<= l``; the plan finds the layer below which every cached slot of the
step is visible, and the masked attention backend (`attention/masked_backend.py`) reads the
record through `mask_context`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_adaptive.depth.kv_strategies.base import KvState, KvStrategy, PlanDraft
from vllm_adaptive.depth.mask_context import StepMask
from vllm_adaptive.depth.step import StepPlan

if TYPE_CHECKING:
    from vllm_adaptive.models.interface import ModelParts


class MaskStrategy(KvStrategy):
    name = "mask"
    needs_masked_attention = True
    model_needs = "masks slots in the plugin's attention backend"

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
        self._see(state, draft, state.record.context_min(block_row, pos))

    def plan_prefill(self, state: KvState, draft: PlanDraft, row: int, low: int | None) -> None:
        # masked slots are left out by attention, nothing to cap
        self._see(state, draft, low)

    @staticmethod
    def _see(state: KvState, draft: PlanDraft, low: int | None) -> None:
        L = state.num_layers
        draft.all_visible_below = min(draft.all_visible_below, low if low is not None else L)

    def step_mask(self, state: KvState, plan: StepPlan) -> StepMask | None:
        L = state.num_layers
        if plan.all_visible_below >= L:
            if plan.fusion is not None:
                # fusion may mask this step's own slots from its layer on (the layer loop
                # publishes the query positions then); below it, vLLM's fused op
                return StepMask(state.record.depth, L)
            return None
        state.counters.masked_steps += 1
        return StepMask(state.record.depth, plan.all_visible_below)
