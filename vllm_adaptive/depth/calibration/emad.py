"""End-to-end offline EMAD calibration: collect -> norms -> proxies -> targets -> budget -> profile.

Streams (windows) alternate between a fit half (norms, feature maps, targets, margins: the
paper's calibration set C) and a validation half (reported agreement, proxy errors, and the
budget simulation: the paper's "validation slice").

``signals`` adds the other exit signals' calibrations to the same profile, on the same
collection and halves: QuickSilver's thresholds (`calibration/quicksilver.py`, appendix B.2)
and River's tau (`calibration/river.py`), under the keys ``quicksilver`` / ``river`` of
``profile.json`` and ``quicksilver_*`` / ``river_*`` tensors. The EMAD part is always there:
every signal's runtime needs the profile's readout norms and probe layers. Both check after
every block, so the CLI probes every layer with ``--signal``; this function takes
``collect.probe_every`` as given.

Over 400 lines: EMAD's calibration is one pipeline (collect, fit the readouts and proxy,
choose thresholds for the budget, write the profile); its parts live in ``collect``,
``norms``, ``targets`` and ``budget``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_adaptive.artifacts import Profile, save_profile
from vllm_adaptive.depth.calibration.budget import (
    SimData,
    SimResult,
    prune_unpaid_probes,
    search_q,
    search_q_for_agreement,
    simulate,
)
from vllm_adaptive.depth.calibration.collect import CollectConfig, collect, load_model
from vllm_adaptive.depth.calibration.norms import AffineNorm, fit_layer_norms
from vllm_adaptive.depth.calibration.quicksilver import (
    QuickSilverCalibration,
    calibrate_quicksilver,
)
from vllm_adaptive.depth.calibration.river import RiverCalibration, calibrate_river
from vllm_adaptive.depth.calibration.signal_arrays import SignalArrays
from vllm_adaptive.depth.calibration.targets import entropy_targets, margins
from vllm_adaptive.depth.isotonic import IsotonicMap
from vllm_adaptive.depth.proxies import ErrorStats, LowRankReadout, proxy_entropies
from vllm_adaptive.depth.readout import chunks, entropy_nats
from vllm_adaptive.flops import DenseShape


@dataclass
class CalibrationOptions:
    budget: float = 0.6
    budget_kind: str = "layers"
    rank: int = 32
    alpha: float = 1.5
    ridge: float = 1.0
    scalar_norm: bool = False
    norm_metric: str = "hidden"
    norm_bias: bool = True
    proxy: str = "lowrank"  # which proxy the exit rule uses: lowrank | feature
    topk: int = 32
    #: the low-rank proxy's softmax over this many tokens, the model's most frequent (0: all)
    proxy_vocab: int = 0
    population: str = "all"  # tokens the quantile runs over: all (paper) | agree
    min_agreement: float = 0.0  # disable probes agreeing less (0: the paper, every probe)
    #: the budget is the cost of the most exits whose simulated agreement with the full model's
    #: greedy token stays >= this (None: ``budget`` as given)
    target_agreement: float | None = None
    #: with ``target_agreement``: turn off the probes whose exits save fewer FLOPs than their
    #: proxy costs (`budget.prune_unpaid_probes`)
    prune_unpaid: bool = True
    floor_tokens: int = 16  # the runtime's default floor (adaptive.depth.floor)
    floor_min: int | None = None
    collect: CollectConfig = field(default_factory=CollectConfig)
    signals: tuple[str, ...] = ()  # also calibrate: "quicksilver", "river"
    quicksilver: QuickSilverCalibration = field(default_factory=QuickSilverCalibration)
    river: RiverCalibration = field(default_factory=RiverCalibration)


SIGNALS = ("emad", "quicksilver", "river")


def proxy_vocabulary(
    tok: Any, texts: list[str], final_argmax: torch.Tensor, vocab_size: int, size: int
) -> torch.Tensor:
    """The ``size`` token ids the proxy's softmax runs over, ascending: every token the final
    layer predicted on the fit positions, then the corpora's most frequent tokens. A token
    outside makes its row's proxy flatter, so the truncation errs towards no exit."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"proxy vocabulary must be in 1..{vocab_size}, not {size}")
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for text in texts:
        ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        counts += torch.bincount(ids[ids < vocab_size], minlength=vocab_size).double()
    counts[final_argmax] += counts.sum() + 1.0  # predicted tokens first
    return torch.sort(torch.argsort(counts, descending=True, stable=True)[:size]).values


