"""Cheap entropy proxies for exit decisions (EMAD sec. 2.4) and their measured error.

* low-rank: W_unembed ~ U V^T (rank r, truncated SVD); H_hat = H(softmax(U V^T n / T)),
  optionally over the rows of U for a truncated vocabulary (the tokens the model emits most).
* feature: from the same proxy logits only logsumexp and the top-k probabilities; their
  "tail-uniform" entropy score is mapped to entropy by a per-layer isotonic regression fit
  against the exact entropy of the calibrated readout.
Entropies are in nats. Proxy cost per probe: 2 * (d*r + r*V) FLOPs, V the proxy's vocabulary
(same for both variants: the feature proxy still needs all V proxy logits for the logsumexp;
it saves the softmax).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_adaptive.depth.readout import entropy_nats


@dataclass
class LowRankReadout:
    u: torch.Tensor  # [V, r] = W V_r (left factor times singular values)
    v: torch.Tensor  # [d, r] top right singular vectors

    @classmethod
    def fit(
        cls, unembed: torch.Tensor, rank: int, vocab: torch.Tensor | None = None
    ) -> LowRankReadout:
        """Truncated SVD of W via the d x d Gram matrix (cheap: d << V). ``vocab``: token ids
        the proxy's softmax runs over (None: all); the proxy's cost scales with their count,
        and its entropy is that of the softmax restricted to them."""
        w = unembed.double()
        evals, evecs = torch.linalg.eigh(w.T @ w)
        v = evecs[:, torch.argsort(evals, descending=True)[:rank]]
        u = w @ v if vocab is None else w[vocab] @ v
        return cls(u=u.float(), v=v.float())

    @property
    def rank(self) -> int:
        return int(self.v.shape[1])

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return (normed.float() @ self.v) @ self.u.T

    def flops(self) -> float:
        return 2.0 * (self.v.shape[0] * self.rank + self.u.shape[0] * self.rank)


def feature_score(logits: torch.Tensor, temperature: float = 1.0, k: int = 32) -> torch.Tensor:
    """Entropy if the mass outside the top-k were uniform: a monotone-ish feature of
    (logsumexp, top-k probabilities) that needs no full normalised softmax."""
    z = logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    top = (z.topk(k, dim=-1).values - lse).exp()
    head = -(top * top.clamp_min(1e-30).log()).sum(-1)
    tail = (1.0 - top.sum(-1)).clamp_min(0.0)
    rest = logits.shape[-1] - k
    tail_h = -tail * (tail.clamp_min(1e-30) / rest).log()
    return head + tail_h


@dataclass
class ErrorStats:
    """Proxy minus exact entropy (nats): e > 0 is conservative, e < 0 risks early exits."""

    mae: float
    median: float
    mad: float

    @classmethod
    def of(cls, err: np.ndarray) -> ErrorStats:
        med = float(np.median(err))
        return cls(
            mae=float(np.mean(np.abs(err))), median=med, mad=float(np.median(np.abs(err - med)))
        )


def proxy_entropies(
    lowrank: LowRankReadout, normed: torch.Tensor, temperature: float, k: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(low-rank entropy, feature score) for a batch of calibrated normed states."""
    z = lowrank.logits(normed)
    return entropy_nats(z, temperature), feature_score(z, temperature, k)
