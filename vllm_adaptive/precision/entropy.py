"""Shannon entropy of next-token distributions, in bits (GEARBX section 3.1).

``H = -(p . log_softmax(z)) / ln 2``, computed in float32. Logits are sanitized first with
GEARBX's NaN guard (section 10.1: NaN -> 0, +inf -> 1e4, -inf -> -1e4) so a broken row gives a
finite, high entropy instead of poisoning a request's monitor.
"""

from __future__ import annotations

import math

import torch

LN2 = math.log(2.0)


def entropy_bits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in bits of ``softmax(logits)`` along the last dimension."""
    z = torch.nan_to_num(logits.float(), nan=0.0, posinf=1e4, neginf=-1e4)
    logp = torch.log_softmax(z, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1) / LN2
