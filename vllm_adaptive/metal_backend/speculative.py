"""The lowbit self-draft for the MLX engine: the model's own blocks on packed copies of its
weights draft ``k`` tokens, the full model verifies them in one pass (output unchanged).

Mechanism: every decoder linear becomes a `MlxGearedLinear` whose draft code runs the packed tier
(``adaptive.speculative.precision``: int4 on ``group_size`` groups, symmetric or MLX's affine
grid; int8 symmetric), and whose full code runs the weight itself; the LM head has its own
precision (``head``). The draft keeps its own KV cache (its K/V come from packed weights), so
the target's cache only ever holds full-precision K/V.

Verification follows the vLLM path's proposer (``speculative/proposer.py``): drafts are the
draft's argmax, a one-hot proposal, so a greedy request accepts the longest prefix that equals
the target's argmax and then takes the target's own token; a sampled request accepts draft
``x`` with probability ``p(x)`` and on rejection samples from ``p`` with ``x`` removed,
renormalised (Leviathan et al. 2023 with q one-hot), where ``p`` is exactly the distribution
mlx-lm's sampler draws from (its own top-p / top-k filters, then the temperature).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from vllm_adaptive.config import SpeculativeConfig
from vllm_adaptive.gears import BITS
from vllm_adaptive.metal_backend.arch import LlamaLayout
from vllm_adaptive.metal_backend.geared import GearSwitch, MlxGearedLinear
from vllm_adaptive.metal_backend.quant import QuantTier, check_group_size, quantize

DRAFT, FULL = 0, 1  # switch codes of the speculative engine's geared linears
MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def draft_tier(weight: mx.array, precision: str, cfg: SpeculativeConfig, key: str) -> QuantTier:
    bits = BITS[precision]
    g = check_group_size(cfg.group_size, int(weight.shape[1]), key)
    scheme = "symmetric" if (bits == 8 or cfg.symmetric) else "affine"
    return quantize(weight, bits, g, scheme)


class MlxLowBitDraft:
    """Packed copies of every decoder linear and of the LM head, switched by a `GearSwitch`."""

    def __init__(self, layout: LlamaLayout, cfg: SpeculativeConfig) -> None:
        self.layout = layout
        self.config = cfg
        self.switch = GearSwitch(FULL)
        precision = cfg.draft_precision
        self.geared: list[MlxGearedLinear] = []
        for i in range(layout.num_layers):
            first = len(self.geared)
            for module in MODULES:
                for parent, attr in layout.linears(i, module):
                    linear = getattr(parent, attr)
                    tier = draft_tier(
                        linear.weight, precision, cfg, "adaptive.speculative.group_size"
                    )
                    g = MlxGearedLinear(linear, (precision,), {precision: tier}, self.switch)
                    setattr(parent, attr, g)
                    self.geared.append(g)
            mx.eval([t.wq for g in self.geared[first:] for t in g.tiers.values()])
        head = cfg.head_precision
        self.head: QuantTier | None = None
        if head != "full":
            key = "adaptive.speculative.group_size"
            self.head = draft_tier(layout.head_weight(), head, cfg, key)
            mx.eval(self.head.wq)
        self.name = f"lowbit-{precision}-g{cfg.group_size}-{'sym' if cfg.symmetric else 'asym'}"

    def logits(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        """Draft logits ``[1, n, V]`` for ``tokens`` ``[1, n]``, writing the draft cache."""
        layout = self.layout
        self.switch.code = DRAFT
        try:
            h = layout.embed(tokens)
            mask = layout.mask(h, cache)
            for layer, c in zip(layout.layers, cache, strict=True):
                h = layer(h, mask, cache=c)
            h = layout.norm(h)
            return layout.head(h) if self.head is None else self.head.matmul(h)
        finally:
            self.switch.code = FULL

    def resident_bytes(self) -> int:
        n = sum(t.nbytes for g in self.geared for t in g.tiers.values())
        return n + (self.head.nbytes if self.head is not None else 0)


@dataclass
class SpecStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "acceptance": self.accepted / self.drafted if self.drafted else None,
            "tokens_per_round": self.emitted / self.rounds if self.rounds else None,
        }


def target_probs(logits: mx.array, temp: float, top_p: float, top_k: int) -> mx.array:
    """The distribution mlx-lm's ``make_sampler(temp, top_p, top_k=...)`` draws from, for each
    row of ``logits`` ``[n, V]``."""
    from mlx_lm.sample_utils import apply_top_k, apply_top_p

    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < top_p < 1.0:
        logprobs = apply_top_p(logprobs, top_p)
    if top_k > 0:
        logprobs = apply_top_k(logprobs, top_k)
    return mx.softmax(logprobs.astype(mx.float32) / temp, axis=-1)


def verify(
    target_logits: mx.array, drafts: list[int], temp: float, top_p: float, top_k: int
) -> tuple[int, int]:
    """(accepted drafts, the token after them) for target logits ``[k+1, V]`` at the positions
    before each draft and after the last."""
    k = len(drafts)
    if temp == 0:
        best = mx.argmax(target_logits, axis=-1).tolist()
        n = 0
        while n < k and best[n] == drafts[n]:
            n += 1
        return n, int(best[n])
    p = target_probs(target_logits, temp, top_p, top_k)
    u = mx.random.uniform(shape=(k,)).tolist() if k else []
    for i, d in enumerate(drafts):
        if u[i] < float(p[i, d].item()):
            continue
        rest = p[i] * (mx.arange(p.shape[-1]) != d)
        tok = mx.random.categorical(mx.log(rest / rest.sum()))
        return i, int(tok.item())
    tok = mx.random.categorical(mx.log(p[k]))
    return k, int(tok.item())
