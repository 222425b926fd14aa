"""EMAD's exit signal (sec. 2.4-2.5): the low-rank proxy entropy of the calibrated readout at a
probe layer, at or below the per-layer threshold tau_l - m_l.

The entropy is taken at the profile's calibration temperature (T=1 by default), not at the
request's sampling temperature: the exit decision measures the model's own confidence, and the
request's temperature, top-p and seed are applied afterwards by vLLM's sampler to the exited
logits. A request at another temperature therefore exits exactly where a T=1 request would.
"""

from __future__ import annotations

import torch


class EmadExitSignal:
    def __init__(self, lowrank_u: torch.Tensor, lowrank_v: torch.Tensor, temperature: float):
        self.u_t = lowrank_u.t().contiguous()  # [r, V]
        self.v = lowrank_v.contiguous()  # [d, r]
        self.temperature = temperature

    def to(self, device: torch.device) -> EmadExitSignal:
        self.u_t, self.v = self.u_t.to(device), self.v.to(device)
        return self

    def proxy_entropy(self, normed: torch.Tensor) -> torch.Tensor:
        """Low-rank proxy entropy (nats) of calibrated normed states [n, d]."""
        z = (normed.float() @ self.v) @ self.u_t
        logp = torch.log_softmax(z / self.temperature, dim=-1)
        return -(logp.exp() * logp).sum(-1)

    def exits(self, normed: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
        """Bool per row: proxy entropy <= that row's threshold (tau_l - m_l)."""
        return self.proxy_entropy(normed) <= thresholds
