"""Calibrating contextual token fusion (QuickSilver D.3) against a perplexity tolerance.

The paper takes tau_fuse as the 15th percentile of the adjacent-pair L2 distances at layers
{10, 15, 20} on calibration text. Its raw distances grow with depth, so one tau cannot serve
every layer; here each fusion layer gets its own tau, and the percentile is not fixed but
chosen, as the other signals' thresholds are (`quicksilver.py`), for a perplexity
tolerance:

1. calibration text only (`corpora.py`'s split), cut into prompt + continuation windows; the
   first half of them ("fit") give the distance distributions, the rest ("val") the figures;
2. layers in order: the distances of the fusable adjacent pairs at layer l (with the taus
   already chosen for the earlier fusion layers applied) on the fit windows; candidate taus
   are the grid of their percentiles (the paper's 15th among them);
3. each candidate is run on the val windows with `fusion_reference.fused_forward` (fusion
   exactly as the engine's mask strategy would run it): fraction of the prompt's token-layers
   removed, teacher-forced perplexity of the continuation and greedy agreement, against no
   fusion in the same run;
4. the layer's tau is the candidate that removes most while the perplexity stays within
   ``max_ppl_increase`` of no fusion (all layers chosen so far together); 0 (never fuses) and
   ``met: false`` for that layer when none does.

Exemptions are fixed before calibrating and stored in the profile: the tokenizer's special
tokens, the anchor strings' token sequences, and rare tokens (a token-frequency table counted
on the calibration text; ids seen fewer than ``rare_min_count`` times).

The profile (`artifacts.py`, ``kind: "fusion"``) holds the per-layer taus, the rule, the
exemptions, the grid and the figures, and the frequency table as a tensor; `load_fusion_profile`
refuses one made for another model or of another kind. No vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from vllm_adaptive.artifacts import Profile, ProfileError, load_profile, save_profile
from vllm_adaptive.corpora import prompt_bos, read_corpus, token_windows_with_next
from vllm_adaptive.depth.calibration.fusion_reference import FusionRun, fused_forward, prefix_state
from vllm_adaptive.depth.policies.fusion import (
    FusionRule,
    anchor_sequences,
    exemption_mask,
)

KIND = "fusion"
DEFAULT_ANCHORS = ("Question:", "Answer:")


@dataclass
class FusionCalibration:
    layers: tuple[int, ...] = (10, 15, 20)  # D.3's calibration layers (fusion after l blocks)
    percentiles: tuple[float, ...] = (1.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0)
    max_ppl_increase: float = 0.01
    weighting: str = "uniform"
    tau_attn: float | None = None
    max_group: int | None = None
    split_repeats: bool = False
    anchors: tuple[str, ...] = DEFAULT_ANCHORS
    rare_min_count: int = 3
    prompt_len: int = 512
    continuation: int = 64
    fit_windows: int = 4
    val_windows: int = 8


@dataclass
class Exemptions:
    special_ids: tuple[int, ...]
    anchors: tuple[tuple[int, ...], ...]
    token_counts: torch.Tensor  # [V] int
    rare_min_count: int

    def mask(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        return exemption_mask(
            torch.tensor(list(prompt_ids), dtype=torch.long),
            self.special_ids,
            self.anchors,
            self.token_counts,
            self.rare_min_count,
        )


def token_counts(tok, texts: Sequence[str], vocab_size: int) -> torch.Tensor:
    """[V] occurrences of each token id in ``texts`` (the rare-token table)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for text in texts:
        for start in range(0, len(text), 200_000):  # bounded tokenizer calls
            ids = tok(text[start : start + 200_000], add_special_tokens=False)["input_ids"]
            counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)[
                :vocab_size
            ]
    return counts


def build_exemptions(tok, texts: Sequence[str], vocab_size: int, opts: FusionCalibration):
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return Exemptions(
        special_ids=tuple(sorted(int(i) for i in tok.all_special_ids)),
        anchors=anchor_sequences(enc, opts.anchors),
        token_counts=token_counts(tok, texts, vocab_size),
        rare_min_count=opts.rare_min_count,
    )


