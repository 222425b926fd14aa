"""River-LLM's exit decision (sec. 4.2, eq. 1): state-transition cosine similarity.

    s_l = cos(h_{l-1}, h_l),   exit at layer l  iff  s_l > tau

``h`` is the residual stream (the decoder block's input and output), so the test costs O(d)
per row and needs no readout. Two forms:

* per token (``batch_min=False``): each row exits on its own s_l > tau;
* the paper's batch minimum (``batch_min=True``, eq. 1 ``min_{b in B} s_{t,b} > tau``): every
  row exits together when the smallest s_l over the batch passes, otherwise none does. The
  batch B is the candidate rows the runtime passes at this layer (decode rows that may still
  exit here); rows held by their floor or already stopped at their cap are not in it.

River checks after every block from an entry layer L_s (``entry_layer``; the Exit River starts
there); probe layers are the profile's, so ``vllm-adaptive calibrate --signal river`` makes
every layer a probe. Defaults from the paper: tau = 0.5 (Llama 3.2 1B / 3.1 8B), 0.8-0.9 for
newer models; the calibration picks tau for a target next-token match rate instead.

What "exit" means is the runtime's business: River itself runs the remaining layers through
4-bit copies that share the KV cache (the Exit River); our runtime today emits the calibrated
readout at the exit layer. The signal is the same either way.

What the runtime must pass in `ProbeBatch`: ``stream`` and ``prev_stream`` (the residual
stream after and before block ``layer``) for the candidate rows. No token ids, no readout.
"""

from __future__ import annotations

import torch

from vllm_adaptive.depth.policies.probe import ProbeBatch


def state_transition_similarity(prev: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
    """cos(h_{l-1}, h_l) per row, in float32 (0 for an all-zero row)."""
    a, b = prev.float(), cur.float()
    return torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-12)


class RiverExitSignal:
    """s_l > tau per row, or for the whole batch at once with ``batch_min``."""

    needs_prev_stream = True
    needs_token_ids = False

    def __init__(self, tau: float, batch_min: bool = False, entry_layer: int = 1):
        if not -1.0 <= tau <= 1.0:
            raise ValueError(f"River tau is a cosine similarity in [-1, 1], not {tau}")
        self.tau = float(tau)
        self.batch_min = bool(batch_min)
        self.entry_layer = int(entry_layer)

    @property
    def per_row(self) -> bool:
        return not self.batch_min

    def exit_mask(self, batch: ProbeBatch) -> torch.Tensor:
        n = batch.rows
        if n == 0 or batch.layer < self.entry_layer:
            return torch.zeros(n, dtype=torch.bool, device=batch.stream.device)
        if batch.prev_stream is None:
            raise ValueError("River needs prev_stream (the input of block `layer`)")
        s = state_transition_similarity(batch.prev_stream, batch.stream)
        if self.batch_min:
            return (s.min() > self.tau).expand(n).clone()
        return s > self.tau
