"""QuickSilver halting thresholds as in its appendix B.2, on teacher-forced calibration text.

1. drift and entropy of every token at every layer of the halting window (l_min < l <= l_max)
   on the fit streams, pooled (the paper uses one tau_drift and one tau_halt for all layers);
2. their 25th percentiles are the candidate thresholds ("a conservative early-exit policy");
3. a grid of percentiles around it (both thresholds), each simulated on the held-out
   (validation) streams with the runtime's schedule: cost, greedy agreement with the final
   layer, and teacher-forced perplexity;
4. the choice "for minimal perplexity loss vs maximum FLOPs savings", made concrete: the
   cheapest grid point (FLOPs, checks included) whose perplexity is within
   ``max_ppl_increase`` of full depth and that saves FLOPs at all. When no grid point is, the
   profile's thresholds are 0 (halting never fires) and ``met`` is false; the grid is
   recorded either way.

Entropy is, by default, the EMAD profile's proxy of the calibrated readout (see
`policies/quicksilver.py`), so thresholds are in that proxy's nats; ``entropy="exact"``
calibrates for the exact entropy of the same readout instead (the whole LM head per check).
Protected and forced token ids take part in the simulation exactly as in the runtime
(`halting_rule`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from vllm_adaptive.depth.calibration.budget import SimData, SimResult, simulate_mask
from vllm_adaptive.depth.calibration.signal_arrays import SignalArrays, layer_quantiles
from vllm_adaptive.depth.policies.quicksilver import halting_rule
from vllm_adaptive.flops import DenseShape


@dataclass
class QuickSilverCalibration:
    percentile: float = 25.0
    grid: tuple[float, ...] = (0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 40.0, 50.0)
    min_halting_depth: int = 5
    max_halting_layer: int | None = None
    max_ppl_increase: float = 0.01
    protected_ids: tuple[int, ...] = ()  # the tokenizer's special tokens by default
    forced_halt_ids: tuple[int, ...] = ()
    entropy: str = "proxy"  # "proxy" (the profile's EMAD proxy) | "exact"; what the arrays hold


def window_mask(probe_layers: Sequence[int], min_depth: int, max_layer: int | None) -> np.ndarray:
    """[P] bool: probe layers inside the halting window l_min < l <= l_max."""
    layers = np.asarray(probe_layers)
    inside = layers > min_depth
    return inside if max_layer is None else inside & (layers <= max_layer)


def quicksilver_passes(
    arrays: SignalArrays,
    tau_drift: float,
    tau_entropy: float,
    opts: QuickSilverCalibration,
    drift_flops: float,
    entropy_flops: float,
) -> tuple[np.ndarray, np.ndarray]:
    """(pass mask, FLOPs per evaluation) [P, S, K] of the runtime's rule: drift is computed
    at every probe in the window, the entropy proxy only where drift passes and the token is
    neither protected nor forced."""
    win = window_mask(arrays.probe_layers, opts.min_halting_depth, opts.max_halting_layer)
    win = win[:, None, None]
    protected = np.isin(arrays.token_ids, opts.protected_ids)[None]
    forced = np.isin(arrays.token_ids, opts.forced_halt_ids)[None]
    drift_ok = arrays.drift < tau_drift
    entropy_ok = arrays.entropy < tau_entropy
    passes = win & halting_rule(drift_ok, entropy_ok, protected, forced)
    needs_entropy = drift_ok & ~protected & ~forced
    cost = np.where(win, drift_flops + np.where(needs_entropy, entropy_flops, 0.0), 0.0)
    return passes, cost


def calibrate_quicksilver(
    fit: SignalArrays,
    val: SignalArrays,
    val_sim: SimData,
    shape: DenseShape,
    opts: QuickSilverCalibration,
    entropy_flops: float,
    floor_tokens: int = 0,
    floor_min: int | None = None,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """B.2 on ``fit`` (percentiles) and ``val`` (grid); returns (profile JSON section, tensors)."""
    win = window_mask(fit.probe_layers, opts.min_halting_depth, opts.max_halting_layer)
    if not win.any():
        raise ValueError(
            f"no probe layer above min_halting_depth {opts.min_halting_depth} "
            f"(probes {fit.probe_layers}, max_halting_layer {opts.max_halting_layer})"
        )
    drift_pool = fit.drift[win].ravel()
    ent_pool = fit.entropy[win].ravel()
    d = shape.hidden
    drift_flops = 3.0 * d

    def run(tau_d: float, tau_h: float, monotone: bool = True) -> SimResult:
        passes, cost = quicksilver_passes(val, tau_d, tau_h, opts, drift_flops, entropy_flops)
        return simulate_mask(
            val_sim, passes, shape, cost, floor_tokens, floor_min, monotone=monotone
        )

    grid = sorted(set(opts.grid) | {opts.percentile})
    rows = []
    for pd in grid:
        for ph in grid:
            tau_d = float(np.percentile(drift_pool, pd))
            tau_h = float(np.percentile(ent_pool, ph))
            r = run(tau_d, tau_h)
            rows.append(
                {"drift_percentile": pd, "entropy_percentile": ph, "tau_drift": tau_d,
                 "tau_entropy": tau_h, **r.brief()}
            )  # fmt: skip
    limit = 1.0 + opts.max_ppl_increase
    ok = [
        r
        for r in rows
        if r["ppl_ratio"] is not None and r["ppl_ratio"] <= limit and r["flops_fraction"] < 1.0
    ]
    chosen = min(ok, key=lambda r: (r["flops_fraction"], -r["agreement"])) if ok else None
    tau_d0 = float(np.percentile(drift_pool, opts.percentile))
    tau_h0 = float(np.percentile(ent_pool, opts.percentile))
    at_pct = run(tau_d0, tau_h0)
    passes0, cost0 = quicksilver_passes(val, tau_d0, tau_h0, opts, drift_flops, entropy_flops)
    tau = (chosen["tau_drift"], chosen["tau_entropy"]) if chosen else (0.0, 0.0)
    meta = {
        "tau_drift": tau[0],
        "tau_entropy": tau[1],
        "entropy": opts.entropy,
        "entropy_unit": f"nats ({opts.entropy} entropy of the calibrated readout)",
        "met": chosen is not None,
        "max_ppl_increase": opts.max_ppl_increase,
        "min_halting_depth": opts.min_halting_depth,
        "max_halting_layer": opts.max_halting_layer,
        "protected_ids": sorted(opts.protected_ids),
        "forced_halt_ids": sorted(opts.forced_halt_ids),
        "percentile": opts.percentile,
        "percentile_tau_drift": tau_d0,
        "percentile_tau_entropy": tau_h0,
        "at_percentile": asdict(at_pct),
        "at_percentile_free": asdict(run(tau_d0, tau_h0, monotone=False)),
        "at_percentile_no_floor": asdict(simulate_mask(val_sim, passes0, shape, cost0)),
        "chosen": chosen,
        "grid": rows,
        "drift_by_layer": layer_quantiles(fit.drift, fit.probe_layers, (25, 50, 75)),
        "entropy_by_layer": layer_quantiles(fit.entropy, fit.probe_layers, (25, 50, 75)),
    }
    tensors = {
        "quicksilver_thresholds": np.array(tau, dtype=np.float32),
        "quicksilver_grid": np.array(
            [
                [
                    r["tau_drift"],
                    r["tau_entropy"],
                    r["layers_fraction"],
                    r["flops_fraction"],
                    r["agreement"],
                    r["ppl_ratio"],
                ]
                for r in rows
            ],
            dtype=np.float32,
        ),  # fmt: skip
    }
    return meta, tensors
