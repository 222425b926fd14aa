"""The per-slot depth record: for every slot of the paged KV cache, how many layers' K/V
were written for the token in it (0: nothing yet).

It lives next to the KV cache (same slot indexing) and is the ground truth the schedule
reads: a decode token's previous depth D_{t-1} is the record of the slot before it, and a
prefill that attends to cached slots (prefix-cache hits, earlier chunks, a resumed request)
may not run deeper than the shallowest of them.
"""

from __future__ import annotations

import torch


class SlotDepthRecord:
    def __init__(self, num_slots: int, block_size: int, device: torch.device | str = "cpu"):
        self.block_size = block_size
        self.depth = torch.zeros(num_slots, dtype=torch.int16, device=device)

    @property
    def num_slots(self) -> int:
        return int(self.depth.shape[0])

    def slots(self, block_row: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slots of ``positions`` for one request given its block-table row."""
        blocks = block_row[positions // self.block_size].long()
        return blocks * self.block_size + positions % self.block_size

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        return self.depth[slots.long()]

    def write(self, slots: torch.Tensor, depths: torch.Tensor | int) -> None:
        if isinstance(depths, int):
            self.depth[slots.long()] = depths
        else:
            self.depth[slots.long()] = depths.to(self.depth.dtype)

    def context_min(self, block_row: torch.Tensor, num_context: int) -> int | None:
        """Shallowest record over positions ``[0, num_context)``; None when empty."""
        if num_context <= 0:
            return None
        pos = torch.arange(num_context, device=block_row.device)
        return int(self.read(self.slots(block_row, pos)).min())
