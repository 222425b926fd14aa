"""Plain-torch M2R2 forward: the frozen slow stream and the accelerated stream.

Works on a HF Llama-family ``*ForCausalLM`` (``model.model.layers[i]`` with ``input_layernorm``,
``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``, ``mlp``; ``model.model.norm``,
``model.lm_head``, ``model.model.rotary_emb``). Windows start at position 0, batch [B, T].

Slow stream: the base model, layer by layer, keeping every residual state ``hidden[j]`` (after j
layers; ``hidden[0]`` = token embeddings, ``hidden[N]`` = the last residual BEFORE the final norm,
unlike HF's ``output_hidden_states[-1]``) and the post-rotary K/V of the first layers: exactly
what a paged KV cache holds.

Accelerated stream (A.1.4, shared KV cache): at layer i the accelerated state p_t attends over
``h_<t (+) p_t``: the slow stream's keys/values of positions s < t at layer i, plus the token's
own key/value computed from p_t with the base k/v projections. Vectorised as scores against the
slow keys under a strict causal mask plus one diagonal score against the own key, with one
softmax over both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SlowStream:
    hidden: list[torch.Tensor]  # N+1 x [B, T, d]; hidden[j] = residual after j layers
    keys: list[torch.Tensor]  # kv_layers x [B, Hkv, T, hd], post-rotary
    values: list[torch.Tensor]  # kv_layers x [B, Hkv, T, hd]
    cos: torch.Tensor  # [B, T, hd]
    sin: torch.Tensor
    greedy: torch.Tensor | None  # [B, T] argmax of the full model's next-token logits

    def detach_subset(self, hidden_layers: set[int]) -> SlowStream:
        """A copy that keeps only some residual states (others become empty tensors)."""
        empty = self.hidden[0].new_empty(0)
        hidden = [h if j in hidden_layers else empty for j, h in enumerate(self.hidden)]
        return SlowStream(hidden, self.keys, self.values, self.cos, self.sin, self.greedy)

    def to(self, device) -> SlowStream:
        def mv(t):
            return None if t is None else t.to(device)

        return SlowStream(
            [mv(h) for h in self.hidden],
            [mv(k) for k in self.keys],
            [mv(v) for v in self.values],
            mv(self.cos),
            mv(self.sin),
            mv(self.greedy),
        )


def layers_of(model):
    return model.model.layers


def num_layers_of(model) -> int:
    return len(model.model.layers)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(q, k, cos, sin):
    """q [B, H, T, hd], k [B, Hkv, T, hd], cos/sin [B, T, hd]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rope_tables(model, input_ids: torch.Tensor, dtype: torch.dtype):
    b, t = input_ids.shape
    pos = torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t)
    dummy = torch.empty(0, device=input_ids.device, dtype=dtype)
    return model.model.rotary_emb(dummy, pos)


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    b, t, _ = x.shape
    return x.view(b, t, -1, head_dim).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    b, h, t, hd = x.shape
    return x.transpose(1, 2).reshape(b, t, h * hd)


def _head_dim(attn) -> int:
    return int(attn.head_dim)


def slow_layer(layer, h, cos, sin):
    """One base layer on the slow stream: (h_next, k, v) with k/v post-rotary [B, Hkv, T, hd]."""
    attn = layer.self_attn
    hd = _head_dim(attn)
    x = layer.input_layernorm(h)
    q, k = apply_rope(_heads(attn.q_proj(x), hd), _heads(attn.k_proj(x), hd), cos, sin)
    v = _heads(attn.v_proj(x), hd)
    att = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=float(attn.scaling), enable_gqa=q.shape[1] != k.shape[1]
    )
    h = h + attn.o_proj(_merge(att))
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h, k, v


