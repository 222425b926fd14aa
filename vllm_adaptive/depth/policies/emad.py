"""EMAD's exit signal (sec. 2.4-2.5): the low-rank proxy entropy of the calibrated readout at a
probe layer, at or below the per-layer threshold tau_l - m_l.

The entropy is taken at the profile's calibration temperature (T=1 by default), not at the
request's sampling temperature: the exit decision measures the model's own confidence, and the
request's temperature, top-p and seed are applied afterwards by vLLM's sampler to the exited
logits. A request at another temperature therefore exits exactly where a T=1 request would.
"""

from __future__ import annotations

import torch

from vllm_adaptive.depth.policies.probe import ProbeBatch
from vllm_adaptive.depth.proxies import feature_score


def _interp(x: torch.Tensor, xp: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    """np.interp for torch: linear between knots, flat outside."""
    i = torch.searchsorted(xp, x.contiguous()).clamp(1, xp.numel() - 1)
    x0, x1, y0, y1 = xp[i - 1], xp[i], fp[i - 1], fp[i]
    w = ((x - x0) / (x1 - x0).clamp_min(1e-12)).clamp(0.0, 1.0)
    return y0 + w * (y1 - y0)


class EmadExitSignal:
    """``proxy="lowrank"``: entropy of softmax(U V^T n / T); ``proxy="feature"``: logsumexp
    and top-k probabilities of the same proxy logits through the per-layer isotonic map."""

    per_row = True
    needs_prev_stream = False
    needs_token_ids = False

    def __init__(
        self,
        lowrank_u: torch.Tensor,
        lowrank_v: torch.Tensor,
        temperature: float,
        proxy: str = "lowrank",
        feature_knots: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        topk: int = 32,
    ):
        if proxy not in ("lowrank", "feature"):
            raise ValueError(f"unknown EMAD proxy {proxy!r}")
        if proxy == "feature" and not feature_knots:
            raise ValueError("the feature proxy needs the profile's isotonic knots")
        self.u_t = lowrank_u.t().contiguous()  # [r, V]
        self.v = lowrank_v.contiguous()  # [d, r]
        self.temperature = temperature
        self.proxy = proxy
        self.knots = [(x.double(), y.double()) for x, y in feature_knots or []]
        self.topk = topk

    def to(self, device: torch.device) -> EmadExitSignal:
        self.u_t, self.v = self.u_t.to(device), self.v.to(device)
        self.knots = [(x.to(device), y.to(device)) for x, y in self.knots]
        return self

    def proxy_entropy(self, normed: torch.Tensor, probe: int) -> torch.Tensor:
        """Proxy entropy (nats) of calibrated normed states [n, d] at probe index ``probe``."""
        z = (normed.float() @ self.v) @ self.u_t
        if self.proxy == "feature":
            score = feature_score(z, self.temperature, self.topk).double()
            x, y = self.knots[probe]
            return _interp(score, x, y).float()
        logp = torch.log_softmax(z / self.temperature, dim=-1)
        return -(logp.exp() * logp).sum(-1)

    def exits(self, normed: torch.Tensor, thresholds: torch.Tensor, probe: int) -> torch.Tensor:
        """Bool per row: proxy entropy <= that row's threshold (tau_l - m_l)."""
        return self.proxy_entropy(normed, probe) <= thresholds

    def exit_mask(self, batch: ProbeBatch) -> torch.Tensor:
        """`ExitSignal` form: needs ``batch.readout`` and ``batch.thresholds`` (per row)."""
        if batch.readout is None or batch.thresholds is None:
            raise ValueError("the EMAD signal needs the probe's readout and per-row thresholds")
        return self.exits(batch.readout(batch.stream), batch.thresholds, batch.probe)
