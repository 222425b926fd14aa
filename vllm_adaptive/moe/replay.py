"""Replay a routing trace through a real :class:`~vllm_adaptive.moe.tiers.FastTier`, without an
engine: the eviction-policy simulation and the victim-search micro-benchmark
(``docs/experiments/moe_eviction.py``) and the tiers' equivalence test use it.

A trace is a list of steps; a step is, per layer, the sorted experts the batch needs (the union
of its tokens' top-k). The replay does per layer what ``MoeRuntime.layer`` does to the tier
(demand, cancel stale prefetches, prefetch, acquire, unpin, release soft pins), without the
compute, with one difference that makes it deterministic: every load is drained before the
next layer, so a prefetch always arrives in time and hit rates do not depend on the loader's
speed. Predictions are given per step and layer as ``{later layer: experts}``:
:func:`perfect_predictions` names exactly what layers l+1..l+d will need (the best any
predictor can do for the cache); a real predictor's, with its misses and extra experts, can be
computed offline from recorded activations (``docs/experiments/moe_eviction.py``: pre-gating).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vllm_adaptive.moe.slow_tier import RecordLayout, SlowTier
from vllm_adaptive.moe.tiers import FastTier

Trace = list[list[list[int]]]  # step -> layer -> experts needed
Predictions = list[list[dict[int, list[int]]]]  # step -> layer l -> {layer j > l: experts}


def synthetic_trace(
    steps: int, layers: int, experts: int, top_k: int, batch: int = 1, seed: int = 0
) -> Trace:
    """Each token draws its top-k uniformly at random in every layer (no correlation between
    tokens or layers: the worst case for any cache)."""
    rng = random.Random(seed)
    return [
        [
            sorted(set().union(*(rng.sample(range(experts), top_k) for _ in range(batch))))
            for _ in range(layers)
        ]
        for _ in range(steps)
    ]


def trace_from_masks(masks: torch.Tensor, batch: int = 1) -> Trace:
    """Steps from per-token routing masks ``[L, N, E]`` (bool): batch 1 takes the N tokens in
    order; batch b splits them into b equal streams and a step is the union of the streams'
    tokens at one position (b sequences decoded together)."""
    layers, n, _ = masks.shape
    per = n // batch
    out = []
    for t in range(per):
        rows = [s * per + t for s in range(batch)]
        out.append([masks[la, rows].any(0).nonzero().flatten().tolist() for la in range(layers)])
    return out


def perfect_predictions(trace: Trace, lookahead: int = 1) -> Predictions:
    """Layer l names exactly the experts layers l+1..l+lookahead need (within the step)."""
    return [
        [
            {j: list(step[j]) for j in range(layer + 1, min(len(step), layer + lookahead + 1))}
            for layer in range(len(step))
        ]
        for step in trace
    ]


@dataclass
class ReplayResult:
    hits: int
    misses: int
    loads: int
    evictions: int
    prefetches: int
    victim_calls: int
    victim_seconds: float  # time inside FastTier._victim (the search for a slot to evict)
    seconds: float  # the whole replay (bookkeeping, loads, drains)

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)

    def as_dict(self) -> dict:
        return {**self.__dict__, "hit_rate": self.hit_rate}


class _NoIoSlowTier(SlowTier):
    """A slow tier whose loads and drops do no I/O: hit rates only depend on the cache, and a
    replay of thousands of loads takes seconds instead of minutes of disk reads."""

    def read_into(self, key, dst) -> None:
        self.offset(key)
        self.bytes_read += self.layout.nbytes

    def drop(self, key) -> None:
        self.offset(key)
        self.drops += 1


def tiny_slow_tier(path, layers: int, experts: int, io: bool = True) -> SlowTier:
    """A slow tier of one-page records (the replay exercises the cache, not the disk); with
    ``io=False`` loads copy nothing and drops drop nothing."""
    layout = RecordLayout((("w", (64,)),), torch.float32)
    tier = SlowTier.write(
        path, layers, experts, layout, lambda la, e: {"w": torch.full((64,), la * 1000.0 + e)}
    )
    if not io:
        tier.__class__ = _NoIoSlowTier
    return tier


def replay(
    fast: FastTier,
    trace: Trace,
    predictions: Predictions | None = None,
    on_victim: Callable[[FastTier, bool, object], None] | None = None,
) -> ReplayResult:
    """Run ``trace`` through ``fast`` (see the module docstring). ``on_victim(fast,
    allow_soft, slot)`` is called after every victim search (the tests compare it with the
    reference scan there). ``predictions``: what each layer prefetches (None: nothing)."""
    if predictions is not None and len(predictions) != len(trace):
        raise ValueError(f"{len(predictions)} steps of predictions for {len(trace)} of trace")
    search = fast._victim
    spent = [0.0, 0]

    def timed(allow_soft: bool):
        t0 = time.perf_counter()
        slot = search(allow_soft)
        spent[0] += time.perf_counter() - t0
        spent[1] += 1
        if on_victim is not None:
            on_victim(fast, allow_soft, slot)
        return slot

    fast._victim = timed  # type: ignore[method-assign]
    t0 = time.perf_counter()
    try:
        for i, step in enumerate(trace):
            _replay_step(fast, step, None if predictions is None else predictions[i])
    finally:
        del fast._victim
    s = fast.stats
    return ReplayResult(
        s.hits,
        s.misses,
        s.loads,
        s.evictions,
        s.prefetches,
        spent[1],
        spent[0],
        time.perf_counter() - t0,
    )


def _replay_step(
    fast: FastTier,
    step: Sequence[Sequence[int]],
    predicted: Sequence[dict[int, list[int]]] | None,
) -> None:
    for layer, needed in enumerate(step):
        fast.current_layer = layer
        deferred = [e for e in needed if not fast.demand((layer, e))]
        fast.cancel_prefetches(layer)
        for j, experts in sorted((predicted[layer] if predicted else {}).items()):
            for e in experts:
                fast.start_load((j, e), soft=True)
        for e in needed:
            key = (layer, e)
            if e in deferred:
                fast.load_blocking(key)
            fast.acquire(key)
            fast.views(key)  # counts a violation if the slot is not READY with it
            fast.unpin(key)
        fast.release_soft(layer)
        fast.drain()
    fast.cancel_prefetches()