def greedy_tokens(model, final_hidden: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """argmax of lm_head(norm(h_N)) per position, computed in chunks of tokens."""
    flat = final_hidden.reshape(-1, final_hidden.shape[-1])
    out = [
        model.lm_head(model.model.norm(flat[s : s + chunk])).argmax(-1)
        for s in range(0, flat.shape[0], chunk)
    ]
    return torch.cat(out).view(final_hidden.shape[:-1])


@torch.no_grad()
def slow_forward(
    model, input_ids: torch.Tensor, kv_layers: int | None = None, greedy: bool = True
) -> SlowStream:
    """The frozen base model on ``input_ids`` [B, T]; K/V kept for layers < ``kv_layers``
    (all layers if None)."""
    n = num_layers_of(model)
    kv_layers = n if kv_layers is None else kv_layers
    h = model.model.embed_tokens(input_ids)
    cos, sin = rope_tables(model, input_ids, h.dtype)
    hidden, keys, values = [h], [], []
    for i, layer in enumerate(layers_of(model)):
        h, k, v = slow_layer(layer, h, cos, sin)
        hidden.append(h)
        if i < kv_layers:
            keys.append(k)
            values.append(v)
    g = greedy_tokens(model, h) if greedy else None
    return SlowStream(hidden, keys, values, cos, sin, g)


def shared_kv_attention(q, k_self, v_self, k_slow, v_slow, scale: float) -> torch.Tensor:
    """softmax attention of q_t over [slow keys s < t] + [own key at t].

    q [B, H, T, hd]; k_self/v_self/k_slow/v_slow [B, Hkv, T, hd] (GQA: H = g * Hkv, query head
    h uses kv head h // g). Returns the attention output with heads merged, [B, T, H*hd].
    """
    b, nh, t, hd = q.shape
    nkv = k_slow.shape[1]
    g = nh // nkv
    qg = q.reshape(b, nkv, g, t, hd)
    scores = torch.einsum("bkgtd,bksd->bkgts", qg, k_slow) * scale  # [B, Hkv, g, T, T]
    strict = torch.ones(t, t, dtype=torch.bool, device=q.device).tril(-1)
    scores = scores.masked_fill(~strict, float("-inf"))
    diag = (qg * k_self.unsqueeze(2)).sum(-1, keepdim=True) * scale  # [B, Hkv, g, T, 1]
    w = torch.softmax(torch.cat([scores, diag], dim=-1), dim=-1)
    out = torch.einsum("bkgts,bksd->bkgtd", w[..., :t], v_slow)
    out = out + w[..., t:] * v_self.unsqueeze(2)
    return _merge(out.reshape(b, nh, t, hd))


def accelerated_layer(layer, adapters, i: int, p, k_slow, v_slow, cos, sin):
    """Base layer i on the accelerated stream with adapter i (``adapters=None``: no deltas,
    i.e. the early-exit stream). p [B, T, d] -> p after layer i."""
    attn = layer.self_attn
    hd = _head_dim(attn)
    x = layer.input_layernorm(p)
    q = attn.q_proj(x)
    if adapters is not None:
        q = q + adapters.delta_q(i, x)
    q, k = apply_rope(_heads(q, hd), _heads(attn.k_proj(x), hd), cos, sin)
    v = _heads(attn.v_proj(x), hd)
    att = shared_kv_attention(q, k, v, k_slow, v_slow, float(attn.scaling))
    o = attn.o_proj(att)
    if adapters is not None:
        o = o + adapters.delta_o(i, att)
    p = p + o
    y = layer.post_attention_layernorm(p)
    m = layer.mlp(y)
    if adapters is not None:
        m = m + adapters.delta_mlp(i, y)
    return p + m


def accelerated_stream(
    model, adapters, slow: SlowStream, start: int, stop: int, p_start=None
) -> list[torch.Tensor]:
    """Run layers start..stop-1 on the accelerated stream initialised from ``p_start``
    (default: the slow state h_start). Returns [p_{start+1}, ..., p_stop]."""
    p = slow.hidden[start] if p_start is None else p_start
    out = []
    layers = layers_of(model)
    for i in range(start, stop):
        p = accelerated_layer(
            layers[i], adapters, i, p, slow.keys[i], slow.values[i], slow.cos, slow.sin
        )
        out.append(p)
    return out


def readout(model, states: torch.Tensor) -> torch.Tensor:
    """Next-token logits of residual states: lm_head(final_norm(states))."""
    return model.lm_head(model.model.norm(states))


@torch.no_grad()
def draft_logits(model, adapters, input_ids: torch.Tensor) -> torch.Tensor:
    """Spec mode: the accelerated stream's next-token logits at every position of
    ``input_ids`` [B, T] -> [B, T, vocab] (position t drafts token t+1 from the prefix <= t;
    the slow K/V of all earlier positions are the base model's)."""
    k = adapters.config.k
    slow = slow_forward(model, input_ids, kv_layers=k, greedy=False)
    return readout(model, accelerated_stream(model, adapters, slow, 0, k)[-1])
