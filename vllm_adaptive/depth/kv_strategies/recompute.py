"""``recompute`` (EE-LLM batching recompute): every exited token's exit state is stored; at the
next step, before the current tokens run, each decode row's previous token continues from it
through the blocks it skipped, so its K/V exist at every layer when the current token attends."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm_adaptive.depth.attention_port import LayerSwaps
from vllm_adaptive.depth.kv_strategies.base import KvState, KvStrategy, PlanDraft
from vllm_adaptive.depth.step import StepPlan

if TYPE_CHECKING:
    from vllm_adaptive.models.interface import ModelParts


class RecomputeStrategy(KvStrategy):
    name = "recompute"
    runs_blocks = True
    model_needs = "resumes exited tokens through the model's own blocks"
    stores_exit_states = True

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
        slot = record.slots(block_row, torch.tensor([pos - 1]))
        d = int(record.read(slot).item())
        if 0 < d < state.num_layers:
            draft.resume.append((row, pos - 1, int(slot.item()), d))

    def before_layers(
        self, state: KvState, parts: ModelParts, swaps: LayerSwaps, md: Any, plan: StepPlan
    ) -> None:
        if plan.resume:
            resume(state, parts, swaps, md, plan.resume)


def resume(state: KvState, parts: ModelParts, swaps: LayerSwaps, md: Any, items: list) -> None:
    """Each decode row's previous token, which exited after ``d`` blocks, continues from its
    stored exit state through blocks ``d+1 .. L`` with full attention. Rows join the batch at
    their own layer. ``items``: (row, position, slot, depth) per token."""
    store, record = state.store, state.record
    assert store is not None, "recompute keeps exit states"
    L = state.num_layers
    dev = md.slot_mapping.device
    rows = torch.tensor([it[0] for it in items])
    pos = torch.tensor([it[1] for it in items], device=dev)
    slots = torch.tensor([it[2] for it in items], device=dev)
    d = torch.tensor([it[3] for it in items])
    states = store.state[slots.long()]
    active = torch.zeros(len(items), dtype=torch.bool)
    h = res = None
    for i in range(int(d.min()), L):
        join = d == i
        if bool(join.any()):
            was = active.clone()
            active |= join
            idx = torch.nonzero(active).squeeze(1)
            h_new = torch.empty(idx.numel(), states.shape[1], dtype=states.dtype, device=dev)
            r_new = torch.zeros_like(h_new)
            joined = join[idx].to(dev)
            h_new[joined] = states[join.to(dev)]  # stream as h, zero residual: same sum
            if h is not None:
                kept = was[idx].to(dev)
                h_new[kept], r_new[kept] = h, res
            h, res = h_new, r_new
            sub = state.attention.one_token(md, rows[idx], pos[idx.to(dev)] + 1, slots[idx.to(dev)])
            swaps.install(sub, i)
        h, res = parts.layers[i].run_block(pos[active.to(dev)], h, res)
        state.counters.recomputed_kv += int(active.sum())
    swaps.install(md, 0)
    record.write(slots, L)
