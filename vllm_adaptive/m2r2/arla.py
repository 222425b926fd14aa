"""ARLA: Accelerated Residual Latent Attention router (M2R2 appendix A.1.2).

At gate E_j the exit decision looks at the accelerated residual states of the interval
[E_{j-1}, E_j] rather than only at the last one. The states are RMS-normalised (residual norms
grow with depth), projected to latent queries/keys/values of dimension d_s = 64, the query of the
*last* state attends over all states of the interval (single latent head), and a small MLP head
turns the attended latent into an exit logit. Trained with BCE on "the gate's accelerated
prediction equals the full model's greedy token".

``states``: [tokens, S, d] (S states in layer order, the last one at the gate) or a sequence of
S tensors [tokens, d]. The trainer passes S = interval length + 1 states
[p_{E_{j-1}} (= h_{E_{j-1}}, the re-initialised state), p_{E_{j-1}+1}, ..., p_{E_j}].
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn


class ARLA(nn.Module):
    def __init__(self, hidden_size: int, latent: int = 64, eps: float = 1e-5) -> None:
        super().__init__()
        self.latent = latent
        self.eps = eps
        self.norm_weight = nn.Parameter(torch.ones(hidden_size))
        self.q = nn.Linear(hidden_size, latent, bias=False)
        self.k = nn.Linear(hidden_size, latent, bias=False)
        self.v = nn.Linear(hidden_size, latent, bias=False)
        self.head_hidden = nn.Linear(latent, latent)
        self.head_out = nn.Linear(latent, 1)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        self.norm_weight.fill_(1.0)
        for lin in (self.q, self.k, self.v, self.head_hidden, self.head_out):
            w = lin.weight
            w.copy_(torch.randn(w.shape, generator=generator) / math.sqrt(w.shape[1]))
            if lin.bias is not None:
                lin.bias.zero_()

    @staticmethod
    def _stack(states) -> torch.Tensor:
        if isinstance(states, torch.Tensor):
            if states.dim() != 3:
                raise ValueError(f"states must be [tokens, S, d], got {tuple(states.shape)}")
            return states
        if isinstance(states, Sequence) and states:
            return torch.stack(list(states), dim=1)
        raise ValueError("states must be a [tokens, S, d] tensor or a list of [tokens, d]")

    def forward(self, states) -> torch.Tensor:
        """Exit logits [tokens]."""
        x = self._stack(states)
        dtype = x.dtype
        x = x.to(self.norm_weight.dtype)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        q = self.q(x[:, -1])  # [tokens, ds]: the last state's query
        k, v = self.k(x), self.v(x)  # [tokens, S, ds]
        att = torch.softmax((k @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(self.latent), dim=-1)
        z = (att.unsqueeze(-1) * v).sum(1)  # [tokens, ds]
        logit = self.head_out(torch.nn.functional.silu(self.head_hidden(z))).squeeze(-1)
        return logit.to(dtype)

    def exit_probability(self, states) -> torch.Tensor:
        """P(exit) in [0, 1] per token, [tokens]."""
        return torch.sigmoid(self.forward(states).float())
