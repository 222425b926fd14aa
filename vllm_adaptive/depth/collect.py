"""Teacher-forcing pass: hidden states at probe layers plus the final readout's entropy/argmax.

Calibration needs, per token, the intermediate hidden states and what the full model would
have said. Memory is bounded by keeping only the last `keep` positions of each window: they
stay contiguous, so the exit simulator can treat each window as one decode stream (with the
earlier positions acting as its prompt).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

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
    hidden: torch.Tensor  # [P, N, d] float16, raw block outputs
    final_normed: torch.Tensor  # [N, d] float32, input to lm_head at the last layer
    final_entropy: torch.Tensor  # [N] nats at `temperature`
    final_argmax: torch.Tensor  # [N] int64
    context: torch.Tensor  # [N] context length (position + 1) of each token
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
    readout = Readout(
        norm_weight=inner.norm.weight.detach().float().clone(),
        eps=float(getattr(inner.norm, "variance_epsilon", model.config.rms_norm_eps)),
        unembed=model.lm_head.weight.detach().float(),
    )
    return model, tok, readout


def token_windows_from_texts(tok, texts: list[str], window: int, count: int) -> list[list[int]]:
    """`count` windows of `window` tokens spread evenly over the concatenated texts."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tok(text, add_special_tokens=False)["input_ids"])
    available = len(ids) // window
    if available < 1:
        raise ValueError(f"calibration text has {len(ids)} tokens: shorter than one window")
    count = min(count, available)
    stride = available // count
    return [ids[i * stride * window : (i * stride + 1) * window] for i in range(count)]


@torch.no_grad()
def collect(model, tok, texts: list[str], cfg: CollectConfig, progress: bool = True) -> Collected:
    num_layers = int(model.config.num_hidden_layers)
    probes = cfg.probe_layers or default_probe_layers(num_layers, cfg.probe_every)
    if not probes or min(probes) < 1 or max(probes) >= num_layers:
        raise ValueError(f"probe layers must lie in 1..{num_layers - 1}: {probes}")
    windows = token_windows_from_texts(tok, texts, cfg.window, cfg.num_windows)
    keep = min(cfg.keep, cfg.window)
    hid, fin, ent, arg = [], [], [], []
    for w in tqdm(windows, desc="teacher forcing", unit="window", disable=not progress):
        out = model(torch.tensor([w]), output_hidden_states=True)
        hs = out.hidden_states  # [0]=embeddings, [l]=block l, [L]=after final norm
        hid.append(torch.stack([hs[p][0, -keep:] for p in probes]).half())
        fin.append(hs[num_layers][0, -keep:].float())
        logits = out.logits[0, -keep:].float()
        ent.append(entropy_nats(logits, cfg.temperature))
        arg.append(logits.argmax(-1))
    ctx = torch.arange(cfg.window - keep + 1, cfg.window + 1).repeat(len(windows))
    return Collected(
        probe_layers=list(probes),
        num_layers=num_layers,
        hidden=torch.cat(hid, dim=1),
        final_normed=torch.cat(fin),
        final_entropy=torch.cat(ent),
        final_argmax=torch.cat(arg),
        context=ctx,
        num_streams=len(windows),
        stream_len=keep,
        temperature=cfg.temperature,
    )