def windows(tok, texts: Sequence[str], prompt_len: int, continuation: int, count: int):
    """``count`` windows of prompt + continuation tokens (with the BOS vLLM would add)."""
    bos = prompt_bos(tok)
    width = prompt_len + continuation - (bos is not None)
    ws, _ = token_windows_with_next(tok, list(texts), width, count)
    if len(ws) < count:
        raise ValueError(
            f"the text holds {len(ws)} windows of {width} tokens, {count} asked: give more "
            "text or fewer/shorter windows"
        )
    return [([bos] if bos is not None else []) + w for w in ws]


@dataclass
class Figures:
    removed_fraction: float  # of the prompts' token-layers
    ppl: float
    ppl_base: float
    agreement: float  # greedy continuation predictions equal to no fusion's
    groups: int

    @property
    def ppl_ratio(self) -> float:
        return self.ppl / self.ppl_base


def figures(runs: Sequence[FusionRun], bases: Sequence[FusionRun]) -> Figures:
    nll = torch.cat([r.nll for r in runs])
    base = torch.cat([b.nll for b in bases])
    agree = torch.cat([(r.argmax == b.argmax).float() for r, b in zip(runs, bases, strict=True)])
    removed = sum(r.removed_fraction * r.prompt_len for r in runs) / sum(r.prompt_len for r in runs)
    return Figures(
        removed_fraction=float(removed),
        ppl=float(nll.mean().exp()),
        ppl_base=float(base.mean().exp()),
        agreement=float(agree.mean()),
        groups=sum(len(r.events) for r in runs),
    )


def _rules(taus: dict[int, float], opts: FusionCalibration) -> dict[int, FusionRule]:
    return {
        layer: FusionRule(tau, opts.tau_attn, opts.weighting, opts.max_group, opts.split_repeats)
        for layer, tau in taus.items()
    }