def _layer_pass(hidden, readout, norm, lowrank, temperature, topk, final_argmax, targets):
    """One probe layer: plain-lens and calibrated agreement, calibrated H, proxy values, and
    the calibrated readout's -log p(next token) at T=1 (nan where the next token is unknown)."""
    N = hidden.shape[0]
    out = {k: torch.empty(N) for k in ("exact", "lowrank", "score", "nll")}
    out["agree_before"] = torch.empty(N, dtype=torch.bool)
    out["agree_after"] = torch.empty(N, dtype=torch.bool)
    for sl in chunks(N, 512):
        x = readout.rms(hidden[sl])
        before = readout.logits(x * readout.norm_weight).argmax(-1)
        n = norm(x)
        z = readout.logits(n)
        out["agree_before"][sl] = before == final_argmax[sl]
        out["agree_after"][sl] = z.argmax(-1) == final_argmax[sl]
        out["exact"][sl] = entropy_nats(z, temperature)
        out["lowrank"][sl], out["score"][sl] = proxy_entropies(lowrank, n, temperature, topk)
        t = targets[sl]
        lp = torch.log_softmax(z, dim=-1).gather(1, t.clamp_min(0)[:, None])[:, 0]
        out["nll"][sl] = torch.where(t >= 0, -lp, torch.full_like(lp, float("nan")))
    return out


def _calibrated_layers(
    hidden, readout, norms, lowrank, temperature, topk, final_argmax, fit, targets
):
    """All probe layers; a layer whose fitted norm agrees less often with the final layer on
    the fit tokens than the plain logit lens falls back to the plain lens (a = g, b = 0)."""
    rows, fallback = [], []
    for p, norm in enumerate(norms):
        args = (lowrank, temperature, topk, final_argmax, targets)
        r = _layer_pass(hidden[p], readout, norm, *args)
        if r["agree_after"][fit].float().mean() < r["agree_before"][fit].float().mean():
            norms[p] = AffineNorm(a=readout.norm_weight.clone(), b=torch.zeros(readout.hidden))
            r = _layer_pass(hidden[p], readout, norms[p], *args)
            fallback.append(p)
        rows.append(r)
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}, fallback


