"""The model's readout (final RMSNorm weight + unembedding) and exact entropy in nats.

Kept separate so every stage (collection, norm fitting, proxies) computes logits and entropy
the same way; entropies are always in nats, at temperature `T`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class Readout:
    """`lm_head(g * RMSNorm(h))`: the final norm weight `g`, its epsilon and `W_unembed`."""

    norm_weight: torch.Tensor  # [d]
    eps: float
    unembed: torch.Tensor  # [V, d]

    @property
    def hidden(self) -> int:
        return int(self.unembed.shape[1])

    @property
    def vocab(self) -> int:
        return int(self.unembed.shape[0])

    def rms(self, h: torch.Tensor) -> torch.Tensor:
        """RMSNorm without the learned weight, in float32."""
        h = h.float()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return normed.float() @ self.unembed.T


def entropy_nats(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Shannon entropy of softmax(logits / T) along the last axis, in nats."""
    z = logits.float() / temperature
    logp = torch.log_softmax(z, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def chunks(n: int, size: int) -> Iterator[slice]:
    for i in range(0, n, size):
        yield slice(i, min(n, i + size))
