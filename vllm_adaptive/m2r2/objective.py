"""M2R2 adapter training's objective and its measurement: the loss (eq. 3 of the paper,
normalised: CE, per-token relative distillation error, the ARLA routers' BCE), the validation
pass on held-out windows (CE, agreement with the full model, the adapter-free early exit at the
same depth) and the training curves' plot (:mod:`vllm_adaptive.m2r2.train` runs the loop)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from vllm_adaptive.m2r2.adapters import (
    AdapterConfig,
    M2R2Adapters,
)
from vllm_adaptive.m2r2.args import TrainOptions
from vllm_adaptive.m2r2.reference import (
    SlowStream,
    accelerated_stream,
    readout,
    slow_forward,
)


def relative_sq_error(p: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """mean over tokens of ||p - h||^2 / ||h||^2 (h is a constant target)."""
    num = (p - h).pow(2).sum(-1)
    den = h.pow(2).sum(-1).clamp_min(1e-6)
    return (num / den).mean()


def labels_for(window: torch.Tensor, slow: SlowStream, which: str) -> torch.Tensor:
    """[B, T] labels for inputs window[:, :-1]."""
    if which == "corpus":
        return window[:, 1:]
    if which == "model":
        return slow.greedy
    raise ValueError(f"labels must be 'corpus' or 'model', got {which!r}")


def m2r2_losses(
    model,
    adapters: M2R2Adapters,
    slow: SlowStream,
    labels: torch.Tensor,
    opts: TrainOptions,
    corpus_labels: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Loss and per-gate statistics for one batch (slow stream precomputed). With
    ``corpus_labels``, also the per-gate CE against the text and against the model's greedy
    tokens (validation)."""
    cfg = adapters.config
    targets = cfg.distill_targets()
    ces, dists, agrees, bces, router, ce_c, ce_m = [], [], [], [], [], [], []
    for start, stop in cfg.intervals:
        ps = accelerated_stream(model, adapters, slow, start, stop)
        for i, p in zip(range(start + 1, stop + 1), ps, strict=True):
            dists.append(relative_sq_error(p, slow.hidden[targets[i]]))
        logits = readout(model, ps[-1])
        ces.append(F.cross_entropy(logits.flatten(0, 1), labels.flatten()))
        hit = logits.argmax(-1) == slow.greedy
        agrees.append(hit.float().mean())
        if corpus_labels is not None:
            with torch.no_grad():
                flat = logits.detach().flatten(0, 1)
                ce_c.append(float(F.cross_entropy(flat, corpus_labels.flatten())))
                ce_m.append(float(F.cross_entropy(flat, slow.greedy.flatten())))
        if cfg.mode == "exit":
            states = torch.stack([slow.hidden[start], *[p.detach() for p in ps]], dim=2)
            logit = adapters.routers[len(bces)](states.flatten(0, 1))
            y = hit.flatten().float()
            bces.append(F.binary_cross_entropy_with_logits(logit, y))
            router.append((logit.detach(), y))
        del logits
    ce = torch.stack(ces).mean()
    distill = torch.stack(dists).mean()
    loss = opts.alpha0 * ce + opts.alpha1 * distill
    out = {"ce": ce, "distill": distill, "agree": torch.stack(agrees).mean()}
    if bces:
        bce = torch.stack(bces).mean()
        loss = loss + opts.alpha_router * bce
        out["bce"] = bce
        out["router"] = router
    out["loss"] = loss
    out["agree_per_gate"] = [float(a) for a in agrees]
    out["ce_per_gate"] = [float(c.detach()) for c in ces]
    if corpus_labels is not None:
        out["ce_corpus_per_gate"], out["ce_model_per_gate"] = ce_c, ce_m
    return out


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    """ROC AUC via the rank statistic (ties averaged); None if one class is missing."""
    pos = int(labels.sum())
    neg = labels.numel() - pos
    if pos == 0 or neg == 0:
        return None
    order = scores.argsort()
    ranks = torch.empty_like(scores, dtype=torch.float64)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    # average ranks over ties
    uniq, inv = torch.unique(scores, return_inverse=True)
    if uniq.numel() != scores.numel():
        sums = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inv, ranks)
        cnt = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(
            0, inv, torch.ones_like(ranks)
        )
        ranks = (sums / cnt)[inv]
    return float((ranks[labels.bool()].sum() - pos * (pos + 1) / 2) / (pos * neg))