def calibrate(
    model_dir: str | Path,
    corpora: list[str | Path],
    out_dir: str | Path,
    opts: CalibrationOptions,
    progress: bool = True,
) -> dict[str, Any]:
    from vllm_adaptive.corpora import read_corpus

    t0 = time.perf_counter()
    unknown = set(opts.signals) - set(SIGNALS)
    if unknown:
        raise ValueError(f"unknown signals {sorted(unknown)}; known: {SIGNALS}")

    def stage(msg: str) -> None:
        if progress:
            print(
                f"[calibrate {time.perf_counter() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True
            )

    files = [read_corpus(c) for c in corpora]
    model, tok, readout = load_model(model_dir)
    shape = DenseShape.from_hf_config(model.config)
    ccfg = opts.collect
    col = collect(model, tok, [f.calibration_text for f in files], ccfg, progress=progress)
    del model
    if col.num_streams < 2:
        raise ValueError("need at least 2 windows (fit and validation halves); raise --tokens")
    S, K = col.num_streams, col.stream_len
    stream = torch.arange(S).repeat_interleave(K)
    fit_idx = torch.nonzero(stream % 2 == 0).squeeze(1)
    val_idx = torch.nonzero(stream % 2 == 1).squeeze(1)

    stage("fitting Norm_l per probe layer (ridge)")
    norms = fit_layer_norms(
        col.hidden, col.final_normed, readout, fit_idx, opts.ridge, opts.scalar_norm,
        opts.norm_metric, opts.norm_bias,
    )  # fmt: skip
    stage("low-rank readout, calibrated entropies and proxies per probe layer")
    vocab = None
    if opts.proxy_vocab:
        vocab = proxy_vocabulary(
            tok, [f.calibration_text for f in files], col.final_argmax[fit_idx],
            int(readout.unembed.shape[0]), opts.proxy_vocab,
        )  # fmt: skip
    lowrank = LowRankReadout.fit(readout.unembed, opts.rank, vocab)
    lp, fallback = _calibrated_layers(
        col.hidden, readout, norms, lowrank, ccfg.temperature, opts.topk, col.final_argmax,
        fit_idx, col.targets,
    )  # fmt: skip
    exact = lp["exact"].numpy()
    fi, vi = fit_idx.numpy(), val_idx.numpy()
    P = len(col.probe_layers)
    stage("feature proxy isotonic maps, margins")
    feature_maps = [IsotonicMap.fit(lp["score"][p, fi].numpy(), exact[p, fi]) for p in range(P)]
    feature = np.stack([feature_maps[p](lp["score"][p].numpy()) for p in range(P)])
    lowrank_h = lp["lowrank"].numpy()
    proxy_vals = lowrank_h if opts.proxy == "lowrank" else feature
    if opts.proxy not in ("lowrank", "feature"):
        raise ValueError(f"proxy must be 'lowrank' or 'feature', not {opts.proxy!r}")

    errs_fit = [proxy_vals[p, fi] - exact[p, fi] for p in range(P)]
    marg = margins(errs_fit, opts.alpha)
    agree_after = lp["agree_after"].numpy()
    if opts.population == "all":
        pops = [exact[p, fi] for p in range(P)]
    elif opts.population == "agree":
        pops = [exact[p, fi][agree_after[p, fi]] for p in range(P)]
    else:
        raise ValueError(f"population must be 'all' or 'agree', not {opts.population!r}")

    val_streams = np.arange(1, S, 2)

    def sim_data(streams: np.ndarray) -> SimData:
        return SimData(
            probe_layers=col.probe_layers,
            num_layers=col.num_layers,
            proxy=proxy_vals.reshape(P, S, K)[:, streams],
            agree=agree_after.reshape(P, S, K)[:, streams],
            context=col.context.numpy().reshape(S, K)[streams],
            nll=lp["nll"].numpy().reshape(P, S, K)[:, streams],
            final_nll=col.final_nll.numpy().reshape(S, K)[streams],
        )

    sim = sim_data(val_streams)
    pflops = lowrank.flops()
    floor_min = opts.floor_min
    if opts.floor_tokens > 0 and floor_min is None:
        floor_min = col.probe_layers[0]  # as the runtime: the floor protects the start only

    # Probe layers whose calibrated readout agrees with the final layer less often than
    # `min_agreement` (fit tokens) never exit (threshold -inf) and are not evaluated.
    fit_agree = agree_after[:, fi].mean(1)
    disabled = [p for p in range(P) if fit_agree[p] < opts.min_agreement]

    def thresholds_at(q: float) -> np.ndarray:
        t = entropy_targets(pops, q) - marg
        t[disabled] = -np.inf
        return t

    # The smallest value the proxy can take at each probe: a threshold below it never passes,
    # so the runtime does not evaluate that probe (and the simulation does not charge it).
    if opts.proxy == "feature":
        proxy_floor = np.array([float(m.y.min()) for m in feature_maps])
    else:
        proxy_floor = np.zeros(P)

    def run(q: float) -> SimResult:
        return simulate(
            sim, thresholds_at(q), shape, pflops, opts.floor_tokens, floor_min, proxy_floor
        )

    unpaid: list[int] = []
    if opts.target_agreement is not None:
        # the target's own q: the simulated cost is not monotone in q, so a budget search for
        # the target's cost could land on a more aggressive q of lower cost and agreement
        stage(f"q search for agreement >= {opts.target_agreement} (exit simulation)")
        found = search_q_for_agreement(run, opts.target_agreement)
        thresholds = thresholds_at(found.q)
        if opts.prune_unpaid:
            thresholds, pruned_result, unpaid = prune_unpaid_probes(
                lambda th: simulate(
                    sim, th, shape, pflops, opts.floor_tokens, floor_min, proxy_floor
                ),
                thresholds,
                thresholds >= proxy_floor,
                opts.target_agreement,
            )
            found = replace(found, result=pruned_result)
        r = found.result
        cost = r.layers_fraction if opts.budget_kind == "layers" else r.flops_fraction
        opts = replace(opts, budget=float(cost))
    else:
        stage("budget search over q (exit simulation)")
        found = search_q(run, opts.budget, opts.budget_kind)
        thresholds = thresholds_at(found.q)
    tau = entropy_targets(pops, found.q)
    stage("q sweep and other budgets")
    sweep = {f"{q:.2f}": asdict(run(q)) for q in (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)}
    other_budgets = {
        f"{kind}:{b}": {"q": r.q, "met": r.met, **asdict(r.result)}
        for kind in ("layers", "flops")
        for b in (0.9, 0.8, 0.7, 0.6, 0.5)
        for r in [search_q(run, b, kind, iters=20)]
    }

    def stats(vals: np.ndarray) -> list[dict[str, float]]:
        return [asdict(ErrorStats.of(vals[p, vi] - exact[p, vi])) for p in range(P)]

    before = lp["agree_before"].numpy()
    summary: dict[str, Any] = {
        "model_dir": str(model_dir),
        "corpora": [{"path": str(f.path), "sha256": f.sha256} for f in files],
        "probe_layers": col.probe_layers,
        "num_layers": col.num_layers,
        "entropy_unit": "nats",
        "temperature": ccfg.temperature,
        "window": ccfg.window,
        "windows": S,
        "kept_positions_per_window": K,
        "rank": opts.rank,
        "topk": opts.topk,
        "proxy_vocab": int(lowrank.u.shape[0]),
        "proxy": opts.proxy,
        "norm": {
            "scalar": opts.scalar_norm,
            "metric": opts.norm_metric,
            "ridge": opts.ridge,
            "bias": opts.norm_bias,
            "plain_lens_fallback_layers": [col.probe_layers[p] for p in fallback],
        },
        "population": opts.population,
        "min_agreement": opts.min_agreement,
        "disabled_probe_layers": [col.probe_layers[p] for p in disabled],
        "unpaid_probe_layers": [col.probe_layers[p] for p in unpaid],
        "alpha": opts.alpha,
        "budget": opts.budget,
        "budget_kind": opts.budget_kind,
        "budget_met": found.met,
        "target_agreement": opts.target_agreement,
        "q": found.q,
        "floor": {"tokens": opts.floor_tokens, "min": floor_min},
        "tau": tau.tolist(),
        "margins": marg.tolist(),
        "thresholds": thresholds.tolist(),
        "agreement_before": before[:, vi].mean(1).tolist(),
        "agreement_after": agree_after[:, vi].mean(1).tolist(),
        "proxy_error_lowrank": stats(lowrank_h),
        "proxy_error_feature": stats(feature),
        "proxy_flops": pflops,
        "proxy_flops_over_block": pflops / shape.layer_linear_flops(),
        "simulation": asdict(found.result),
        "q_sweep": sweep,
        "q_for_budgets": other_budgets,
        "seconds": 0.0,
    }
    tensors = {
        "norm_a": torch.stack([n.a for n in norms]),
        "norm_b": torch.stack([n.b for n in norms]),
        "lowrank_u": lowrank.u.contiguous(),
        "lowrank_v": lowrank.v.contiguous(),
        "tau": torch.from_numpy(tau).float(),
        "margin": torch.from_numpy(marg).float(),
        "threshold": torch.from_numpy(thresholds).float(),
        "proxy_floor": torch.from_numpy(proxy_floor).float(),
    }
    # The runtime turns any budget (global or per request) into thresholds through this
    # table: q on a grid, the thresholds tau(q) - m, and the simulated cost of each row.
    stage("q-table for runtime budgets (uniform grid + every budget 0.05..0.99)")
    # q on a uniform grid plus the q that meets every budget 0.05..0.99 (the cost can fall
    # steeply in a narrow band of q, which a uniform grid would skip over).
    budget_qs = [search_q(run, b, opts.budget_kind, iters=20).q for b in np.arange(5, 100) / 100]
    q_grid = np.unique(np.concatenate([np.linspace(0.0, 1.0, 101), budget_qs]))
    rows = [run(float(q)) for q in q_grid]
    tensors["table_q"] = torch.from_numpy(q_grid).float()
    tensors["table_thresholds"] = torch.stack(
        [torch.from_numpy(thresholds_at(float(q))).float() for q in q_grid]
    )
    tensors["table_layers_fraction"] = torch.tensor([r.layers_fraction for r in rows])
    tensors["table_flops_fraction"] = torch.tensor([r.flops_fraction for r in rows])
    for p, m in enumerate(feature_maps):
        tensors[f"feature_knots_x.{p}"] = torch.from_numpy(m.x.copy())
        tensors[f"feature_knots_y.{p}"] = torch.from_numpy(m.y.copy())
    special = sorted(int(i) for i in getattr(tok, "all_special_ids", []))
    summary["special_token_ids"] = special
    summary["signals"] = ["emad", *[s for s in SIGNALS[1:] if s in opts.signals]]
    if len(summary["signals"]) > 1:
        fit_streams = np.arange(0, S, 2)

        def arrays(streams: np.ndarray) -> SignalArrays:
            return SignalArrays.from_collected(
                col.probe_layers, col.drift.numpy(), col.cosine.numpy(), proxy_vals,
                col.token_ids.numpy(), S, K, streams,
            )  # fmt: skip

        fit_arr, val_arr = arrays(fit_streams), arrays(val_streams)
        floor = (opts.floor_tokens, floor_min)
        if "quicksilver" in opts.signals:
            stage("QuickSilver: percentiles on the fit half, threshold grid on the validation half")
            qs = opts.quicksilver
            qs = replace(qs, protected_ids=tuple(sorted({*qs.protected_ids, *special})))
            if qs.entropy not in ("proxy", "exact"):
                raise ValueError(f"QuickSilver entropy must be proxy or exact, not {qs.entropy!r}")
            qs_fit, qs_val, eflops = fit_arr, val_arr, pflops
            if qs.entropy == "exact":
                qs_fit, qs_val = (
                    replace(a, entropy=exact.reshape(P, S, K)[:, st])
                    for a, st in ((fit_arr, fit_streams), (val_arr, val_streams))
                )
                eflops = shape.lm_head_flops()
            meta, arr = calibrate_quicksilver(qs_fit, qs_val, sim, shape, qs, eflops, *floor)
            summary["quicksilver"] = meta
            tensors.update({k: torch.from_numpy(v) for k, v in arr.items()})
        if "river" in opts.signals:
            stage("River: tau for the target match rate (fit half), figures (validation half)")
            meta, arr = calibrate_river(
                fit_arr, sim_data(fit_streams), val_arr, sim, shape, opts.river, *floor
            )
            summary["river"] = meta
            tensors.update({k: torch.from_numpy(v) for k, v in arr.items()})
    summary["seconds"] = time.perf_counter() - t0
    stage("writing the profile")
    save_profile(Profile(meta=summary, tensors=tensors), out_dir, model_dir)
    return summary


