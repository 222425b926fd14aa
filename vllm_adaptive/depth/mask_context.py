"""The per-step handoff between the depth runtime and the KV-skipping attention backend.

Under the ``mask`` KV strategy the attention backend
(``vllm_adaptive/attention/masked_backend.py``) must leave out, at layer ``l``, every cached slot
whose depth record is ``<= l``. The record belongs to the depth runtime; the backend holds no
engine state. The runtime publishes the record for the step around its layer loop::

    with publish_mask(StepMask(record=runtime.record.depth, all_visible_below=lo)):
        ...  # run the layers

and the backend reads :func:`current_mask` at every attention call. ``all_visible_below`` is the
shallowest record over every cached slot the step's requests attend to: below that layer every
cached slot is visible, so the backend runs vLLM's fused CPU op there (2-11x faster than the
torch masked path); at and above it, the masked path.

The state is a module global (not a ``ContextVar``) so that it is visible from whichever thread
runs the attention op; :func:`publish_mask` restores the previous value on exit, so nesting and
exceptions leave it as it was. It is read inside vLLM's opaque attention custom op; publish it
outside any region torch.compile traces (a value read while tracing would be baked into the graph).

:func:`mask_stats` counts what the backend did (telemetry, and tests proving the masked path ran).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class StepMask:
    """The depth mask of one step.

    ``record``: the per-slot depth record, int ``[num_blocks * block_size]`` indexed by slot
    (``block * block_size + offset``): how many layers' K/V were written for the token in the slot
    (committed at the end of each step; this step's own slots are never read).
    ``all_visible_below``: layers ``< all_visible_below`` see every cached slot of the step's
    requests, so the backend uses vLLM's fused op there.
    ``query_positions``: set once token fusion has removed rows inside a request (from the
    fusion layer on): the position of each query of the attention call, in the call's token
    order. The backend then runs the masked path at every layer, with the record applied to this
    step's own keys too (the runtime wrote a provisional record for them before the layers).
    """

    record: torch.Tensor
    all_visible_below: int
    query_positions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        rec = self.record
        if not isinstance(rec, torch.Tensor) or rec.dim() != 1:
            raise ValueError("StepMask.record must be a 1-D tensor indexed by KV-cache slot")
        if rec.dtype.is_floating_point or rec.dtype.is_complex or rec.dtype == torch.bool:
            raise ValueError(f"StepMask.record must be an integer tensor, got {rec.dtype}")
        if isinstance(self.all_visible_below, bool) or not isinstance(self.all_visible_below, int):
            raise ValueError("StepMask.all_visible_below must be an int (a layer count)")


_CURRENT: StepMask | None = None


def current_mask() -> StepMask | None:
    """The mask published for the running step, or None (attention is unmasked)."""
    return _CURRENT


@contextmanager
def publish_mask(mask: StepMask | None) -> Iterator[None]:
    """Make ``mask`` the current mask inside the block (None: no mask); restores the previous
    value afterwards, also on exceptions."""
    global _CURRENT
    if mask is not None and not isinstance(mask, StepMask):
        raise TypeError(f"publish_mask takes a StepMask or None, got {type(mask).__name__}")
    previous = _CURRENT
    _CURRENT = mask
    try:
        yield
    finally:
        _CURRENT = previous


def replace_mask(mask: StepMask) -> None:
    """Swap the current mask inside a :func:`publish_mask` block (which restores the value it
    found on exit): the layer loop does this when fusion changes the step's queries."""
    global _CURRENT
    if not isinstance(mask, StepMask):
        raise TypeError(f"replace_mask takes a StepMask, got {type(mask).__name__}")
    if _CURRENT is None:
        raise RuntimeError("replace_mask outside a publish_mask block")
    _CURRENT = mask


class MaskStats:
    """Attention calls of the masked backend, by path.

    ``masked``: calls that ran the torch masked path (a mask was published and the layer is at or
    above ``all_visible_below``); ``fused``: calls under a published mask that ran vLLM's fused op
    because the mask is all-visible at that layer; ``unmasked``: calls with no mask published
    (vLLM's fused op). Warm-up calls without metadata are not counted.
    """

    __slots__ = ("masked", "fused", "unmasked")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.masked = 0
        self.fused = 0
        self.unmasked = 0

    def as_dict(self) -> dict[str, int]:
        return {"masked": self.masked, "fused": self.fused, "unmasked": self.unmasked}


STATS = MaskStats()


def mask_stats() -> dict[str, int]:
    """Counts since the last :func:`reset_mask_stats` (see :class:`MaskStats`)."""
    return STATS.as_dict()


def reset_mask_stats() -> None:
    STATS.reset()


__all__ = [
    "STATS",
    "MaskStats",
    "StepMask",
    "current_mask",
    "mask_stats",
    "publish_mask",
    "replace_mask",
    "reset_mask_stats",
]
