"""M2R2's ARLA router (appendix A.1.2) as an exit signal.

At gate E_j (the adapter's ``gates``, 1-based layer counts) a row exits when the router's exit
probability over its accelerated states ``[p_{E_{j-1}}, ..., p_{E_j}]`` is above ``threshold``.
The router was trained (BCE) to predict "the gate's accelerated argmax equals the full model's
greedy token", so ``threshold`` trades agreement for depth. It never exits at other probe
layers: there is no accelerated state there (the stream is re-initialised at every gate).

What the runtime must pass in `ProbeBatch`: ``accelerated`` ([n, S, d], S = E_j - E_{j-1} + 1)
at gate layers, computed by `vllm_adaptive.depth.accelerated`. A row that exits here emits the
final norm of ``accelerated[:, -1]`` (the runtime's business, like every emission).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from vllm_adaptive.depth.policies.probe import ProbeBatch


class ArlaExitSignal:
    """P(exit) > threshold at the gates, per row."""

    per_row = True
    needs_prev_stream = False
    needs_token_ids = False

    def __init__(self, routers: Sequence[nn.Module], gates: Sequence[int], threshold: float):
        if len(routers) != len(gates):
            raise ValueError(f"{len(routers)} ARLA routers for {len(gates)} gates")
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"ARLA threshold is a probability in (0, 1), not {threshold}")
        self.routers = nn.ModuleList(routers).float().eval().requires_grad_(False)
        self.gates = tuple(int(g) for g in gates)
        self.starts = (0, *self.gates[:-1])
        self.threshold = float(threshold)
        self._index = {g: j for j, g in enumerate(self.gates)}

    def to(self, device: torch.device) -> ArlaExitSignal:
        self.routers.to(device)
        return self

    def gate_index(self, layer: int) -> int | None:
        """j with gates[j] == layer, or None for a layer that is no gate."""
        return self._index.get(layer)

    def exit_probability(self, gate_index: int, states: torch.Tensor) -> torch.Tensor:
        """P(exit) per row from accelerated states [n, S, d] at gate ``gates[gate_index]``."""
        want = self.gates[gate_index] - self.starts[gate_index] + 1
        if states.dim() != 3 or states.shape[1] != want:
            raise ValueError(
                f"ARLA at gate {self.gates[gate_index]} reads {want} states per row "
                f"(E_(j-1) .. E_j), got {tuple(states.shape)}"
            )
        return self.routers[gate_index].exit_probability(states)

    def exit_mask(self, batch: ProbeBatch) -> torch.Tensor:
        n = batch.rows
        device = batch.stream.device
        j = self.gate_index(batch.layer)
        if n == 0 or j is None:
            return torch.zeros(n, dtype=torch.bool, device=device)
        if batch.accelerated is None:
            raise ValueError(f"ARLA needs the accelerated states at gate {batch.layer}")
        return (self.exit_probability(j, batch.accelerated) > self.threshold).to(device)
