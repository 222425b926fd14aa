"""M2R2-style accelerated residuals for expert prediction: adapters, their files, training.

M2R2 (appendix A.3) prefetches experts from an *accelerated residual stream*: adapters trained
so that a cheap transform of layer l's residual approximates a later layer's slow residual,
whose router then names that layer's experts early. Here, per layer ``l`` and distance ``d``
(1..D), one low-rank parallel-MLP adapter (the paper's ``delta_mlp`` form) jumps the residual
stream d layers ahead::

    n      = h_l / rms(h_l)                        # h_l: residual after layer l's attention
    h^_l+d = rms(h_l) * (n + U_ld @ silu(D_ld @ n))

and layer l+d's experts are the top-k of ``router_{l+d}(post_attention_layernorm_{l+d}(h^))``.
The scale is carried through (the router reads a normalised input, so only the direction
matters, and the residual norms of this model span 3 to 26,000).

Why not the project's dense M2R2 adapters (``vllm_adaptive/m2r2/trained``): they are
speculation adapters (``mode="spec"``, k = 4 or 8) defined only for the first k layers, mapping
to slow layers 8/15/23/30 (k=4) or every ~3.75 (k=8), and their accelerated stream runs each
adapted layer's attention over the slow stream's K/V and the layer's whole MLP, i.e. all 16
experts: inside the engine's MLP that needs the KV cache and every expert resident, which is
what offloading avoids. Their fingerprint is also the dense model's. These adapters read only
the residual the MoE layer already has, for every layer l, for l+1..l+D.

Training (:func:`train_stream_adapters`, ``vllm-adaptive moe train-m2r2``): the MoEfied model
in transformers at the engine's top-k (its own residual stream, which depends on k) over
calibration windows of the corpora; every (l, d) adapter at once, minimising the cross entropy
of the predicted router distribution against the true one at l+d plus ``1 - cos`` between the
estimated and true residual (the M2R2 distillation, scale-free). Held-out windows give the
per-distance top-k recall of the adapters, of the zero adapter (``h^ = h_l``) and of pre-gating
(layer l+d's router on layer l's MLP input), written to the adapter's JSON.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FORMAT = "vllm-adaptive moe-m2r2 1"
JSON_NAME = "moe_m2r2.json"
TENSORS_NAME = "moe_m2r2.safetensors"


class StreamAdapterError(ValueError):
    """Adapters that cannot serve this engine: missing files, another model, other k or d."""


def _rms(h: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return h.pow(2).mean(-1, keepdim=True).add(eps).sqrt()


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm (float32)."""
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight


@dataclass
class StreamAdapterConfig:
    num_layers: int
    hidden_size: int
    distances: int  # D: adapters for l+1..l+D
    rank: int
    top_k: int  # the routing k whose residual stream they were trained on
    num_experts: int


