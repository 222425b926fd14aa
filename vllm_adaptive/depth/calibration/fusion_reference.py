"""Plain-torch forward with contextual token fusion at prefill, as the engine would run it.

One prompt of P tokens and a teacher-forced continuation of C tokens run together (rows in
position order). At each fusion layer l (fusion after l blocks, 1 <= l < L) the policy
(`depth/policies/fusion.py`) groups adjacent prompt rows; from block l on only the rows that
keep running are computed: each group's super-token at its last row's position (rotary
embedding of that position), and ungrouped rows as before. That is the KV *mask* strategy:
a removed row's K/V exist for blocks 0..l-1 (it ran them, every later row reads them there)
and are never read at blocks >= l, because from l on attention runs over the kept rows only.
The continuation rows stand for later decode steps (or a later chunk): they are never fused,
and at blocks >= l they see the prompt's kept rows only, exactly as decode would see a cache
whose fused slots are recorded as written up to l.

The last prompt row is never fused (its logits give the first sampled token; see
docs/token-fusion.md). Rows already fused may fuse again at a later fusion layer; a
super-token stands for all its tokens (``mass``), so uniform weighting stays the mean over
tokens.

Score weighting (``weighting="score"``) weighs each row by the attention it receives at the
block before the fusion layer: the mean over heads and over the rows that can see it of the
softmax probability. The attention-similarity gate uses cos(q_{i+1}, k_i) averaged over heads
and over the blocks run since the previous fusion layer (the blocks where the current rows
were all computed).

Llama-family decoders only (``model.model.layers[i]`` with ``input_layernorm``,
``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``, ``mlp``); no vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vllm_adaptive.depth.policies.fusion import (
    FusionRule,
    adjacent_distance,
    apply_fusion,
    fusion_groups,
)

SUPPORTED_MODEL_TYPES = ("llama",)


def check_model(model) -> None:
    kind = getattr(model.config, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"token fusion's reference forward supports {SUPPORTED_MODEL_TYPES} models, not "
            f"{kind!r} (Gemma 3's sliding windows and q/k norms are not modelled)"
        )


@dataclass
class ReferenceFusionEvent:
    """One group fused after ``layer`` blocks: the prompt tokens it stands for."""

    layer: int
    first_token: int
    last_token: int  # the kept slot
    rows: int  # rows merged (super-tokens count once)


@dataclass
class PrefixState:
    """The stream after ``layer`` blocks for every row (nothing fused before ``layer``)."""

    layer: int
    hidden: torch.Tensor  # [T, d]
    score: torch.Tensor | None  # [T] attention received at block layer-1 (score weighting)
    attn_sim: torch.Tensor | None  # [T-1] mean cos(q_{i+1}, k_i) over blocks 0..layer-1


@dataclass
class FusionRun:
    prompt_len: int
    num_layers: int
    nll: torch.Tensor  # [C] -log p(continuation token) at T=1
    argmax: torch.Tensor  # [C] greedy token at each continuation prediction
    active_prompt_rows: list[int]  # [L] prompt rows computed by each block
    events: list[ReferenceFusionEvent] = field(default_factory=list)
    distances: dict[int, torch.Tensor] = field(default_factory=dict)  # l -> fusable pairs' d

    @property
    def removed_fraction(self) -> float:
        """Fraction of the prompt's token-layers (blocks x tokens) not computed."""
        p, n = self.prompt_len, self.num_layers
        return 1.0 - sum(self.active_prompt_rows) / (p * n)


def _heads(x: torch.Tensor, hd: int) -> torch.Tensor:
    t = x.shape[0]
    return x.view(t, -1, hd).transpose(0, 1)  # [H, T, hd]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _block(layer, h, cos, sin, want_score: bool, want_sim: bool):
    """One decoder block over rows in position order (causal over the rows given).
    Returns (h, score [T] or None, adjacent cos [T-1] or None)."""
    attn = layer.self_attn
    hd = int(attn.head_dim)
    x = layer.input_layernorm(h)
    q = _rope(_heads(attn.q_proj(x), hd), cos, sin)
    k = _rope(_heads(attn.k_proj(x), hd), cos, sin)
    v = _heads(attn.v_proj(x), hd)
    rep = q.shape[0] // k.shape[0]
    score = sim = None
    if want_sim and h.shape[0] > 1:
        kk = k.repeat_interleave(rep, dim=0)
        sim = F.cosine_similarity(q[:, 1:], kk[:, :-1], dim=-1, eps=1e-12).mean(0)
    if want_score:
        kk, vv = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
        s = (q @ kk.transpose(1, 2)) * float(attn.scaling)
        t = h.shape[0]
        causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        att = p @ vv
        seen_by = torch.arange(t, 0, -1, device=h.device, dtype=p.dtype)  # rows i.. see row i
        score = p.mean(0).sum(0) / seen_by
    else:
        att = F.scaled_dot_product_attention(
            q[None], k[None], v[None], is_causal=True, scale=float(attn.scaling),
            enable_gqa=rep != 1,
        )[0]  # fmt: skip
    h = h + attn.o_proj(att.transpose(0, 1).reshape(h.shape[0], -1))
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h, score, sim


def _rope_tables(model, positions: torch.Tensor, dtype: torch.dtype):
    dummy = torch.empty(0, dtype=dtype, device=positions.device)
    cos, sin = model.model.rotary_emb(dummy, positions[None])
    return cos[0], sin[0]


def _needs(rules: Mapping[int, FusionRule], layer: int) -> tuple[bool, bool]:
    r = rules.get(layer)
    return (r is not None and r.weighting == "score", r is not None and r.tau_attn is not None)


