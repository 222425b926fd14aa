"""What the depth mechanisms need of the engine's attention, as a protocol the engine glue
implements (`engine/attention_metadata.CpuStepAttention`).

The layer loop runs a subset of the step's rows (depth-peeling), the tokens fusion kept, or one
query per row for tokens that are not this step's (recompute, ARLA's accelerated stream,
backfill); each needs attention metadata of its own, installed for some of the layers, and K/V
written outside an attention call. The mechanisms ask for those here and never read or rewrite
vLLM's objects themselves, so `depth/` imports nothing of vLLM or of the glue.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class CacheGeometry:
    """The paged KV cache the depth record and exit-state store sit next to."""

    num_blocks: int
    block_size: int
    device: torch.device

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


class LayerSwaps(Protocol):
    """This step's per-layer attention metadata, which the layer loop replaces from a layer on
    (the rows still running, the tokens fusion kept); restored when the step ends."""

    def install(self, md: Any, from_layer: int) -> None:
        """Use ``md`` for layers ``from_layer`` onwards."""

    def installed_between(self, md: Any, start: int, stop: int) -> AbstractContextManager[None]:
        """Use ``md`` for layers ``start .. stop - 1`` inside the block, then put back what
        they had."""


class StepAttention(Protocol):
    """The engine's attention, as the depth mechanisms use it. ``md`` is the step's attention
    metadata (or one derived from it here); ``rows`` index its requests, ascending."""

    def bind(self, attn: Any) -> CacheGeometry | None:
        """The KV cache of ``attn`` (the first layer's attention) once it exists; None while it
        does not (vLLM's profiling run) or for a backend the mechanisms cannot drive."""

    def subset(self, md: Any, rows: torch.Tensor) -> Any:
        """Metadata for requests ``rows`` of ``md`` (depth-peeling)."""

    def fused(self, md: Any, counts: torch.Tensor, keep: torch.Tensor) -> Any:
        """Metadata for the same requests with only the tokens ``keep`` left, ``counts`` per
        request (token fusion)."""

    def one_token(
        self, md: Any, rows: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor
    ) -> Any:
        """One query per row of ``rows``, attending to ``seq_lens`` positions, its K/V written to
        ``slots`` (tokens that are not this step's)."""

    def layer_swaps(self) -> AbstractContextManager[LayerSwaps]:
        """Lets the layer loop swap per-layer metadata for this step."""

    def write_kv(self, attn: Any, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write K/V (``[n, kv_heads, head_size]``) into ``attn``'s paged cache at ``slots``."""


def token_index(query_start_loc: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Token indices (in the step's order) of request ``rows``."""
    starts, ends = query_start_loc[rows], query_start_loc[rows + 1]
    counts = (ends - starts).long()
    base = torch.repeat_interleave(starts.long(), counts)
    offsets = torch.arange(int(counts.sum()), device=rows.device) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts
    )
    return base + offsets
