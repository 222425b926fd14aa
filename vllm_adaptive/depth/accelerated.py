"""M2R2's accelerated residual stream inside the depth runtime's layer loop (mechanism only).

The ARLA exit signal (`policies/arla.py`) decides at gate E_j from the accelerated states
``[p_{E_{j-1}}, ..., p_{E_j}]`` of the interval [E_{j-1}, E_j) (M2R2 sec. 2.1, A.1.2); a row that
exits there emits the final norm of ``p_{E_j}``. This module computes those states on vLLM's own
layer modules, for the decode rows that are exit candidates at E_j:

* **Re-initialisation.** At the start of the interval, before the slow stream runs block
  E_{j-1}, p starts from the slow residual stream h_{E_{j-1}} (vLLM's fused form ``h +
  residual``; the token embedding for E_0 = 0), as the adapter was trained
  (`vllm_adaptive.m2r2.reference.accelerated_stream`).
* **Blocks.** p runs blocks E_{j-1} .. E_j - 1 with the adapter's deltas on the query, the
  attention output and parallel to the MLP (`vllm_adaptive.m2r2.adapters`), one query token
  per row at its own position.
* **Shared KV cache (A.1.4).** Attention reads the paged cache through one-token CPU attention
  metadata for the rows (`StepAttention.one_token`): earlier positions hold
  the slow stream's K/V, and the token's own K/V, computed from p, are written into the token's own
  slot at that layer before it is read: ``MHA(p_t, h_<t (+) p_t)``.

Why p must run BEFORE the slow stream of the interval, never after. p's own K/V land in the
token's slots at layers E_{j-1} .. E_j - 1, the same slots the slow stream uses. Every row p is
computed for is an exit candidate at E_j, so (with ARLA deciding alone, it exits nowhere
else; a row at its cap below E_j is not a candidate) it then runs the slow stream through the
same blocks, and vLLM's attention writes the slow K/V into the slot before it reads, so when
the interval is over the cache holds the slow stream's K/V there, which is what later tokens
must attend to (the M2R2 cache holds the slow stream only). Run after, p would leave its own K/V
in the cache. Should a row ever drop out inside the interval (a future combined signal exiting
at a non-gate probe), the slots it leaves holding p's K/V are at layers above its recorded
depth: never read under "monotone" and "mask", rewritten by "propagate", by "recompute"'s
resume and by a refresh's backfill before anything reads them. The runtime's other steps
(`_resume`, backfill) run before the layer loop, so nothing else writes these slots meanwhile.

Cost: the candidates run each interval's blocks twice (slow and accelerated), sequentially;
the paper overlaps the two streams with attention masking, which a CPU gains nothing from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_adaptive.depth.attention_port import LayerSwaps, StepAttention
from vllm_adaptive.m2r2.adapters import M2R2Adapters

if TYPE_CHECKING:
    from vllm_adaptive.models.interface import LayerParts


@dataclass(frozen=True)
class AdapterDeltas:
    """Adapter ``index``'s corrections inside its block (:class:`BlockDeltas`)."""

    adapters: M2R2Adapters
    index: int

    def q(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapters.delta_q(self.index, x)

    def o(self, attn_out: torch.Tensor) -> torch.Tensor:
        return self.adapters.delta_o(self.index, attn_out)

    def mlp(self, y: torch.Tensor) -> torch.Tensor:
        return self.adapters.delta_mlp(self.index, y)


def accelerated_block(
    layer: LayerParts, adapters: M2R2Adapters, i: int, positions: torch.Tensor, p: torch.Tensor
) -> torch.Tensor:
    """Block ``i`` on the accelerated stream (unfused residual) plus adapter ``i``'s deltas,
    through the layer's recipe; attention uses the installed forward context."""
    return layer.recipe.run_accelerated(layer, AdapterDeltas(adapters, i), positions, p)


@dataclass
class AcceleratedStash:
    """The accelerated states of one interval for the rows they were computed for."""

    gate_index: int  # j: the router at gates[j] reads them
    gate: int  # E_j
    rows: torch.Tensor  # [n] int64 step rows, ascending (CPU)
    states: torch.Tensor  # [n, S, d]: p_{E_{j-1}}, p after block E_{j-1}, ..., p_{E_j}

    def states_for(self, rows: torch.Tensor) -> torch.Tensor:
        """States of ``rows`` (ascending, a subset of the stash's rows), [m, S, d]."""
        idx = torch.searchsorted(self.rows, rows)
        if bool((idx >= self.rows.numel()).any()) or not torch.equal(self.rows[idx], rows):
            raise RuntimeError(
                f"ARLA candidates at gate {self.gate} have no accelerated states: the interval "
                "started with another candidate set"
            )
        return self.states[idx.to(self.states.device)]


class AcceleratedStream:
    """Runs an exit-mode adapter's accelerated stream for subsets of the step's decode rows."""

    def __init__(self, adapters: M2R2Adapters) -> None:
        cfg = adapters.config
        if cfg.mode != "exit":
            raise ValueError(f"the accelerated stream needs an exit-mode adapter, not {cfg.mode}")
        # float32 like training: the deltas are rank-r matmuls, negligible next to a block
        self.adapters = adapters.float().eval().requires_grad_(False)
        self.gates: tuple[int, ...] = tuple(cfg.gates)
        self.intervals: list[tuple[int, int]] = cfg.intervals
        self._by_start = {start: j for j, (start, _) in enumerate(self.intervals)}

    def to(self, device: torch.device) -> AcceleratedStream:
        self.adapters.to(device)
        return self

    def interval_starting_at(self, block: int) -> tuple[int, int, int] | None:
        """(j, E_{j-1}, E_j) when 0-based ``block`` is E_{j-1}, the first block of interval j."""
        j = self._by_start.get(block)
        return None if j is None else (j, *self.intervals[j])

    def run(
        self,
        layers: Sequence[LayerParts],
        swaps: LayerSwaps,
        md: Any,
        attention: StepAttention,
        gate_index: int,
        rows: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        stream: torch.Tensor,
    ) -> AcceleratedStash:
        """Interval ``gate_index`` for step rows ``rows`` (ascending) of the step's metadata
        ``md``, one token each at ``positions`` with KV slots ``slots``, from the slow stream
        ``stream`` [n, d]. ``swaps`` holds the step's per-layer metadata: the one-token metadata is
        installed for the interval's layers and what was there is put back afterwards."""
        start, stop = self.intervals[gate_index]
        sub = attention.one_token(md, rows, positions + 1, slots)
        p = stream
        states = [p]
        with swaps.installed_between(sub, start, stop):
            for i in range(start, stop):
                p = accelerated_block(layers[i], self.adapters, i, positions, p)
                states.append(p)
        return AcceleratedStash(gate_index, stop, rows.cpu(), torch.stack(states, dim=1))
