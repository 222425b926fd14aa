"""The EAGLE-3 draft head in plain torch, as vLLM's ``llama_eagle3.py`` runs it, with what its
training needs: the initialisation from the target (the untrained head's first step reproduces
the target's residual stream) and the loss with EAGLE-3's training-time test (steps 3 and 4 of
the recipe in :mod:`vllm_adaptive.speculative.train_eagle3`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class DraftTrainError(ValueError):
    """Arguments or a state that cannot train this head: says what."""


# -- the head: vLLM's llama_eagle3.py forward in plain torch ----------------------------------
class RMSNorm(nn.Module):
    """vLLM's ``RMSNorm.forward_native`` (float32): ``x * rsqrt(mean(x^2) + eps) * weight``."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's rotary cache (``RotaryEmbedding._compute_cos_sin_cache``) at ``positions``."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
    inv_freq = 1.0 / theta ** (steps / head_dim)
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of ``x`` [..., T, heads, head_dim]; ``cos``/``sin`` [..., T, d/2]."""
    half = x.shape[-1] // 2
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class _Attn(nn.Module):
    def __init__(self, h: int, q: int, kv: int, qkv_in: int):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (
            _linear(qkv_in, q),
            _linear(qkv_in, kv),
            _linear(qkv_in, kv),
        )
        self.o_proj = _linear(q, h)


class _MLP(nn.Module):
    def __init__(self, h: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj = _linear(h, inter), _linear(h, inter)
        self.down_proj = _linear(inter, h)


class _MidLayer(nn.Module):
    """vLLM's EAGLE-3 decoder layer: the first (``midlayer``) reads [embedding, fc(h)]; later
    ones (``layers.{i}``) read the stream like a target layer (their ``hidden_norm`` exists in
    vLLM's module and is never used)."""

    def __init__(self, cfg: dict[str, Any], first: bool = True):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        hd = cfg["head_dim"]
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = _Attn(
            h,
            cfg["num_attention_heads"] * hd,
            cfg["num_key_value_heads"] * hd,
            2 * h if first else h,
        )
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = _MLP(h, cfg["intermediate_size"])


def ttt_attention(
    q: torch.Tensor,
    k1: torch.Tensor,
    v1: torch.Tensor,
    diag_k: list[torch.Tensor],
    diag_v: list[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Attention of draft step ``j`` for every chain start ``p`` at once. ``q`` [B, T, H, D]
    (the query of chain ``p`` at row ``p``), ``k1``/``v1`` [B, T, KV, D] the first step's keys
    (chain ``p`` sees rows ``0..p``: the KV cache of the verified prefix), ``diag_k``/``diag_v``
    the keys of steps 2..j (chain ``p`` sees only its own row of each). GQA: query head ``h``
    reads KV head ``h // (H / KV)``."""
    B, T, H, D = q.shape
    rep = H // k1.shape[2]
    qh = q.transpose(1, 2)  # B H T D
    kh = k1.repeat_interleave(rep, dim=2).transpose(1, 2)
    vh = v1.repeat_interleave(rep, dim=2).transpose(1, 2)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # B H T T
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    if diag_k:
        kd = torch.stack([k.repeat_interleave(rep, dim=2) for k in diag_k], dim=3)  # B T H m D
        vd = torch.stack([v.repeat_interleave(rep, dim=2) for v in diag_v], dim=3)
        sd = (q.unsqueeze(3) * kd).sum(-1) * scale  # B T H m
        scores = torch.cat([scores, sd.permute(0, 2, 1, 3)], dim=-1)
    w = torch.softmax(scores, dim=-1)
    out = torch.matmul(w[..., :T], vh)  # B H T D
    if diag_k:
        wd = w[..., T:].permute(0, 2, 1, 3).unsqueeze(-1)  # B T H m 1
        out = out + (wd * vd).sum(3).transpose(1, 2)
    return out.transpose(1, 2)  # B T H D


@dataclass
class StepOutput:
    logits: torch.Tensor  # [B, T, draft_vocab]
    hidden: torch.Tensor  # [B, T, h]: the pre-norm output, the next step's hidden input


class Eagle3Draft(nn.Module):
    """The head; its ``state_dict`` has exactly the names and shapes of ``head_shapes`` (the
    embedding is a non-persistent buffer: vLLM shares the target's)."""

    def __init__(self, cfg: dict[str, Any], embed: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        h = cfg["hidden_size"]
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg["head_dim"]
        self.theta = float(cfg["rope_theta"])
        self.fc = _linear(3 * h, h)
        self.midlayer = _MidLayer(cfg)
        # names "layers.1", "layers.2", ...: what vLLM loads after "midlayer" -> "layers.0"
        self.layers = nn.ModuleDict(
            {str(i): _MidLayer(cfg, first=False) for i in range(1, cfg["num_hidden_layers"])}
        )
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.lm_head = _linear(h, cfg["draft_vocab_size"])
        self.register_buffer("embed", embed.detach().float(), persistent=False)

    def stack(self) -> list[_MidLayer]:
        return [self.midlayer, *self.layers.values()]

    def ttt(self, tokens: torch.Tensor, aux: torch.Tensor, steps: int) -> list[StepOutput]:
        """Draft steps 1..``steps`` from every chain start ``p`` of ``tokens`` [B, T] at once.
        Step ``j`` (1-based) of chain ``p`` reads token ``p + j`` (0 past the end) at position
        id ``p + j - 1``; step 1 reads ``fc(aux[p])``, later steps the previous step's
        pre-norm output; its logits predict token ``p + j + 1``.

        Per layer, vLLM's forward with its fused adds written as one stream ``s``: the first
        layer's q/k/v read ``[input_layernorm(embed), hidden_norm(h)]`` with ``s = h``; a later
        layer's read ``input_layernorm(s)``; each adds its attention and MLP to ``s``; the
        logits read ``norm(s)`` and the next step reads ``s`` (the pre-norm sum)."""
        B, T = tokens.shape
        hidden = self.fc(aux)
        base = torch.arange(T, device=tokens.device)
        layers = self.stack()
        # per layer: the first step's keys (the verified prefix' KV cache) and later steps' own
        cache_k: list[list[torch.Tensor]] = [[] for _ in layers]
        cache_v: list[list[torch.Tensor]] = [[] for _ in layers]
        scale = self.head_dim**-0.5
        outs = []
        for j in range(steps):
            ids = torch.zeros_like(tokens)
            ids[:, : max(T - j - 1, 0)] = tokens[:, j + 1 :]
            cos, sin = rope_cos_sin(base + j, self.head_dim, self.theta)
            s = hidden
            for i, layer in enumerate(layers):
                if i == 0:
                    x = torch.cat(
                        [layer.input_layernorm(self.embed[ids]), layer.hidden_norm(hidden)], -1
                    )
                else:
                    x = layer.input_layernorm(s)
                att = layer.self_attn
                q = apply_rope(att.q_proj(x).view(B, T, self.heads, self.head_dim), cos, sin)
                k = apply_rope(att.k_proj(x).view(B, T, self.kv_heads, self.head_dim), cos, sin)
                v = att.v_proj(x).view(B, T, self.kv_heads, self.head_dim)
                cache_k[i].append(k)
                cache_v[i].append(v)
                ks, vs = cache_k[i], cache_v[i]
                attn = ttt_attention(q, ks[0], vs[0], ks[1:], vs[1:], scale)
                s = att.o_proj(attn.flatten(-2)) + s
                y = layer.post_attention_layernorm(s)
                s = layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(y)) * layer.mlp.up_proj(y)) + s
            hidden = s
            outs.append(StepOutput(self.lm_head(self.norm(s)), s))
        return outs

    def head_weights(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().float().cpu() for n, t in self.state_dict().items()}

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().clone().cpu() for n, t in self.state_dict().items()}


def init_from_target(
    head: Eagle3Draft, target_state: dict[str, torch.Tensor], draft_ids: torch.Tensor, layer: int
) -> None:
    """lm_head: the target's rows of the draft vocabulary; norm: its final norm; decoder layer
    ``i`` of the head: the target's layer ``layer + i`` (the first's q/k/v embedding halves
    zero; past the target's last layer, its last); fc: ``[0, 0, I]``."""
    h = head.cfg["hidden_size"]
    lm = target_state.get("lm_head.weight", target_state["model.embed_tokens.weight"])
    last = max(int(k.split(".")[2]) for k in target_state if k.startswith("model.layers."))
    with torch.no_grad():
        head.lm_head.weight.copy_(lm[draft_ids])
        head.norm.weight.copy_(target_state["model.norm.weight"])
        for i, mid in enumerate(head.stack()):
            p = f"model.layers.{min(layer + i, last)}."
            if i == 0:
                mid.input_layernorm.weight.copy_(
                    target_state["model.layers.0.input_layernorm.weight"]
                )
                mid.hidden_norm.weight.copy_(target_state[p + "input_layernorm.weight"])
            else:
                mid.input_layernorm.weight.copy_(target_state[p + "input_layernorm.weight"])
            for name in ("q_proj", "k_proj", "v_proj"):
                w = getattr(mid.self_attn, name).weight
                w.zero_()
                w[:, -h:].copy_(target_state[p + f"self_attn.{name}.weight"])
            mid.self_attn.o_proj.weight.copy_(target_state[p + "self_attn.o_proj.weight"])
            mid.post_attention_layernorm.weight.copy_(
                target_state[p + "post_attention_layernorm.weight"]
            )
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(mid.mlp, name).weight.copy_(target_state[p + f"mlp.{name}.weight"])
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * h :].copy_(torch.eye(h))


