"""Analytic FLOPs per decoded token for dense decoder-only models.

Counts multiply-adds as 2 FLOPs. Per layer: the attention projections
(q, k, v, o), the gated MLP (gate, up, down) and attention itself over a
context of `context_len` tokens (QK^T and PV). Plus the LM head. Embedding
lookups, norms and activations are ignored (well under 1% here). Later modes
pass the layers and precisions they actually ran; with everything full this is
the stock cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DenseShape:
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_hf_config(cls, cfg: Any) -> DenseShape:
        get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
        heads = get("num_attention_heads")
        hidden = get("hidden_size")
        return cls(
            num_layers=get("num_hidden_layers"),
            hidden=hidden,
            intermediate=get("intermediate_size"),
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads", heads) or heads,
            head_dim=get("head_dim", None) or hidden // heads,
            vocab=get("vocab_size"),
        )

    def layer_linear_flops(self) -> float:
        q = self.hidden * self.num_heads * self.head_dim
        kv = 2 * self.hidden * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return 2.0 * (q + kv + o + mlp)

    def layer_attention_flops(self, context_len: float) -> float:
        return 2.0 * 2.0 * self.num_heads * self.head_dim * context_len

    def lm_head_flops(self) -> float:
        return 2.0 * self.hidden * self.vocab

    def flops_per_token(self, context_len: float, mean_layers: float | None = None) -> float:
        """FLOPs for one decoded token; `mean_layers` < num_layers for early exit."""
        layers = self.num_layers if mean_layers is None else mean_layers
        per_layer = self.layer_linear_flops() + self.layer_attention_flops(context_len)
        return layers * per_layer + self.lm_head_flops()

    def decoder_linear_params(self) -> float:
        """Parameters of the decoder layers' linear weights (what precision gears manage)."""
        return self.num_layers * self.layer_linear_flops() / 2.0

    def weight_params_read_per_token(self) -> float:
        """Weights one decode step reads: decoder linears plus the LM head."""
        return self.decoder_linear_params() + self.hidden * self.vocab


#: Bytes per parameter each precision reads with packed kernels (GEARBX table 7; int2 is ours).
BYTES_PER_PARAM = {
    "full": 2.0,
    "fp16": 2.0,
    "int8": 1.0,
    "w8a8": 1.0,
    "w8a16": 1.0,
    "int4": 0.5,
    "int2": 0.25,
}


def ideal_speedup(managed_fraction: float, gear_fractions: dict[str, float]) -> float:
    """GEARBX's bandwidth anchor 1/((1-f) + f/k), with 1/k averaged over the gears run."""
    inv_k = sum(
        frac * BYTES_PER_PARAM[g] / BYTES_PER_PARAM["full"] for g, frac in gear_fractions.items()
    )
    return 1.0 / ((1.0 - managed_fraction) + managed_fraction * inv_k)