def run_from_args(args: argparse.Namespace) -> int:
    signals = tuple(s for s in (args.signal or ["emad"]) if s != "emad")
    probe_every = args.probe_every or (1 if signals else 2)
    opts = CalibrationOptions(
        budget=args.budget,
        budget_kind=args.budget_kind,
        rank=args.rank,
        alpha=args.alpha,
        ridge=args.ridge,
        scalar_norm=args.scalar_norm,
        norm_metric=args.norm_metric,
        norm_bias=not args.no_norm_bias,
        proxy=args.proxy,
        population=args.population,
        min_agreement=args.min_agreement,
        target_agreement=args.target_agreement,
        proxy_vocab=args.proxy_vocab,
        prune_unpaid=not args.keep_unpaid_probes,
        floor_tokens=args.floor_tokens,
        floor_min=args.floor_min,
        collect=CollectConfig(
            window=args.window,
            tokens=args.tokens,
            keep=args.keep,
            probe_every=probe_every,
            temperature=args.temperature,
        ),
        signals=signals,
        quicksilver=QuickSilverCalibration(
            percentile=args.qs_percentile,
            min_halting_depth=args.qs_min_halting_depth,
            max_halting_layer=args.qs_max_halting_layer,
            max_ppl_increase=args.qs_max_ppl_increase,
            entropy=args.qs_entropy,
        ),
        river=RiverCalibration(
            match_rate=args.river_match_rate, entry_layer=args.river_entry_layer
        ),
    )
    s = calibrate(args.model, args.corpus, args.out, opts, progress=not args.quiet)
    if args.plot:
        plot_calibration(s, args.plot)
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        print(format_summary(s))
    print(f"profile written to {Path(args.out)}", file=sys.stderr)
    return 0


