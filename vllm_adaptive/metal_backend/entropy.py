"""Shannon entropy of next-token logits in bits, in MLX (GEARBX section 3.1).

The same formula and NaN guard as ``vllm_adaptive/precision/entropy.py`` (torch): NaN -> 0,
+inf -> 1e4, -inf -> -1e4, then ``-(p . log p) / ln 2`` in float32.
"""

from __future__ import annotations

import math

import mlx.core as mx

LN2 = math.log(2.0)


def entropy_bits(logits: mx.array) -> mx.array:
    """Entropy in bits of ``softmax(logits)`` along the last axis."""
    z = mx.nan_to_num(logits.astype(mx.float32), nan=0.0, posinf=1e4, neginf=-1e4)
    logp = z - mx.logsumexp(z, axis=-1, keepdims=True)
    return -(mx.exp(logp) * logp).sum(axis=-1) / LN2


def entropy_nats(logits: mx.array, temperature: float = 1.0) -> mx.array:
    """Entropy in nats of ``softmax(logits / T)`` (EMAD's unit)."""
    z = logits.astype(mx.float32) / temperature
    logp = z - mx.logsumexp(z, axis=-1, keepdims=True)
    return -(mx.exp(logp) * logp).sum(axis=-1)
