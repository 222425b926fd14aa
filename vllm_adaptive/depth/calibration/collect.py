"""Teacher-forcing pass: hidden states at probe layers plus the final readout's entropy/argmax.

Calibration needs, per token, the intermediate hidden states and what the full model would
have said. Memory is bounded by keeping only the last `keep` positions of each window: they
stay contiguous, so the exit simulator can treat each window as one decode stream (with the
earlier positions acting as its prompt).

The exit signals that compare consecutive layers (QuickSilver's drift, River's cosine) get
their per-token scalars at *every* layer 1..L-1 here, from the full hidden-state stack of the
forward pass, so they cost [L-1, N] floats whatever the probe spacing; only the probe layers'
hidden states are stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_adaptive.corpora import token_windows_with_next
from vllm_adaptive.depth.readout import Readout, entropy_nats


@dataclass
class CollectConfig:
    window: int = 256
    tokens: int = 256 * 32  # total teacher-forced tokens (window * number of windows)
    keep: int = 64  # last positions of each window that are stored
    probe_every: int = 2
    probe_layers: list[int] | None = None  # explicit override (1-based block outputs)
    temperature: float = 1.0

    @property
    def num_windows(self) -> int:
        return max(1, self.tokens // self.window)


@dataclass
class Collected:
    """Everything calibration needs; N = windows * keep tokens, stream-major."""

    probe_layers: list[int]  # 1-based: output of block l (hidden_states[l] in HF)
    num_layers: int
    hidden: torch.Tensor  # [P, N, d] raw block outputs: float16, float32 where it overflows
    final_normed: torch.Tensor  # [N, d] float32, input to lm_head at the last layer
    final_entropy: torch.Tensor  # [N] nats at `temperature`
    final_argmax: torch.Tensor  # [N] int64
    context: torch.Tensor  # [N] context length (position + 1) of each token
    drift: torch.Tensor  # [L-1, N] float32: ||h_l - h_{l-1}||_2, row l-1 is layer l (h_0: embeds)
    cosine: torch.Tensor  # [L-1, N] float32: cos(h_{l-1}, h_l), same indexing
    token_ids: torch.Tensor  # [N] int64: the input token at each position
    targets: torch.Tensor  # [N] int64: the next token of the text (-1 past the end of the text)
    final_nll: torch.Tensor  # [N] float32: -log p_final(target) at T=1 (nan where target is -1)
    num_streams: int
    stream_len: int
    temperature: float


def default_probe_layers(num_layers: int, every: int) -> list[int]:
    """Every `every`-th block output below the last one (exiting at L is no exit)."""
    return [layer for layer in range(every, num_layers, every)]


def load_model(model_dir: str | Path):
    """float32 CPU model and tokenizer, plus its `Readout`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    inner = model.model
    eps = float(getattr(inner.norm, "variance_epsilon", model.config.rms_norm_eps))
    readout = Readout(
        norm_weight=rmsnorm_scale(inner.norm, int(model.config.hidden_size), eps),
        eps=eps,
        unembed=model.lm_head.weight.detach().float(),
    )
    return model, tok, readout


@torch.no_grad()
def rmsnorm_scale(norm: torch.nn.Module, hidden: int, eps: float) -> torch.Tensor:
    """The per-channel scale an RMSNorm applies after normalizing, read off the module itself:
    its ``weight`` for Llama, ``1 + weight`` for Gemma (a row of ones has RMS 1)."""
    ones = torch.ones(1, hidden, dtype=torch.float32)
    return (norm(ones)[0].float() * (1.0 + eps) ** 0.5).clone()


def layer_transitions(hidden_states, num_layers: int, keep: int) -> tuple[torch.Tensor, ...]:
    """Drift ||h_l - h_{l-1}|| and cos(h_{l-1}, h_l) for l = 1..L-1 over the last `keep`
    positions of one sequence; [L-1, keep] float32 each. (HF's hidden_states[L] is after the
    final norm, so layer L has no raw stream to compare.)"""
    drift, cos = [], []
    for layer in range(1, num_layers):
        a = hidden_states[layer - 1][0, -keep:].float()
        b = hidden_states[layer][0, -keep:].float()
        drift.append((b - a).norm(dim=-1))
        cos.append(torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-12))
    return torch.stack(drift), torch.stack(cos)


_FP16_MAX = 65504.0


def _compact(h: torch.Tensor) -> torch.Tensor:
    """float16 where the states fit (half the memory), else float32: Gemma 3's residual stream
    reaches beyond float16's range at middle layers, where it would turn to inf."""
    return h.half() if float(h.abs().max()) < _FP16_MAX else h.float()


def _cat_compact(parts: list[torch.Tensor]) -> torch.Tensor:
    if all(p.dtype == torch.float16 for p in parts):
        return torch.cat(parts, dim=1)
    return torch.cat([p.float() for p in parts], dim=1)


@torch.no_grad()
def collect(model, tok, texts: list[str], cfg: CollectConfig, progress: bool = True) -> Collected:
    num_layers = int(model.config.num_hidden_layers)
    probes = cfg.probe_layers or default_probe_layers(num_layers, cfg.probe_every)
    if not probes or min(probes) < 1 or max(probes) >= num_layers:
        raise ValueError(f"probe layers must lie in 1..{num_layers - 1}: {probes}")
    windows, nexts = token_windows_with_next(tok, texts, cfg.window, cfg.num_windows)
    keep = min(cfg.keep, cfg.window)
    hid, fin, ent, arg, drift, cos, ids, tgt, nll = [], [], [], [], [], [], [], [], []
    for w, nxt in tqdm(
        list(zip(windows, nexts, strict=True)),
        desc="teacher forcing",
        unit="window",
        disable=not progress,
    ):
        out = model(torch.tensor([w]), output_hidden_states=True)
        hs = out.hidden_states  # [0]=embeddings, [l]=block l, [L]=after final norm
        hid.append(_compact(torch.stack([hs[p][0, -keep:] for p in probes])))
        fin.append(hs[num_layers][0, -keep:].float())
        logits = out.logits[0, -keep:].float()
        ent.append(entropy_nats(logits, cfg.temperature))
        arg.append(logits.argmax(-1))
        d, c = layer_transitions(hs, num_layers, keep)
        drift.append(d)
        cos.append(c)
        ids.append(torch.tensor(w[-keep:], dtype=torch.long))
        t = torch.tensor([*w[len(w) - keep + 1 :], nxt], dtype=torch.long)
        tgt.append(t)
        lp = torch.log_softmax(logits, dim=-1).gather(1, t.clamp_min(0)[:, None])[:, 0]
        nll.append(torch.where(t >= 0, -lp, torch.full_like(lp, float("nan"))))
    ctx = torch.arange(cfg.window - keep + 1, cfg.window + 1).repeat(len(windows))
    return Collected(
        probe_layers=list(probes),
        num_layers=num_layers,
        hidden=_cat_compact(hid),
        final_normed=torch.cat(fin),
        final_entropy=torch.cat(ent),
        final_argmax=torch.cat(arg),
        context=ctx,
        drift=torch.cat(drift, dim=1),
        cosine=torch.cat(cos, dim=1),
        token_ids=torch.cat(ids),
        targets=torch.cat(tgt),
        final_nll=torch.cat(nll),
        num_streams=len(windows),
        stream_len=keep,
        temperature=cfg.temperature,
    )