def calibrate_fusion(
    model_dir: str | Path,
    corpora: Sequence[str | Path],
    out: str | Path,
    opts: FusionCalibration,
    progress: bool = True,
) -> dict[str, Any]:
    """Choose tau_fuse per layer on the calibration part of ``corpora``; write the profile."""
    from vllm_adaptive.depth.calibration.collect import load_model

    t0 = time.perf_counter()
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    files = [read_corpus(c) for c in corpora]
    texts = [f.calibration_text for f in files]
    model, tok, _ = load_model(model_dir)
    num_layers = int(model.config.num_hidden_layers)
    layers = sorted(set(opts.layers))
    if not layers or layers[0] < 1 or layers[-1] >= num_layers:
        raise ValueError(f"fusion layers must lie in 1..{num_layers - 1}: {list(opts.layers)}")
    FusionRule(0.0, opts.tau_attn, opts.weighting, opts.max_group)  # check the options
    exem = build_exemptions(tok, texts, int(model.config.vocab_size), opts)
    # windows spread evenly over each file, taken from the files in turn (every corpus takes
    # part in both sets); the first ones give the distances, the others the figures
    total = opts.fit_windows + opts.val_windows
    per_file = [windows(tok, [t], opts.prompt_len, opts.continuation, -(-total // len(texts)))
                for t in texts]  # fmt: skip
    ws = [w for group in zip(*per_file, strict=True) for w in group][:total]
    fit, val = ws[: opts.fit_windows], ws[opts.fit_windows :]
    p = opts.prompt_len

    def bar(total: int, desc: str):
        return tqdm(total=total, desc=desc, unit="fwd", disable=not progress)

    probe = _rules(dict.fromkeys(layers, 0.0), opts)
    with bar(len(fit) + 2 * len(val), "prefix states") as b:
        starts_fit = []
        for w in fit:
            starts_fit.append(prefix_state(model, w, layers[0], probe))
            b.update()
        starts_val, bases = [], []
        for w in val:
            starts_val.append(prefix_state(model, w, layers[0], probe))
            b.update()
            bases.append(fused_forward(model, w, p, {}, start=starts_val[-1]))
            b.update()
    ex_fit = [exem.mask(w[:p]) for w in fit]
    ex_val = [exem.mask(w[:p]) for w in val]
    chosen: dict[int, float] = {}
    grid_rows: list[dict[str, Any]] = []
    per_layer: dict[str, Any] = {}
    limit = 1.0 + opts.max_ppl_increase
    for layer in layers:
        # distances at this layer with the earlier layers' choices applied (fit windows)
        trial = _rules({**chosen, layer: 0.0}, opts)
        dists = torch.cat(
            [
                fused_forward(model, w, p, trial, exempt=e, start=s).distances[layer]
                for w, e, s in zip(fit, ex_fit, starts_fit, strict=True)
            ]
        )
        rows = []
        with bar(len(opts.percentiles) * len(val), f"layer {layer} grid") as b:
            for pct in opts.percentiles:
                tau = float(torch.quantile(dists, pct / 100.0))
                rules = _rules({**chosen, layer: tau}, opts)
                runs = []
                for w, e, s in zip(val, ex_val, starts_val, strict=True):
                    runs.append(fused_forward(model, w, p, rules, exempt=e, start=s))
                    b.update()
                f = figures(runs, bases)
                row = {"layer": layer, "percentile": pct, "tau": tau, **asdict(f),
                       "ppl_ratio": f.ppl_ratio}  # fmt: skip
                rows.append(row)
                if progress:
                    print(
                        f"  layer {layer} p{pct:g} tau {tau:.2f}: removed "
                        f"{f.removed_fraction:.3f} ppl x{f.ppl_ratio:.4f} agree {f.agreement:.3f}",
                        flush=True,
                    )
        grid_rows += rows
        ok = [r for r in rows if r["ppl_ratio"] <= limit and r["removed_fraction"] > 0]
        best = max(ok, key=lambda r: (r["removed_fraction"], -r["ppl_ratio"])) if ok else None
        chosen[layer] = best["tau"] if best else 0.0
        per_layer[str(layer)] = {
            "tau": chosen[layer],
            "met": best is not None,
            "percentile": best["percentile"] if best else None,
            "distance_quantiles": {
                str(q): float(torch.quantile(dists, q / 100.0)) for q in (5, 15, 25, 50, 75)
            },
        }
    final_runs = [
        fused_forward(model, w, p, _rules(chosen, opts), exempt=e, start=s)
        for w, e, s in zip(val, ex_val, starts_val, strict=True)
    ]
    final = figures(final_runs, bases)
    meta: dict[str, Any] = {
        "kind": KIND,
        "layers": layers,
        "tau_fuse": {str(k): v for k, v in chosen.items()},
        "per_layer": per_layer,
        "met": all(v["met"] for v in per_layer.values()),
        "distance": "L2 of the raw residual stream after l blocks (not normalised)",
        "groups": "runs of adjacent fusable pairs (pairwise chaining), last row kept",
        "weighting": opts.weighting,
        "tau_attn": opts.tau_attn,
        "max_group": opts.max_group,
        "split_repeats": opts.split_repeats,
        "anchors": list(opts.anchors),
        "anchor_ids": [list(a) for a in exem.anchors],
        "special_ids": list(exem.special_ids),
        "rare_min_count": opts.rare_min_count,
        "max_ppl_increase": opts.max_ppl_increase,
        "prompt_len": opts.prompt_len,
        "continuation": opts.continuation,
        "fit_windows": len(fit),
        "val_windows": len(val),
        "val_figures": {**asdict(final), "ppl_ratio": final.ppl_ratio},
        "grid": grid_rows,
        "corpora": [{"path": str(f.path), "sha256": f.sha256} for f in files],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    tensors = {
        "fusion_layers": torch.tensor(layers, dtype=torch.int32),
        "fusion_tau": torch.tensor([chosen[x] for x in layers], dtype=torch.float32),
        "fusion_token_counts": exem.token_counts.to(torch.int32),
    }
    save_profile(Profile(meta=meta, tensors=tensors), out, model_dir)
    return meta


@dataclass
class FusionProfile:
    rules: dict[int, FusionRule]
    exemptions: Exemptions
    meta: dict[str, Any]


def load_fusion_profile(profile_dir: str | Path, model_dir: str | Path) -> FusionProfile:
    """The rules and exemptions of a fusion profile made for this model (``ProfileError``
    naming the problem otherwise)."""
    prof = load_profile(profile_dir, model_dir)
    if prof.meta.get("kind") != KIND:
        raise ProfileError(
            f"profile {profile_dir} is a {prof.meta.get('kind', 'depth')!r} profile, not a "
            "fusion profile (make one with `vllm-adaptive calibrate --fusion`)"
        )
    m = prof.meta
    layers = [int(x) for x in prof.tensors["fusion_layers"].tolist()]
    taus = [float(x) for x in prof.tensors["fusion_tau"].tolist()]
    rules = {
        layer: FusionRule(
            tau,
            m.get("tau_attn"),
            m["weighting"],
            m.get("max_group"),
            m.get("split_repeats", False),
        )
        for layer, tau in zip(layers, taus, strict=True)
        if tau > 0.0
    }
    ex = Exemptions(
        special_ids=tuple(m["special_ids"]),
        anchors=tuple(tuple(a) for a in m["anchor_ids"]),
        token_counts=prof.tensors["fusion_token_counts"].long(),
        rare_min_count=int(m["rare_min_count"]),
    )
    return FusionProfile(rules=rules, exemptions=ex, meta=m)


def evaluate(
    model,
    tok,
    texts: Sequence[str],
    prof: FusionProfile,
    prompt_len: int,
    continuation: int,
    count: int,
    progress: bool = True,
) -> tuple[Figures, list[FusionRun], list[list[int]]]:
    """Fusion against no fusion on ``count`` windows of ``texts`` (give held-out text)."""
    ws = windows(tok, texts, prompt_len, continuation, count)
    runs, bases = [], []
    first = min(prof.rules, default=len(model.model.layers))
    for w in tqdm(ws, desc=f"evaluate {prompt_len}", unit="window", disable=not progress):
        start = prefix_state(model, w, first, prof.rules)  # shared by both runs
        bases.append(fused_forward(model, w, prompt_len, {}, start=start))
        exempt = prof.exemptions.mask(w[:prompt_len])
        runs.append(fused_forward(model, w, prompt_len, prof.rules, exempt=exempt, start=start))
    return figures(runs, bases), runs, ws


def plot_events(run: FusionRun, path: str | Path, title: str = "") -> None:
    """Fusion events along one prompt: each group as a bar over the tokens it merges, at the
    layer it fused; the prompt's active rows per block on the side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(
        1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [4, 1]}, sharey=True
    )
    for e in run.events:
        ax.plot([e.first_token, e.last_token], [e.layer, e.layer], lw=3, color="tab:red")
        ax.plot([e.last_token], [e.layer], marker="o", ms=3, color="tab:purple")
    ax.set_xlim(0, run.prompt_len)
    ax.set_ylim(0, run.num_layers)
    ax.set_xlabel("prompt token")
    ax.set_ylabel("layer (blocks run before fusing)")
    ax.set_title(title or f"{len(run.events)} fusion groups, {run.removed_fraction:.1%} removed")
    ax2.plot(run.active_prompt_rows, range(run.num_layers), drawstyle="steps-post")
    ax2.set_xlabel("prompt rows computed")
    fig.tight_layout()
    fig.savefig(str(path), dpi=120)
    plt.close(fig)


def run_from_args(args: Any) -> int:
    """`vllm-adaptive calibrate --fusion ...`."""
    import json

    opts = FusionCalibration(
        layers=tuple(int(x) for x in args.fusion_layers.split(",")),
        percentiles=tuple(float(x) for x in args.fusion_percentiles.split(",")),
        max_ppl_increase=args.fusion_max_ppl_increase,
        weighting=args.fusion_weighting,
        tau_attn=args.fusion_tau_attn,
        max_group=args.fusion_max_group,
        split_repeats=args.fusion_split_repeats,
        anchors=tuple(args.fusion_anchor) if args.fusion_anchor else DEFAULT_ANCHORS,
        rare_min_count=args.fusion_rare_min_count,
        prompt_len=args.fusion_prompt_len,
        continuation=args.fusion_continuation,
        fit_windows=args.fusion_fit_windows,
        val_windows=args.fusion_val_windows,
    )
    meta = calibrate_fusion(args.model, args.corpus, args.out, opts, progress=not args.quiet)
    v = meta["val_figures"]
    summary = {
        "tau_fuse": meta["tau_fuse"],
        "met": meta["met"],
        "val": {k: v[k] for k in ("removed_fraction", "ppl_ratio", "agreement", "groups")},
    }
    print(json.dumps(meta if args.json else summary, indent=2))
    return 0