# -- loss and acceptance ----------------------------------------------------------------------
def target_index(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """target id -> draft index, -1 for tokens outside the draft vocabulary."""
    idx = torch.full((vocab_size,), -1, dtype=torch.long)
    idx[draft_ids] = torch.arange(len(draft_ids))
    return idx


def step_loss(
    logits: torch.Tensor,
    j: int,
    topk_ids: torch.Tensor,
    topk_logits: torch.Tensor,
    t2d_index: torch.Tensor,
    draft_ids: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft cross entropy of draft step ``j`` (0-based: chain ``p`` predicts token
    ``p + j + 2``, whose distribution is the target's at position ``p + j + 1``) against the
    target's top-k restricted to the draft vocabulary and renormalised; and the top-1
    agreement with the target's greedy token. Positions without a draft-vocabulary token in
    the target's top-k are left out, and so are positions where ``keep`` ([B, T], indexed like
    the target's distributions) is False."""
    T = logits.shape[1]
    n = T - 1 - j
    if n <= 0:
        zero = logits.sum() * 0.0
        return zero, zero.detach()
    lg = logits[:, :n].float()
    tid = topk_ids[:, j + 1 :].long()
    tlg = topk_logits[:, j + 1 :].float()
    d = t2d_index[tid]
    inside = d >= 0
    has = inside.any(-1)
    if keep is not None:
        has = has & keep[:, j + 1 :].to(has.device)
    p = torch.softmax(tlg.masked_fill(~inside, float("-inf")), dim=-1)
    p = torch.where(has.unsqueeze(-1), p, torch.zeros_like(p))
    logp = torch.log_softmax(lg, dim=-1).gather(-1, d.clamp(min=0))
    per_pos = -(p * logp).sum(-1)
    count = has.sum().clamp(min=1)
    loss = (per_pos * has).sum() / count
    hit = (draft_ids[lg.argmax(-1)] == tid[..., 0]).float()
    if keep is None:
        agree = hit.mean()
    else:
        kept = keep[:, j + 1 :].to(hit.device).float()
        agree = (hit * kept).sum() / kept.sum().clamp(min=1)
    return loss, agree.detach()


def leading_accepted(
    head: Eagle3Draft, tokens: torch.Tensor, aux: torch.Tensor, draft_ids: torch.Tensor, k: int
) -> torch.Tensor:
    """[B, T]: how many of chain ``p``'s ``k`` drafted tokens, from the first on, equal tokens
    ``p + 2, p + 3, ...`` (the target's greedy continuation)."""
    with torch.no_grad():
        outs = head.ttt(tokens, aux, k)
    B, T = tokens.shape
    ok = torch.ones(B, T, dtype=torch.bool, device=tokens.device)
    n = torch.zeros(B, T, dtype=torch.long, device=tokens.device)
    for j, out in enumerate(outs):
        drafted = draft_ids[out.logits.argmax(-1)]  # chain p's token p + j + 2
        ref = torch.full_like(tokens, -1)
        ref[:, : max(T - j - 2, 0)] = tokens[:, j + 2 :]
        ok = ok & (drafted == ref)
        n += ok.long()
    return n


def acceptance(
    head: Eagle3Draft,
    tokens: torch.Tensor,
    aux: torch.Tensor,
    valid: torch.Tensor,
    draft_ids: torch.Tensor,
    k: int,
) -> list[float]:
    """Greedy acceptance per drafted position (1..k) over every chain start ``p`` with
    ``valid[b, p]``: draft token ``j`` of chain ``p`` is accepted when it equals token
    ``p + j + 1`` (the target's greedy continuation) and tokens ``1..j-1`` were accepted."""
    return rates_every_start(leading_accepted(head, tokens, aux, draft_ids, k), valid, k)


def rates_every_start(n: torch.Tensor, valid: torch.Tensor, k: int) -> list[float]:
    count = valid.sum().clamp(min=1)
    return [float(((n > j) & valid).sum() / count) for j in range(k)]


def rates_served(n: torch.Tensor, valid: torch.Tensor, k: int) -> list[float]:
    """Acceptance per drafted position over the chain starts a server visits: the first valid
    start of each row, then one past the last accepted token of each chain (vLLM drafts again
    after each verification). These starts fall right after rejections more often than every
    start does, where the head just failed, so this reads lower: it is what vLLM's counters
    report for the same head and text."""
    n_cpu, valid_cpu = n.cpu(), valid.cpu()
    seen = []
    for b in range(n_cpu.shape[0]):
        starts = valid_cpu[b].nonzero().flatten().tolist()
        if not starts:
            continue
        p, last = starts[0], starts[-1]
        while p <= last:
            if valid_cpu[b, p]:
                seen.append(int(n_cpu[b, p]))
            p += int(n_cpu[b, p]) + 1
    count = max(len(seen), 1)
    return [sum(x > j for x in seen) / count for j in range(k)]