def plot_calibration(summary: dict[str, Any], path: str) -> None:
    """Per probe layer: greedy agreement with the final layer under the plain logit lens and
    the calibrated Norm_l, and the exit thresholds (tau_l - m_l) against tau_l."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = summary["probe_layers"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(layers, summary["agreement_before"], marker="o", label="plain logit lens")
    ax1.plot(layers, summary["agreement_after"], marker="s", label="calibrated Norm_l")
    ax1.set_xlabel("probe layer (blocks run)")
    ax1.set_ylabel("top-1 agreement with the final layer")
    ax1.set_ylim(0, 1)
    ax1.grid(alpha=0.3)
    ax1.legend()
    ax2.plot(layers, summary["tau"], marker="o", label="tau_l (entropy target, nats)")
    thr = [t if t > -1e30 else float("nan") for t in summary["thresholds"]]
    ax2.plot(layers, thr, marker="s", label="threshold tau_l - m_l")
    ax2.axhline(0.0, color="grey", lw=0.8)
    ax2.set_xlabel("probe layer (blocks run)")
    ax2.set_ylabel("nats")
    ax2.grid(alpha=0.3)
    ax2.legend()
    fig.suptitle(
        f"EMAD calibration: budget {summary['budget']} ({summary['budget_kind']}), "
        f"q={summary['q']:.4f}, rank {summary['rank']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"EMAD calibration: {s['windows']} windows x {s['window']} tokens "
        f"({s['kept_positions_per_window']} kept each), entropy in nats, T={s['temperature']}",
        "layer  agree_before  agree_after  tau     margin  thresh  lowrank_MAE  feature_MAE",
    ]
    for i, layer in enumerate(s["probe_layers"]):
        lr, ft = s["proxy_error_lowrank"][i]["mae"], s["proxy_error_feature"][i]["mae"]
        lines.append(
            f"{layer:5d}  {s['agreement_before'][i]:12.3f}  {s['agreement_after'][i]:11.3f}  "
            f"{s['tau'][i]:6.3f}  {s['margins'][i]:6.3f}  {s['thresholds'][i]:6.3f}  "
            f"{lr:11.3f}  {ft:11.3f}"
        )
    r = s["simulation"]
    met = "met" if s["budget_met"] else "NOT met (even q=1)"
    if s.get("target_agreement") is not None:
        met = "met" if s["budget_met"] else "NOT met (even q=0)"
        lines.append(f"target agreement {s['target_agreement']} {met}: budget set to its cost")
        if s.get("unpaid_probe_layers"):
            lines.append(
                f"probes turned off (their exits save fewer FLOPs than the proxy costs): "
                f"after layers {s['unpaid_probe_layers']}"
            )
    lines += [
        f"proxy={s['proxy']} rank={s['rank']} (probe cost {s['proxy_flops_over_block']:.2f} "
        f"of one block's linear FLOPs), alpha={s['alpha']}",
        f"budget {s['budget']} ({s['budget_kind']}) {met}: q={s['q']:.4f}",
        f"simulated: mean layers {r['mean_layers']:.2f}/{s['num_layers']} "
        f"(fraction {r['layers_fraction']:.3f}), FLOPs fraction {r['flops_fraction']:.3f}, "
        f"greedy agreement with final layer {r['agreement']:.3f}",
    ]
    if "quicksilver" in s:
        q = s["quicksilver"]
        c = q["chosen"]
        at = q["at_percentile"]
        lines.append(
            f"QuickSilver ({q['percentile']:g}th percentiles, window l > "
            f"{q['min_halting_depth']}): tau_drift={q['percentile_tau_drift']:.3f} "
            f"tau_entropy={q['percentile_tau_entropy']:.3f} nats -> mean layers "
            f"{at['mean_layers']:.2f}, agreement {at['agreement']:.3f}, ppl x{at['ppl_ratio']:.3g}"
        )
        lines.append(
            f"  grid choice (ppl within +{q['max_ppl_increase']:g}): "
            + (
                f"tau_drift={c['tau_drift']:.3f} tau_entropy={c['tau_entropy']:.3f}, mean layers "
                f"{c['mean_layers']:.2f}, FLOPs {c['flops_fraction']:.3f}, agreement "
                f"{c['agreement']:.3f}"
                if c
                else "none within it: halting off (thresholds 0)"
            )
        )
    if "river" in s:
        r = s["river"]
        for name, key in (
            (f"calibrated tau={r['tau']:.4f}", "at_tau"),
            ("paper tau=0.5", "at_paper_tau"),
        ):
            a, b = r[key], r[f"{key}_batch_min"]
            lines.append(
                f"River {name}: mean layers {a['mean_layers']:.2f}, match rate "
                f"{a['agreement']:.3f}, ppl x{a['ppl_ratio']:.3g}; batch-min: mean layers "
                f"{b['mean_layers']:.2f}, match rate {b['agreement']:.3f}"
            )
        if not r["met"]:
            lines.append(f"  match rate {r['match_rate_target']} not reached: tau 1.0 (no exits)")
    lines.append(f"took {s['seconds']:.1f} s")
    return "\n".join(lines)
