"""River-LLM's exit threshold tau for a target next-token match rate.

The paper fixes tau by hand (0.5 for Llama 3.2 1B / 3.1 8B, 0.8-0.9 for Phi4-mini and
Ministral3) and reports the match rate it gets (98.03% on GSM8K). We turn that around: the
candidates are percentiles of the cosine cos(h_{l-1}, h_l) on the fit streams (pooled over
the layers from the entry layer on; 0..99 in steps of 1 and 99..100 in steps of 0.01, since a
token exits at its first passing layer and high match rates sit in the top percent) plus the
paper's 0.5; each is simulated on
the fit streams with the runtime's schedule; tau is the smallest candidate from which on
every larger one keeps the greedy match rate with the final layer >= ``match_rate``. If even
the largest misses it, tau = 1.0 (cos > 1 never holds: no exits) and ``met`` is false.
Validation figures (per token and the batch minimum) and the whole table go to the profile;
the table (tau, cost, match rate) also lets a runtime turn a budget into a tau.

"Match rate" here is the runtime's: the token the calibrated readout at the exit layer
predicts. The paper's 98% is for its Exit River (the remaining layers in 4-bit, sharing the
KV cache), a different exit path; see docs/exit-signals.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from vllm_adaptive.depth.calibration.budget import SimData, SimResult, simulate_mask
from vllm_adaptive.depth.calibration.signal_arrays import SignalArrays, layer_quantiles
from vllm_adaptive.flops import DenseShape

PAPER_TAU = 0.5


@dataclass
class RiverCalibration:
    match_rate: float = 0.98
    entry_layer: int = 1


def river_passes(arrays: SignalArrays, tau: float, entry_layer: int) -> np.ndarray:
    """[P, S, K]: cos(h_{l-1}, h_l) > tau at probe layers l >= entry_layer."""
    eligible = (np.asarray(arrays.probe_layers) >= entry_layer)[:, None, None]
    return eligible & (arrays.cosine > tau)


def calibrate_river(
    fit: SignalArrays,
    fit_sim: SimData,
    val: SignalArrays,
    val_sim: SimData,
    shape: DenseShape,
    opts: RiverCalibration,
    floor_tokens: int = 0,
    floor_min: int | None = None,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Returns (profile JSON section, tensors)."""
    eligible = np.asarray(fit.probe_layers) >= opts.entry_layer
    if not eligible.any():
        raise ValueError(f"no probe layer at or above the entry layer {opts.entry_layer}")
    pool = fit.cosine[eligible].ravel()
    cos_flops = 6.0 * shape.hidden  # a dot product and two norms
    eligible_cost = np.where(eligible, cos_flops, 0.0)

    def run(arrays, sim, tau, batch_min=False, monotone=True) -> SimResult:
        passes = river_passes(arrays, tau, opts.entry_layer)
        return simulate_mask(
            sim, passes, shape, eligible_cost, floor_tokens, floor_min, monotone, batch_min
        )

    pct = np.concatenate([np.arange(99.0), 99.0 + np.arange(101) / 100])
    taus = np.unique(np.concatenate([np.percentile(pool, pct), [PAPER_TAU]]))
    fit_match = np.array([run(fit, fit_sim, float(t)).agreement for t in taus])
    # smallest tau from which on every larger candidate meets the target
    good = fit_match >= opts.match_rate
    suffix_ok = np.flip(np.cumprod(np.flip(good))).astype(bool)
    met = bool(suffix_ok.any())
    tau = float(taus[np.argmax(suffix_ok)]) if met else 1.0
    table = [run(val, val_sim, float(t)) for t in taus]
    meta = {
        "tau": tau,
        "met": met,
        "match_rate_target": opts.match_rate,
        "entry_layer": opts.entry_layer,
        "at_tau": asdict(run(val, val_sim, tau)),
        "at_tau_batch_min": asdict(run(val, val_sim, tau, batch_min=True)),
        "at_tau_free": asdict(run(val, val_sim, tau, monotone=False)),
        "paper_tau": PAPER_TAU,
        "at_paper_tau": asdict(run(val, val_sim, PAPER_TAU)),
        "at_paper_tau_batch_min": asdict(run(val, val_sim, PAPER_TAU, batch_min=True)),
        "at_paper_tau_free": asdict(run(val, val_sim, PAPER_TAU, monotone=False)),
        "at_paper_tau_no_floor": asdict(
            simulate_mask(
                val_sim, river_passes(val, PAPER_TAU, opts.entry_layer), shape, eligible_cost
            )
        ),
        "cosine_by_layer": layer_quantiles(fit.cosine, fit.probe_layers, (10, 50, 90)),
        "table": [
            {"tau": float(t), "fit_match_rate": float(m), **r.brief()}
            for t, m, r in zip(taus, fit_match, table, strict=True)
        ],
    }
    tensors = {
        "river_tau": np.array([tau], dtype=np.float32),
        "river_table_tau": taus.astype(np.float32),
        "river_table_layers_fraction": np.array([r.layers_fraction for r in table], np.float32),
        "river_table_flops_fraction": np.array([r.flops_fraction for r in table], np.float32),
        "river_table_agreement": np.array([r.agreement for r in table], np.float32),
    }
    return meta, tensors
