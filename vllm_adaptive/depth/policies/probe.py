"""What an exit signal is given at a probe layer, and the interface every signal implements.

The runtime builds one `ProbeBatch` per probe layer for its candidate rows (decode rows that
may exit there: exits on for the request, floor <= layer < cap) and asks the signal for a bool
mask. Signals see tensors only; they hold no KV, batch or schedule logic, so the same signal
runs in the runtime and, on collected arrays, in the calibration's exit simulator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class ProbeBatch:
    """Candidate rows at one probe layer (n rows, hidden size d).

    ``stream`` is the residual stream after block ``layer`` (in vLLM's fused-residual form
    ``h + residual``); ``prev_stream`` the residual stream entering block ``layer`` (after block
    ``layer - 1``; the embeddings for layer 1), i.e. consecutive layers whatever the spacing of
    the probe layers. ``readout`` maps stream rows to the profile's calibrated readout at this
    probe (``a_l * RMSNorm(h) + b_l``), the hidden state the runtime emits if the row exits.
    ``accelerated``: M2R2's accelerated residual states of the interval ending here, for the
    ARLA signal at its gates only (`vllm_adaptive/depth/accelerated.py`); None elsewhere.
    """

    layer: int  # blocks run so far (1-based), the depth a row exiting here ends at
    probe: int  # index of ``layer`` in the profile's probe layers
    stream: torch.Tensor  # [n, d]
    prev_stream: torch.Tensor | None = None  # [n, d]; signals with needs_prev_stream need it
    token_ids: torch.Tensor | None = None  # [n] int64: the input token each row is processing
    readout: Callable[[torch.Tensor], torch.Tensor] | None = None  # [m, d] -> [m, d]
    thresholds: torch.Tensor | None = None  # [n] EMAD's per-row thresholds (from the budget)
    forced_halt: torch.Tensor | None = None  # [n] bool: the runtime forces these rows to halt
    accelerated: torch.Tensor | None = None  # [n, S, d]: p_{E_(j-1)} .. p_{E_j} (ARLA gates)

    @property
    def rows(self) -> int:
        return int(self.stream.shape[0])

    def select(self, index: torch.Tensor) -> ProbeBatch:
        """The same probe restricted to rows ``index`` (what combinators short-circuit with)."""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index.to(t.device)]

        return ProbeBatch(
            layer=self.layer,
            probe=self.probe,
            stream=self.stream[index.to(self.stream.device)],
            prev_stream=pick(self.prev_stream),
            token_ids=pick(self.token_ids),
            readout=self.readout,
            thresholds=pick(self.thresholds),
            forced_halt=pick(self.forced_halt),
            accelerated=pick(self.accelerated),
        )


class ExitSignal(Protocol):
    """An exit rule: ``exit_mask(batch)`` is True for rows that may stop at ``batch.layer``.

    ``per_row``: a row's decision depends on that row only (False for River's batch minimum,
    whose decision couples all rows, so combinators must hand it the whole batch).
    ``needs_prev_stream`` / ``needs_token_ids``: what the runtime must fill in `ProbeBatch`.
    """

    per_row: bool
    needs_prev_stream: bool
    needs_token_ids: bool

    def exit_mask(self, batch: ProbeBatch) -> torch.Tensor: ...
