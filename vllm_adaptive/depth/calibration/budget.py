"""Exit simulator on collected data and the binary search of q that meets a compute budget.

Follows EMAD sec. 2.2/2.5: each stream starts at full depth, depth is non-increasing along a
stream (KV validity), a token exits at the first probe layer below its previous depth where
proxy entropy <= tau_l - m_l, otherwise it keeps the previous depth. Optional floor schedule
F_t (linear taper from L to `floor_min` over the first `floor_tokens` tokens), snapped up to
a layer the model can read out at (a probe layer or L).
FLOPs: `DenseShape` per-layer linear + attention at the token's context, LM head always,
plus the proxy cost at every probe evaluated. Fractions are relative to full depth, no probes.

`simulate_mask` is the same walk for any exit signal, given its per-probe pass mask (and the
FLOPs each evaluation costs): QuickSilver, River, combinations, and EMAD again for
comparisons. It follows the runtime's rules exactly where `simulate` approximates one: a row
below its floor is not a candidate (the runtime neither evaluates nor exits it), where
`simulate` lets it pass and then raises its depth to the floor. `simulate` is kept as it is
so existing profiles and figures stay reproducible.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from vllm_adaptive.flops import DenseShape


@dataclass
class SimData:
    """Per-stream arrays; S streams of K tokens, P probe layers (sorted ascending)."""

    probe_layers: list[int]
    num_layers: int
    proxy: np.ndarray  # [P, S, K] proxy entropy at each probe layer
    agree: np.ndarray  # [P, S, K] bool: calibrated argmax at layer == final argmax
    context: np.ndarray  # [S, K] context length of each token
    nll: np.ndarray | None = None  # [P, S, K] -log p(next token) of the calibrated readout
    final_nll: np.ndarray | None = None  # [S, K] the same at full depth (nan: no next token)


@dataclass
class SimResult:
    mean_layers: float
    layers_fraction: float
    flops_fraction: float
    agreement: float  # greedy token at the exit layer == full model's greedy token
    depth_hist: dict[int, float]
    ppl_ratio: float | None = None  # teacher-forced perplexity / full depth's (needs nll)

    def brief(self) -> dict[str, float | None]:
        """The scalar figures (no histogram), for tables in a profile."""
        return {k: v for k, v in asdict(self).items() if k != "depth_hist"}


def _floor(t: int, num_layers: int, floor_tokens: int, floor_min: int | None) -> int:
    if floor_min is None or floor_tokens <= 0:
        return 0
    frac = min(1.0, t / floor_tokens)
    return int(np.ceil(num_layers - frac * (num_layers - floor_min)))


def simulate(
    data: SimData,
    thresholds: np.ndarray,
    shape: DenseShape,
    proxy_flops: float,
    floor_tokens: int = 0,
    floor_min: int | None = None,
    proxy_floor: np.ndarray | None = None,
) -> SimResult:
    probes = data.probe_layers
    L = data.num_layers
    depth_of = np.array(probes + [L])
    P, S, K = data.proxy.shape
    d_prev = np.full(S, P)  # index into depth_of; P means full depth L
    depth = np.empty((S, K), dtype=np.int64)
    n_probes = np.zeros((S, K))
    agree = np.empty((S, K), dtype=bool)
    passes = data.proxy <= thresholds[:, None, None]  # [P, S, K]
    # the runtime skips probes that can never pass (threshold below the proxy's minimum)
    lowest = np.zeros(len(thresholds)) if proxy_floor is None else proxy_floor
    evaluated = thresholds >= lowest
    for t in range(K):
        cur = d_prev.copy()
        done = np.zeros(S, dtype=bool)
        for p in range(P):
            live = ~done & (p < d_prev)
            n_probes[:, t] += live & evaluated[p]
            hit = live & passes[p, :, t]
            cur[hit] = p
            done |= hit
        floor_layer = _floor(t, L, floor_tokens, floor_min)
        if floor_layer:
            floor_idx = int(np.searchsorted(depth_of, floor_layer))
            cur = np.maximum(cur, floor_idx)
        depth[:, t] = depth_of[cur]
        full = cur == P
        idx = np.minimum(cur, P - 1)
        agree[:, t] = np.where(full, True, data.agree[idx, np.arange(S), t])
        d_prev = cur
    per_layer = shape.layer_linear_flops() + shape.layer_attention_flops(1.0) * data.context
    spent = depth * per_layer + n_probes * proxy_flops + shape.lm_head_flops()
    full_cost = L * per_layer + shape.lm_head_flops()
    values, counts = np.unique(depth, return_counts=True)
    return SimResult(
        mean_layers=float(depth.mean()),
        layers_fraction=float(depth.mean() / L),
        flops_fraction=float(spent.sum() / full_cost.sum()),
        agreement=float(agree.mean()),
        depth_hist={int(v): float(c / depth.size) for v, c in zip(values, counts, strict=True)},
    )


def _result(data: SimData, depth_idx, agree, spent, full_cost, nll) -> SimResult:
    depth_of = np.array(data.probe_layers + [data.num_layers])
    depth = depth_of[depth_idx]
    values, counts = np.unique(depth, return_counts=True)
    ppl = None
    if nll is not None and data.final_nll is not None:
        known = ~np.isnan(data.final_nll)
        if known.any():
            ppl = float(np.exp(nll[known].mean() - data.final_nll[known].mean()))
    return SimResult(
        mean_layers=float(depth.mean()),
        layers_fraction=float(depth.mean() / data.num_layers),
        flops_fraction=float(spent.sum() / full_cost.sum()),
        agreement=float(agree.mean()),
        depth_hist={int(v): float(c / depth.size) for v, c in zip(values, counts, strict=True)},
        ppl_ratio=ppl,
    )


def simulate_mask(
    data: SimData,
    passes: np.ndarray,
    shape: DenseShape,
    probe_flops: np.ndarray | float = 0.0,
    floor_tokens: int = 0,
    floor_min: int | None = None,
    monotone: bool = True,
    batch_min: bool = False,
) -> SimResult:
    """Exit walk for any signal: ``passes[p, s, t]`` says the signal lets token t of stream s
    stop at probe p; ``probe_flops`` (scalar, [P] or [P, S, K]) is charged for every
    evaluation. A candidate is a row still running, below its cap (D_{t-1} when
    ``monotone``, else full depth) and at or above its floor F_t. ``batch_min``: the S streams
    decode as one batch and at each probe every candidate exits iff all candidates pass
    (River's eq. 1: min over the batch > tau)."""
    P, S, K = passes.shape
    L = data.num_layers
    depth_of = np.array(data.probe_layers + [L])
    cost = np.asarray(probe_flops, dtype=np.float64)
    if cost.ndim == 1:
        cost = cost[:, None, None]
    cost = np.broadcast_to(cost, (P, S, K))
    d_prev = np.full(S, P)
    depth_idx = np.empty((S, K), dtype=np.int64)
    spent_probe = np.zeros((S, K))
    agree = np.empty((S, K), dtype=bool)
    nll = None if data.nll is None or data.final_nll is None else np.empty((S, K))
    rows = np.arange(S)
    for t in range(K):
        cap = d_prev if monotone else np.full(S, P)
        cur = cap.copy()
        done = np.zeros(S, dtype=bool)
        floor_layer = _floor(t, L, floor_tokens, floor_min)
        for p in range(P):
            cand = ~done & (p < cap) & (depth_of[p] >= floor_layer)
            if not cand.any():
                continue
            spent_probe[:, t] += np.where(cand, cost[p, :, t], 0.0)
            if batch_min:
                hit = cand if passes[p, cand, t].all() else np.zeros(S, dtype=bool)
            else:
                hit = cand & passes[p, :, t]
            cur[hit] = p
            done |= hit
        depth_idx[:, t] = cur
        full = cur == P
        idx = np.minimum(cur, P - 1)
        agree[:, t] = np.where(full, True, data.agree[idx, rows, t])
        if nll is not None:
            nll[:, t] = np.where(full, data.final_nll[:, t], data.nll[idx, rows, t])
        d_prev = cur
    per_layer = shape.layer_linear_flops() + shape.layer_attention_flops(1.0) * data.context
    spent = depth_of[depth_idx] * per_layer + spent_probe + shape.lm_head_flops()
    full_cost = L * per_layer + shape.lm_head_flops()
    return _result(data, depth_idx, agree, spent, full_cost, nll)


@dataclass
class BudgetSearch:
    q: float
    met: bool
    result: SimResult


def search_q(
    cost_at: Callable[[float], SimResult],
    budget: float,
    kind: str = "layers",
    iters: int = 30,
) -> BudgetSearch:
    """Smallest q (most conservative targets) whose simulated cost fraction <= budget.

    Cost is non-increasing in q (tau grows with q; the monotone schedule propagates it), so
    bisection applies. If even q=1 exceeds the budget, returns q=1 with met=False.
    """
    if kind not in ("layers", "flops"):
        raise ValueError(f"budget kind must be 'layers' or 'flops', not {kind!r}")

    def cost(r: SimResult) -> float:
        return r.layers_fraction if kind == "layers" else r.flops_fraction

    lo_res = cost_at(0.0)
    if cost(lo_res) <= budget:
        return BudgetSearch(q=0.0, met=True, result=lo_res)
    hi_res = cost_at(1.0)
    if cost(hi_res) > budget:
        return BudgetSearch(q=1.0, met=False, result=hi_res)
    lo, hi = 0.0, 1.0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        r = cost_at(mid)
        if cost(r) <= budget:
            hi, hi_res = mid, r
        else:
            lo = mid
    return BudgetSearch(q=hi, met=True, result=hi_res)


def search_q_for_agreement(
    cost_at: Callable[[float], SimResult], target: float, iters: int = 30
) -> BudgetSearch:
    """Largest q (most exits) whose simulated agreement with the full model's greedy token is
    still >= ``target``: a quality target instead of a compute budget.

    Agreement is non-increasing in q (more exits, each a chance to differ), so bisection
    applies. If even q=0 misses the target, returns q=0 with met=False."""
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target agreement must be in (0, 1], not {target}")
    lo_res = cost_at(0.0)
    if lo_res.agreement < target:
        return BudgetSearch(q=0.0, met=False, result=lo_res)
    hi_res = cost_at(1.0)
    if hi_res.agreement >= target:
        return BudgetSearch(q=1.0, met=True, result=hi_res)
    lo, hi = 0.0, 1.0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        r = cost_at(mid)
        if r.agreement >= target:
            lo, lo_res = mid, r
        else:
            hi = mid
    return BudgetSearch(q=lo, met=True, result=lo_res)


def prune_unpaid_probes(
    cost_at: Callable[[np.ndarray], SimResult],
    thresholds: np.ndarray,
    evaluated: np.ndarray,
    target: float,
) -> tuple[np.ndarray, SimResult, list[int]]:
    """Turn off (threshold -inf) the probes whose exits save fewer FLOPs than evaluating the
    proxy there costs, one at a time while the simulated FLOPs fall and agreement stays at
    ``target``: a probe a few tokens pass at costs every token that reaches it.

    ``cost_at(thresholds)`` simulates; ``evaluated[p]``: probe p is evaluated at all (its
    threshold reachable). Returns the thresholds, their simulation and the probes turned off."""
    th = np.array(thresholds, dtype=np.float64)
    best = cost_at(th)
    pruned: list[int] = []
    while True:
        trials = []
        for p in np.nonzero(evaluated & np.isfinite(th))[0]:
            trial = th.copy()
            trial[p] = -np.inf
            r = cost_at(trial)
            if r.flops_fraction < best.flops_fraction - 1e-9 and r.agreement >= target:
                trials.append((r.flops_fraction, int(p), trial, r))
        if not trials:
            return th, best, pruned
        _, p, th, best = min(trials, key=lambda t: t[:2])
        pruned.append(p)