# -- validation ------------------------------------------------------------------------------
class Validator:
    """Held-out windows with their slow streams computed once (only the K/V and residual states
    the adapters need are kept), plus the adapter-free early-exit baseline."""

    def __init__(self, model, cfg: AdapterConfig, windows: torch.Tensor, opts: TrainOptions, dev):
        self.opts = opts
        self.chunks: list[tuple[SlowStream, torch.Tensor]] = []
        keep = {start for start, _ in cfg.intervals} | set(cfg.distill_targets().values())
        gates = [stop for _, stop in cfg.intervals]
        keep |= set(gates)
        stats = {g: {"ce_corpus": 0.0, "ce_model": 0.0, "agree": 0.0} for g in gates}
        tokens = 0
        for s in range(0, windows.shape[0], opts.batch):
            w = windows[s : s + opts.batch].to(dev)
            slow = slow_forward(model, w[:, :-1], kv_layers=cfg.adapted_layers)
            n = w[:, 1:].numel()
            with torch.no_grad():
                for g in gates:
                    logits = readout(model, slow.hidden[g]).flatten(0, 1)
                    st = stats[g]
                    st["ce_corpus"] += float(F.cross_entropy(logits, w[:, 1:].flatten())) * n
                    st["ce_model"] += float(F.cross_entropy(logits, slow.greedy.flatten())) * n
                    st["agree"] += float((logits.argmax(-1) == slow.greedy.flatten()).sum())
            tokens += n
            self.chunks.append((slow.detach_subset(keep), w))
        self.tokens = tokens
        self.baseline = {
            g: {k: v / max(1, tokens) for k, v in st.items()} for g, st in stats.items()
        }

    @torch.no_grad()
    def run(self, model, adapters: M2R2Adapters) -> dict[str, Any]:
        cfg = adapters.config
        gates = [stop for _, stop in cfg.intervals]
        sums = {"loss": 0.0, "ce": 0.0, "distill": 0.0, "agree": 0.0, "bce": 0.0}
        ce_c = [0.0] * len(gates)
        ce_m = [0.0] * len(gates)
        agree = [0.0] * len(gates)
        scores: list[list[torch.Tensor]] = [[] for _ in gates]
        ys: list[list[torch.Tensor]] = [[] for _ in gates]
        for slow, w in self.chunks:
            n = w[:, 1:].numel()
            labels = labels_for(w, slow, self.opts.labels)
            out = m2r2_losses(model, adapters, slow, labels, self.opts, corpus_labels=w[:, 1:])
            for key in sums:
                if key in out:
                    sums[key] += float(out[key]) * n
            for j in range(len(gates)):
                ce_c[j] += out["ce_corpus_per_gate"][j] * n
                ce_m[j] += out["ce_model_per_gate"][j] * n
                agree[j] += out["agree_per_gate"][j] * n
            for j, (logit, y) in enumerate(out.get("router", [])):
                scores[j].append(logit.float().cpu())
                ys[j].append(y.cpu())
        t = max(1, self.tokens)
        rec: dict[str, Any] = {k: v / t for k, v in sums.items() if k != "bce" or scores[0]}
        per_gate = []
        for j, g in enumerate(gates):
            base = self.baseline[g]
            item = {
                "gate": g,
                "ce_corpus": ce_c[j] / t,
                "ce_model": ce_m[j] / t,
                "agree": agree[j] / t,
                "baseline_ce_corpus": base["ce_corpus"],
                "baseline_ce_model": base["ce_model"],
                "baseline_agree": base["agree"],
            }
            if scores[j]:
                sc, y = torch.cat(scores[j]), torch.cat(ys[j])
                item["router_auc"] = auc(sc, y)
                item["router_acc"] = float(((sc > 0).float() == y).float().mean())
                item["exit_rate@0.5"] = float((sc > 0).float().mean())
            per_gate.append(item)
        rec["gates"] = per_gate
        # headline numbers: the (last) gate of spec mode, the mean over gates in exit mode
        for key in ("ce_corpus", "ce_model", "agree"):
            rec[key] = sum(it[key] for it in per_gate) / len(per_gate)
            rec["baseline_" + key] = sum(it["baseline_" + key] for it in per_gate) / len(per_gate)
        rec["tokens"] = self.tokens
        return rec


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curves(records: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = [r for r in records if r.get("kind") == "train"]
    va = [r for r in records if r.get("kind") == "val"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))

    def ema(xs, a=0.9):
        out, m = [], None
        for x in xs:
            m = x if m is None else a * m + (1 - a) * x
            out.append(m)
        return out

    panels = [
        ("loss", "loss (alpha0 CE + alpha1 distill)", None),
        ("ce", "cross entropy (training labels)", "baseline_ce"),
        ("agree", "top-1 agreement with the full model", "baseline_agree"),
    ]
    which = next((r.get("labels") for r in va if r.get("labels")), "corpus")
    labels_key = "ce_model" if which == "model" else "ce_corpus"
    for ax, (key, name, base) in zip(axes, panels, strict=True):
        if tr:
            xs = [r["step"] for r in tr]
            ys = [r[key] for r in tr]
            ax.plot(xs, ys, color="tab:blue", alpha=0.25, lw=0.8)
            ax.plot(xs, ema(ys), color="tab:blue", label="train (EMA)")
        if va:
            xs = [r["step"] for r in va]
            vkey = labels_key if key == "ce" else key
            ax.plot(xs, [r[vkey] for r in va], "o-", color="tab:orange", label="validation M2R2")
            if base:
                bkey = "baseline_" + (labels_key if key == "ce" else key)
                ax.axhline(va[-1][bkey], color="gray", ls="--", label="validation early exit")
            gates = va[-1].get("gates", [])
            if key == "agree" and len(gates) > 1:
                for j, g in enumerate(gates):
                    ys = [r["gates"][j]["agree"] for r in va]
                    ax.plot(xs, ys, ":", lw=1, label=f"gate {g['gate']}")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