class StreamAdapters(nn.Module):
    """``down`` [L, D, r, H] and ``up`` [L, D, H, r] (see the module docstring)."""

    def __init__(self, config: StreamAdapterConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        # float32 whatever the default dtype (vLLM builds models under bfloat16)
        f32 = torch.float32
        self.down = nn.Parameter(
            torch.zeros(c.num_layers, c.distances, c.rank, c.hidden_size, dtype=f32)
        )
        self.up = nn.Parameter(
            torch.zeros(c.num_layers, c.distances, c.hidden_size, c.rank, dtype=f32)
        )

    def init_identity(self, seed: int = 0) -> None:
        """Down-projections ~ N(0, 1/H), up-projections zero: the estimate starts at h_l."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.down.copy_(
                torch.randn(self.down.shape, generator=g) / math.sqrt(self.down.shape[-1])
            )
            self.up.zero_()

    def estimate(self, layer: int, distance: int, h: torch.Tensor) -> torch.Tensor:
        """Estimate of the residual ``distance`` layers after ``layer`` from ``h`` [T, H]."""
        h = h.float()
        scale = _rms(h)
        n = h / scale
        z = F.silu(n @ self.down[layer, distance - 1].t())
        return scale * (n + z @ self.up[layer, distance - 1].t())

    # -- files ---------------------------------------------------------------------------------
    def save(self, out: str | Path, meta: dict[str, Any] | None = None) -> Path:
        from safetensors.torch import save_file

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {
            "down": self.down.detach().float().contiguous(),
            "up": self.up.detach().float().contiguous(),
        }
        save_file(tensors, str(out / TENSORS_NAME))
        doc = {
            **(meta or {}),
            "format": FORMAT,
            "config": asdict(self.config),
            "tensors_sha256": hashlib.sha256((out / TENSORS_NAME).read_bytes()).hexdigest(),
        }
        (out / JSON_NAME).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        return out

    @classmethod
    def load(cls, directory: str | Path) -> tuple[StreamAdapters, dict[str, Any]]:
        from safetensors.torch import load_file

        d = Path(directory)
        jpath, tpath = d / JSON_NAME, d / TENSORS_NAME
        if not jpath.is_file() or not tpath.is_file():
            raise StreamAdapterError(
                f"{d}: no M2R2 expert-prediction adapters ({JSON_NAME}, {TENSORS_NAME}); train "
                "them with `vllm-adaptive moe train-m2r2 --model MODEL --top-k K --out DIR`"
            )
        try:
            meta = json.loads(jpath.read_text())
            config = StreamAdapterConfig(**meta["config"])
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise StreamAdapterError(f"{d}: {JSON_NAME} is unreadable ({e})") from None
        if meta.get("format") != FORMAT:
            raise StreamAdapterError(f"{d}: format {meta.get('format')!r}, expected {FORMAT!r}")
        if hashlib.sha256(tpath.read_bytes()).hexdigest() != meta.get("tensors_sha256"):
            raise StreamAdapterError(f"{d}: {TENSORS_NAME} does not match its sha256")
        ad = cls(config)
        tensors = load_file(str(tpath))
        if {k: tuple(v.shape) for k, v in tensors.items()} != {
            "down": tuple(ad.down.shape),
            "up": tuple(ad.up.shape),
        }:
            raise StreamAdapterError(f"{d}: tensor shapes do not match its config")
        ad.load_state_dict(tensors)
        return ad.eval().requires_grad_(False), meta


def load_for_engine(
    directory: str | Path,
    *,
    model_dir: str | Path | None,
    num_layers: int,
    hidden_size: int,
    num_experts: int,
    top_k: int,
    lookahead: int,
) -> StreamAdapters:
    """Load adapters and refuse (StreamAdapterError, naming the mismatch) ones that do not fit
    this engine: another model (fingerprint, shapes), another routing k, a lookahead beyond
    their distances."""
    ad, meta = StreamAdapters.load(directory)
    c = ad.config
    for name, want in (
        ("num_layers", num_layers),
        ("hidden_size", hidden_size),
        ("num_experts", num_experts),
    ):
        if getattr(c, name) != want:
            raise StreamAdapterError(
                f"{directory}: adapters for {name}={getattr(c, name)}, the model has {want}"
            )
    if c.top_k != top_k:
        raise StreamAdapterError(
            f"{directory}: adapters trained on the residual stream at top-k {c.top_k}, the engine "
            f"routes top-k {top_k} (train ones for it: `vllm-adaptive moe train-m2r2 --top-k "
            f"{top_k}`)"
        )
    if lookahead > c.distances:
        raise StreamAdapterError(
            f"{directory}: adapters predict up to {c.distances} layers ahead, lookahead is "
            f"{lookahead}"
        )
    if model_dir is not None and meta.get("model_fingerprint") is not None:
        from vllm_adaptive.artifacts import ProfileError, fingerprint_matches

        try:
            ok, fp = fingerprint_matches(meta["model_fingerprint"], model_dir)
        except ProfileError:
            ok, fp = True, None  # no fingerprintable weights here: the shape checks decide
        if not ok:
            raise StreamAdapterError(
                f"{directory}: adapters made for another model (fingerprint "
                f"{meta['model_fingerprint'][:12]}..., {model_dir} is {fp[:12]}...)"
            )
    return ad


# -- training -----------------------------------------------------------------------------------


def _topk_recall(pred_logits: torch.Tensor, true_logits: torch.Tensor, k: int) -> float:
    p = torch.zeros_like(pred_logits, dtype=torch.bool).scatter_(
        -1, pred_logits.topk(k, -1).indices, True
    )
    t = torch.zeros_like(true_logits, dtype=torch.bool).scatter_(
        -1, true_logits.topk(k, -1).indices, True
    )
    return ((p & t).sum().item()) / max(1, t.sum().item())


def train_stream_adapters(
    model_dir: str | Path,
    corpora: list[str | Path],
    out: str | Path,
    *,
    top_k: int | None = None,
    distances: int = 2,
    rank: int = 16,
    steps: int = 300,
    batch: int = 1024,
    lr: float = 3e-3,
    windows_per_corpus: int = 12,
    window: int = 256,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Train every (layer, distance) adapter of a MoEfied checkpoint (see the module docstring)
    and write them to ``out``. Returns the JSON written."""
    from transformers import AutoTokenizer

    from vllm_adaptive.artifacts import model_fingerprint
    from vllm_adaptive.moe.collect import collect_residuals
    from vllm_adaptive.moe.moefy import calibration_windows
    from vllm_adaptive.moe.reference import load_moefied, moefied_mlps

    torch.manual_seed(seed)
    t0 = time.perf_counter()
    model_dir = Path(model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    windows, corpus_info = calibration_windows(tok, list(corpora), window, windows_per_corpus)
    model = load_moefied(model_dir, top_k=top_k)
    mlps = moefied_mlps(model)
    k = mlps[0].top_k
    num_experts = mlps[0].num_experts
    # hold out every 10th window (both corpora; the last one when fewer) for the recall figures
    out_of = {i for i in range(len(windows)) if i % 10 == 9} or {len(windows) - 1}
    held = [w for i, w in enumerate(windows) if i in out_of]
    train_w = [w for i, w in enumerate(windows) if i not in out_of] or held
    bos = tok.bos_token_id
    if progress:
        print(
            f"[moe train-m2r2] residual streams of {len(windows)} windows at top-k {k}",
            file=sys.stderr,
        )
    h_train = collect_residuals(model, train_w, bos)
    h_held = collect_residuals(model, held, bos)
    t_collect = time.perf_counter() - t0
    layers = list(model.model.layers)
    L, _, H = h_train.shape
    norms = torch.stack(
        [layer.post_attention_layernorm.weight.detach().float() for layer in layers]
    )
    eps = float(layers[0].post_attention_layernorm.variance_epsilon)
    routers = torch.stack([m.router.weight.detach().float() for m in mlps])  # [L, E, H]
    config = StreamAdapterConfig(L, H, distances, rank, k, num_experts)
    ad = StreamAdapters(config)
    ad.init_identity(seed)
    opt = torch.optim.Adam(ad.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    g = torch.Generator().manual_seed(seed)

    def forward(h: torch.Tensor):
        """Predicted and true router logits per (l, d) for the token rows of ``h`` [L, B, H]."""
        scale = _rms(h)
        n = h / scale
        z = F.silu(torch.einsum("lbh,ldrh->ldbr", n, ad.down))
        est = scale[:, None] * (n[:, None] + torch.einsum("ldbr,ldhr->ldbh", z, ad.up))
        preds, trues, cos = [], [], []
        for d in range(1, distances + 1):
            src = torch.arange(0, L - d)
            tgt = src + d
            e = est[src, d - 1]  # [L-d, B, H]
            t = h[tgt]
            xe = rms_norm(e, norms[tgt][:, None], eps)
            xt = rms_norm(t, norms[tgt][:, None], eps)
            preds.append(torch.einsum("lbh,leh->lbe", xe, routers[tgt]))
            trues.append(torch.einsum("lbh,leh->lbe", xt, routers[tgt]))
            cos.append(F.cosine_similarity(e, t, dim=-1))
        return preds, trues, cos

    N = h_train.shape[1]
    t1 = time.perf_counter()
    for step in range(steps):
        idx = torch.randint(0, N, (batch,), generator=g)
        preds, trues, cos = forward(h_train[:, idx])
        loss = 0.0
        for p, t, c in zip(preds, trues, cos, strict=True):
            ce = -(F.softmax(t, -1) * F.log_softmax(p, -1)).sum(-1).mean()
            loss = loss + ce + (1 - c).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if progress and (step % 20 == 0 or step == steps - 1):
            print(
                f"[moe train-m2r2] step {step}/{steps} loss {loss.item():.4f} "
                f"({time.perf_counter() - t1:.0f} s)",
                file=sys.stderr,
            )
    t_train = time.perf_counter() - t1

    # held-out recall per distance: adapters, zero adapter (h^ = h_l), pre-gating
    ad.eval()
    recall: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        preds, trues, _ = forward(h_held)
        for d in range(1, distances + 1):
            src = torch.arange(0, L - d)
            tgt = src + d
            hs = h_held[src]
            zero = torch.einsum(
                "lbh,leh->lbe", rms_norm(hs, norms[tgt][:, None], eps), routers[tgt]
            )
            pre = torch.einsum("lbh,leh->lbe", rms_norm(hs, norms[src][:, None], eps), routers[tgt])
            t = trues[d - 1]
            recall[str(d)] = {
                "m2r2": _topk_recall(preds[d - 1], t, k),
                "zero_adapter": _topk_recall(zero, t, k),
                "pregate": _topk_recall(pre, t, k),
            }
    meta = {
        "label": "M2R2-style stream adapters for expert prediction (vllm_adaptive/moe/m2r2.py)",
        "model_dir": str(model_dir),
        "model_fingerprint": model_fingerprint(model_dir),
        "corpora": corpus_info,
        "train_tokens": int(N),
        "held_out_tokens": int(h_held.shape[1]),
        "options": {
            "steps": steps,
            "batch": batch,
            "lr": lr,
            "windows_per_corpus": windows_per_corpus,
            "window": window,
            "seed": seed,
        },
        "held_out_topk_recall": recall,
        "seconds": {"collect": t_collect, "train": t_train},
    }
    ad.save(out, meta)
    return json.loads((Path(out) / JSON_NAME).read_text())
