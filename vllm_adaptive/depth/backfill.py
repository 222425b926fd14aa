"""K/V by state propagation (CALM): for the `propagate` KV strategy and windowed refresh.

When a refresh lets a token run deeper than earlier tokens did, the earlier tokens have no
K/V at the extra layers. Each of them stored its exit state (the residual stream where it
stopped); for every missing layer l its K/V are made from that state through layer l's own
input norm, K/V projection and rotary embedding, and written into the same paged-cache slots
the backbone would have used. The depth record then says those layers are written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from vllm_adaptive.depth.record import SlotDepthRecord

#: writes K/V ``[n, kv_heads, head_size]`` into an attention layer's paged cache at slots
#: (`attention_port.StepAttention.write_kv`)
WriteKv = Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor], None]

if TYPE_CHECKING:
    from vllm_adaptive.models.interface import LayerParts


class ExitStateStore:
    """The residual stream of every token that stopped before the last layer, per cache slot."""

    def __init__(self, num_slots: int, hidden: int, dtype: torch.dtype, device) -> None:
        self.state = torch.zeros(num_slots, hidden, dtype=dtype, device=device)

    def write(self, slots: torch.Tensor, stream: torch.Tensor) -> None:
        self.state[slots.long()] = stream.to(self.state.dtype)


@torch.inference_mode()
def propagate_kv(
    layers: Sequence[LayerParts],
    states: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    have: torch.Tensor,
    target_depth: int,
    write_kv: WriteKv,
) -> int:
    """Write K/V of layers ``have[i] .. target_depth-1`` for token i from its exit state
    ``states[i]`` (the residual stream it stopped with) into its cache slot ``slots[i]``.

    The `propagate` KV strategy calls it right after tokens exit; windowed refresh calls it
    (through `backfill`) for earlier tokens. Returns the number of (token, layer) pairs."""
    written = 0
    if have.numel() == 0:
        return 0
    for layer_index in range(int(have.min()), target_depth):
        sel = have <= layer_index
        layer = layers[layer_index]
        k, v = layer.require_recipe("state propagation").kv_from_state(
            layer, states[sel], positions[sel]
        )
        attn = layer.attn
        k = k.reshape(-1, attn.num_kv_heads, attn.head_size)
        v = v.reshape(-1, attn.num_kv_heads, attn.head_size)
        write_kv(attn, k, v, slots[sel])
        written += int(sel.sum())
    return written


@torch.inference_mode()
def backfill(
    layers: Sequence[LayerParts],
    record: SlotDepthRecord,
    store: ExitStateStore,
    slots: torch.Tensor,
    positions: torch.Tensor,
    target_depth: int,
    write_kv: WriteKv,
) -> int:
    """Give ``slots`` (holding tokens at ``positions``) K/V up to ``target_depth`` layers.

    Returns the number of (token, layer) K/V pairs written.
    """
    have = record.read(slots).long()
    need = have < target_depth
    if not bool(need.any()):
        return 0
    slots, positions, have = slots[need], positions[need], have[need]
    states = store.state[slots.long()]
    written = propagate_kv(layers, states, slots, positions, have, target_depth, write_kv)
    record.write(slots, target_depth)
    return written