@torch.no_grad()
def prefix_state(model, ids: Sequence[int], layer: int, rules: Mapping[int, FusionRule]):
    """Blocks 0..layer-1 on every row (shared by every rule set whose first fusion layer is
    ``layer``: calibration runs its grid from here)."""
    check_model(model)
    device = model.model.embed_tokens.weight.device
    tokens = torch.tensor(list(ids), dtype=torch.long, device=device)
    h = model.model.embed_tokens(tokens)
    pos = torch.arange(len(tokens), device=device)
    cos, sin = _rope_tables(model, pos, h.dtype)
    want_score, want_sim = _needs(rules, layer)
    score, sim_sum = None, None
    for j in range(layer):
        h, s, sim = _block(model.model.layers[j], h, cos, sin, want_score and j == layer - 1,
                           want_sim)  # fmt: skip
        score = s if s is not None else score
        if sim is not None:
            sim_sum = sim if sim_sum is None else sim_sum + sim
    return PrefixState(
        layer=layer,
        hidden=h,
        score=score,
        attn_sim=None if sim_sum is None else sim_sum / max(layer, 1),
    )


@torch.no_grad()
def fused_forward(
    model,
    ids: Sequence[int],
    prompt_len: int,
    rules: Mapping[int, FusionRule],
    exempt: torch.Tensor | None = None,
    start: PrefixState | None = None,
) -> FusionRun:
    """Run ``ids`` (prompt of ``prompt_len`` tokens, then the continuation) with fusion at
    ``rules``' layers; ``exempt`` [prompt_len] bool marks prompt tokens that never fuse.
    ``start`` resumes from a `prefix_state` (its layer must not be above the first fusion
    layer and it must have been made with the same first-layer needs)."""
    check_model(model)
    num_layers = len(model.model.layers)
    bad = [layer for layer in rules if not 1 <= layer < num_layers]
    if bad:
        raise ValueError(f"fusion layers must lie in 1..{num_layers - 1}: {bad}")
    t = len(ids)
    if not 1 <= prompt_len < t:
        raise ValueError(f"prompt_len {prompt_len} must leave >= 1 continuation token of {t}")
    device = model.model.embed_tokens.weight.device
    tokens = torch.tensor(list(ids), dtype=torch.long, device=device)
    fusable = torch.zeros(t, dtype=torch.bool)
    fusable[: prompt_len - 1] = True  # the last prompt row is sampled from: never fused
    if exempt is not None:
        if exempt.shape != (prompt_len,):
            raise ValueError(f"exempt must be [{prompt_len}], got {tuple(exempt.shape)}")
        fusable[:prompt_len] &= ~exempt.cpu().bool()
    layers = sorted(rules)
    first = layers[0] if layers else num_layers
    if start is None:
        start = prefix_state(model, ids, min(first, num_layers), rules)
    if start.layer > first or start.hidden.shape[0] != t:
        raise ValueError("start state does not fit these ids and fusion layers")
    h = start.hidden
    active = torch.arange(t)  # original row of each computed row, in order
    span_first = torch.arange(t)  # first token each row stands for
    mass = torch.ones(t)
    active_prompt = [prompt_len] * start.layer
    events: list[ReferenceFusionEvent] = []
    distances: dict[int, torch.Tensor] = {}
    score, sim_sum, sim_blocks = start.score, start.attn_sim, start.layer
    if sim_sum is not None:
        sim_sum = sim_sum * start.layer
    pos = torch.arange(t, device=device)
    for j in range(start.layer, num_layers):
        rule = rules.get(j)
        if rule is not None:
            ok = fusable[active]
            d = adjacent_distance(h)
            distances[j] = d[(ok[1:] & ok[:-1]).to(d.device)].cpu()
            sim = None if sim_sum is None or rule.tau_attn is None else sim_sum / sim_blocks
            g = fusion_groups(h, rule, exempt=~ok, attn_sim=sim, score=score, mass=mass[active],
                              token_ids=tokens.cpu()[active])  # fmt: skip
            for s, e in zip(g.starts.tolist(), g.ends.tolist(), strict=True):
                events.append(
                    ReferenceFusionEvent(j, int(span_first[active[s]]), int(active[e]), e - s + 1)
                )
            if g.num_groups:
                keep, h = apply_fusion(h, g)
                keep = keep.cpu()
                for s, e in zip(g.starts.tolist(), g.ends.tolist(), strict=True):
                    mass[active[e]] = mass[active[s : e + 1]].sum()
                    span_first[active[e]] = span_first[active[s]]
                active = active[keep]
            sim_sum, sim_blocks = None, 0
        nxt = next((x for x in layers if x > j), -1)
        want_score, want_sim = _needs(rules, nxt)
        want_score = want_score and nxt == j + 1  # the block right before a score fusion
        cos, sin = _rope_tables(model, pos[active.to(device)], h.dtype)
        h, s, sim = _block(model.model.layers[j], h, cos, sin, want_score, want_sim)
        score = s
        if sim is not None:
            sim_sum = sim if sim_sum is None else sim_sum + sim
            sim_blocks += 1
        active_prompt.append(int((active < prompt_len).sum()))
    logits = model.lm_head(model.model.norm(h[-(t - prompt_len) - 1 : -1])).float()
    target = tokens[prompt_len:]
    nll = -torch.log_softmax(logits, dim=-1).gather(1, target[:, None])[:, 0]
    return FusionRun(
        prompt_len=prompt_len,
        num_layers=num_layers,
        nll=nll.cpu(),
        argmax=logits.argmax(-1).cpu(),
        active_prompt_rows=active_prompt,
        events=events,
        distances=distances,
    )
