"""EMAD's exit signal (sec. 2.4-2.5): the low-rank proxy entropy of the calibrated readout at a
probe layer, at or below the per-layer threshold tau_l - m_l.

The entropy is taken at the profile's calibration temperature (T=1 by default), not at the
request's sampling temperature: the exit decision measures the model's own confidence, and the
request's temperature, top-p and seed are applied afterwards by vLLM's sampler to the exited
logits. A request at another temperature therefore exits exactly where a T=1 request would.

The torch part computes the proxy logits and their per-row entropy (or feature score); the
decision itself is the framework-neutral `EmadRule` (``emad_rule.py``), which the MLX backend
uses too.
"""

from __future__ import annotations

import torch

from vllm_adaptive.depth.policies.emad_rule import EmadRule
from vllm_adaptive.depth.policies.probe import ProbeBatch
from vllm_adaptive.depth.proxies import feature_score

#: nats: the min-entropy screen's allowance for float32 rounding (its own and the entropy's)
_SCREEN_SLACK = 1e-4


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
        knots = [
            (x.double().cpu().numpy(), y.double().cpu().numpy()) for x, y in feature_knots or []
        ]
        self.rule = EmadRule(proxy, knots)
        self.u_t = lowrank_u.t().contiguous()  # [r, V]
        self.v = lowrank_v.contiguous()  # [d, r]
        self.temperature = temperature
        self.proxy = proxy
        self.topk = topk

    def to(self, device: torch.device) -> EmadExitSignal:
        self.u_t, self.v = self.u_t.to(device), self.v.to(device)
        return self

    def _values(self, normed: torch.Tensor) -> torch.Tensor:
        """Per row: the low-rank entropy (nats) or the feature score of the proxy logits."""
        z = (normed.float() @ self.v) @ self.u_t
        if self.proxy == "feature":
            return feature_score(z, self.temperature, self.topk)
        logp = torch.log_softmax(z / self.temperature, dim=-1)
        return -(logp.exp() * logp).sum(-1)

    def proxy_entropy(self, normed: torch.Tensor, probe: int) -> torch.Tensor:
        """Proxy entropy (nats) of calibrated normed states [n, d] at probe index ``probe``."""
        values = self._values(normed)
        if self.proxy == "lowrank":
            return values
        got = self.rule.entropy(values.double().cpu().numpy(), probe)
        return torch.from_numpy(got).float().to(normed.device)

    def exits(self, normed: torch.Tensor, thresholds: torch.Tensor, probe: int) -> torch.Tensor:
        """Bool per row: proxy entropy <= that row's threshold (tau_l - m_l).

        The low-rank proxy screens first: Shannon entropy is at least the min-entropy
        ``-max log p``, so a row whose min-entropy is above its threshold cannot pass, and only
        the others pay for the entropy's two further passes over the vocabulary (at a 0.97
        profile's thresholds of about 0.02 nats, almost every row stops at the screen). The
        verdicts are those of the full entropy: ``_SCREEN_SLACK`` covers float32 rounding."""
        if self.proxy != "lowrank":
            values = self._values(normed).double().cpu().numpy()
            mask = self.rule.exits(values, thresholds.double().cpu().numpy(), probe)
            return torch.from_numpy(mask).to(normed.device)
        z = (normed.float() @ self.v) @ self.u_t
        logp = torch.log_softmax(z / self.temperature, dim=-1)
        th = thresholds.to(logp.device, torch.float32)
        open_rows = torch.nonzero(-logp.amax(-1) <= th + _SCREEN_SLACK).squeeze(1)
        mask = torch.zeros(normed.shape[0], dtype=torch.bool, device=normed.device)
        if open_rows.numel():
            lp = logp[open_rows]
            entropy = -(lp.exp() * lp).sum(-1)
            mask[open_rows] = entropy <= th[open_rows]
        return mask

    def exit_mask(self, batch: ProbeBatch) -> torch.Tensor:
        """`ExitSignal` form: needs ``batch.readout`` and ``batch.thresholds`` (per row)."""
        if batch.readout is None or batch.thresholds is None:
            raise ValueError("the EMAD signal needs the probe's readout and per-row thresholds")
        return self.exits(batch.readout(batch.stream), batch.thresholds, batch.probe)
