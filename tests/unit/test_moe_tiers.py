"""Expert tiers, the tiered MoE runtime and the predictors on tiny tensors (no vLLM engine).

Random weights throughout: these test mechanics only (LRU, pins, byte bound, page dropping,
the loader thread, the READY check, bitwise equality with the all-resident compute), never
quality or hit rates."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from vllm_adaptive.moe.predictors import ExpertPredictor, PregatePredictor, make_predictor
from vllm_adaptive.moe.runtime import (
    MoeRuntime,
    expert_cols,
    expert_forward,
    expert_rows,
    moe_resident,
    route,
)
from vllm_adaptive.moe.slow_tier import PAGE, RecordLayout, SlowTier
from vllm_adaptive.moe.tiers import LOADING, READY, FastTier

H, M = 8, 4  # hidden, expert intermediate size
LAYOUT = RecordLayout((("gate_up", (2 * M, H)), ("down", (H, M))), torch.float32)


def _weights(layers: int, experts: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {
        (layer, e): {
            "gate_up": torch.randn(2 * M, H, generator=g),
            "down": torch.randn(H, M, generator=g),
        }
        for layer in range(layers)
        for e in range(experts)
    }


@pytest.fixture
def slow(tmp_path):
    w = _weights(2, 4)
    tier = SlowTier.write(tmp_path / "experts.bin", 2, 4, LAYOUT, lambda a, b: w[a, b])
    yield tier, w
    tier.close()


def _ready(fast: FastTier, key) -> None:
    assert fast.demand(key)
    fast.acquire(key)
    fast.unpin(key)


def test_records_are_page_aligned_and_round_trip(slow) -> None:
    tier, w = slow
    assert LAYOUT.stride % PAGE == 0 and LAYOUT.stride >= LAYOUT.nbytes
    assert tier.path.stat().st_size == 8 * LAYOUT.stride
    assert tier.resident_fraction((1, 2)) in (0, None)  # written, then dropped: loads are cold
    fast = FastTier(tier, 3)
    try:
        for key in [(1, 2), (0, 0)]:
            _ready(fast, key)
            got = fast.views(key)
            assert torch.equal(got["gate_up"], w[key]["gate_up"])
            assert torch.equal(got["down"], w[key]["down"])
    finally:
        fast.loader.shutdown()


def test_byte_bound(slow) -> None:
    tier, _ = slow
    fast = FastTier(tier, 3)
    assert fast.nbytes == 3 * LAYOUT.stride
    for key in [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]:
        _ready(fast, key)
        assert len(fast.where) <= 3
    assert fast.nbytes == 3 * LAYOUT.stride  # preallocated, never grows
    assert fast.stats.evictions == 3
    fast.loader.shutdown()
    with pytest.raises(ValueError):
        FastTier(tier, 0)


def test_lru_order(slow) -> None:
    tier, _ = slow
    fast = FastTier(tier, 2)
    _ready(fast, (0, 0))
    _ready(fast, (0, 1))
    _ready(fast, (0, 0))  # (0, 1) is now the least recently used
    _ready(fast, (0, 2))
    fast.drain()
    assert fast.resident((0, 0)) and fast.resident((0, 2)) and not fast.resident((0, 1))
    assert fast.stats.hits == 1 and fast.stats.misses == 3 and fast.stats.loads == 3
    fast.loader.shutdown()


def test_pins(slow) -> None:
    tier, _ = slow
    fast = FastTier(tier, 2)
    assert fast.demand((0, 0))  # hard-pinned until unpinned
    assert fast.start_load((1, 0), soft=True)  # prefetched: soft-pinned
    # a prefetch evicts neither a hard nor a soft pin
    assert not fast.start_load((1, 1), soft=True)
    assert fast.stats.prefetch_skipped == 1
    fast.drain()  # a slot still loading is never evicted
    # an on-demand load may evict a soft pin, never a hard one
    assert fast.demand((0, 3))
    assert fast.resident((0, 0)) and not fast.resident((1, 0))
    # every slot hard-pinned: no load can start; load_blocking says so instead of hanging
    assert not fast.start_load((0, 2), allow_soft_evict=True)
    fast.drain()
    with pytest.raises(RuntimeError, match="pinned"):
        fast.load_blocking((0, 2))
    fast.acquire((0, 0))
    fast.unpin((0, 0))
    fast.load_blocking((0, 2))  # (0, 0) is free now
    assert not fast.resident((0, 0))
    fast.acquire((0, 2))
    fast.unpin((0, 2))
    with pytest.raises(RuntimeError, match="not pinned"):
        fast.unpin((0, 2))
    fast.loader.shutdown()


def test_cyclic_eviction_evicts_the_layer_that_comes_back_last(slow) -> None:
    """Layers run 0, 1, 0, 1, ...: at layer 1, layer 1's own experts come back last (after
    layer 0), so "cyclic" evicts them first where LRU evicts layer 0's older ones."""
    tier, _ = slow
    for eviction, survivor, evicted in [("lru", (1, 0), (0, 0)), ("cyclic", (0, 0), (1, 0))]:
        fast = FastTier(tier, 2, eviction=eviction)
        fast.current_layer = 0
        _ready(fast, (0, 0))
        fast.current_layer = 1
        _ready(fast, (1, 0))
        _ready(fast, (1, 1))  # needs a slot: (0, 0) is older, (1, 0) comes back later
        fast.drain()
        assert fast.resident(survivor) and not fast.resident(evicted), eviction
        fast.loader.shutdown()
    with pytest.raises(ValueError, match="eviction"):
        FastTier(tier, 2, eviction="fifo")


def test_eviction_drops_pages(slow) -> None:
    tier, _ = slow
    fast = FastTier(tier, 1)
    _ready(fast, (0, 0))
    before = tier.resident_fraction((0, 0))
    _ready(fast, (1, 3))  # evicts (0, 0): its pages are dropped on the loader thread
    fast.drain()
    assert (0, 0) in tier.drop_calls
    after = tier.resident_fraction((0, 0))
    if before is not None:  # mincore available
        assert before > 0
        assert after == 0
        # a load reads its own record only: no read-around into the neighbours
        assert tier.resident_fraction((1, 2)) == 0 and tier.resident_fraction((0, 1)) == 0
    fast.loader.shutdown()


def test_loads_run_on_the_background_thread(slow) -> None:
    tier, _ = slow
    fast = FastTier(tier, 2)
    _ready(fast, (0, 1))
    assert fast.loader_threads and threading.get_ident() not in fast.loader_threads
    fast.loader.shutdown()


def test_stall_and_ready_check(slow, monkeypatch) -> None:
    tier, _ = slow
    fast = FastTier(tier, 2)
    gate = threading.Event()
    read = tier.read_into

    def slow_read(key, dst):
        gate.wait(5)
        time.sleep(0.05)
        read(key, dst)

    monkeypatch.setattr(tier, "read_into", slow_read)
    assert fast.demand((0, 2))
    assert fast.state((0, 2)) == LOADING
    assert fast.stats.violations == 0
    fast.views((0, 2))  # computing from a slot still loading: a violation, counted
    assert fast.stats.violations == 1
    gate.set()
    fast.acquire((0, 2))
    assert fast.state((0, 2)) == READY
    assert fast.stats.stall_seconds >= 0.04
    fast.views((0, 2))
    assert fast.stats.violations == 1
    fast.loader.shutdown()


def test_measure_bandwidth(slow) -> None:
    tier, _ = slow
    bw = tier.measure_bandwidth([(0, 0), (1, 1)])
    assert bw["records"] == 2 and bw["bytes"] == 2 * LAYOUT.nbytes and bw["bytes_per_s"] > 0


# -- the MoE compute ---------------------------------------------------------------------------


def test_expert_split_matches_the_masked_dense_mlp() -> None:
    """Experts cut from permuted dense weights, summed over the selected ones, equal the dense
    MLP with the unselected experts' neurons zeroed (the reference forward of docs/moe.md)."""
    g = torch.Generator().manual_seed(1)
    e, k, inter, tokens = 4, 2, 4 * M, 5
    gate, up = torch.randn(inter, H, generator=g), torch.randn(inter, H, generator=g)
    down = torch.randn(H, inter, generator=g).double()
    gate, up = gate.double(), up.double()
    router = torch.randn(e, H, generator=g).double()
    x = torch.randn(tokens, H, generator=g).double()
    gate_up = torch.cat([expert_rows(gate, e), expert_rows(up, e)], dim=1)
    w_down = expert_cols(down, e)
    mask = route(x, router, k)
    assert mask.sum(1).tolist() == [k] * tokens
    got = moe_resident(x, mask, lambda i: (gate_up[i], w_down[i]))
    a = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
    ref = (a * mask.repeat_interleave(M, dim=1)) @ down.T
    torch.testing.assert_close(got, ref)
    # with every expert selected it is the dense MLP
    every = torch.ones(tokens, e, dtype=torch.bool)
    torch.testing.assert_close(
        moe_resident(x, every, lambda i: (gate_up[i], w_down[i])), a @ down.T
    )
    assert expert_forward(x[:1], gate_up[0], w_down[0]).shape == (1, H)


@pytest.mark.parametrize("eviction", ["lru", "cyclic"])
@pytest.mark.parametrize("predictor", ["none", "pregate", "m2r2"])
@pytest.mark.parametrize("slots", [1, 3, 8])
def test_tiered_runtime_is_bitwise_the_resident_model(tmp_path, predictor, slots, eviction) -> None:
    layers, e, k = 4, 4, 2
    w = _weights(layers, e, seed=3)
    g = torch.Generator().manual_seed(4)
    routers = [torch.randn(e, H, generator=g) for _ in range(layers)]
    tier = SlowTier.write(tmp_path / "x.bin", layers, e, LAYOUT, lambda a, b: w[a, b])
    fast = FastTier(tier, slots, eviction=eviction)
    adapters = _adapters(layers, 2, k, e) if predictor == "m2r2" else None
    pred = make_predictor(predictor, 1 if predictor == "none" else 2, adapters)
    pred.bind(routers, k, norms=[torch.ones(H)] * layers)
    rt = MoeRuntime(fast, pred, layers, e, k)
    try:
        for step in range(3):
            x = torch.randn(3 + step, H, generator=g)
            x_ref = x.clone()
            for layer in range(layers):
                mask = route(x, routers[layer], k)
                got = rt.layer(layer, x, x * 3, mask)
                ref = moe_resident(
                    x_ref, mask, lambda i, la=layer: (w[la, i]["gate_up"], w[la, i]["down"])
                )
                assert torch.equal(got, ref)
                x, x_ref = x + got, x_ref + ref
            rt.end_step(0.0)
        s = rt.stats()
        assert s["violations"] == 0
        assert s["hits"] + s["misses"] > 0
        if slots < layers * e:
            assert s["evictions"] > 0
        if predictor != "none":
            assert s["prefetches"] + s["prefetch_skipped"] + s["prefetch_cancelled"] > 0
            assert set(s["prediction"]) == {"1", "2"}
            assert 0 < s["prediction"]["1"]["recall"] <= 1
        else:
            assert s["prefetches"] == 0 and s["prediction"] == {}
        assert all(not sl.pins for sl in fast.slots)
    finally:
        fast.close()


# -- predictors --------------------------------------------------------------------------------


def test_pregate_names_the_next_layers_topk_union() -> None:
    g = torch.Generator().manual_seed(5)
    routers = [torch.randn(6, H, generator=g) for _ in range(4)]
    p = PregatePredictor(lookahead=2)
    p.bind(routers, 2)
    x = torch.randn(3, H, generator=g)
    out = p.predict(1, x, None)
    assert sorted(out) == [2, 3]
    for j, experts in out.items():
        want = sorted(set((x @ routers[j].T).topk(2, dim=-1).indices.flatten().tolist()))
        assert experts == want
    assert sorted(p.predict(2, x, None)) == [3]  # clipped at the last layer
    assert p.predict(3, x, None) == {}
    assert p.predict(0, x[:0], None) == {}


def test_none_predicts_nothing_and_names_are_checked() -> None:
    p = make_predictor("none")
    assert isinstance(p, ExpertPredictor) and p.predict(0, torch.zeros(2, H), None) == {}
    with pytest.raises(ValueError, match="unknown predictor"):
        make_predictor("oracle")
    with pytest.raises(ValueError, match="needs trained adapters"):
        make_predictor("m2r2")
    with pytest.raises(ValueError):
        PregatePredictor(lookahead=0)


# -- loader priority ---------------------------------------------------------------------------


def test_loader_runs_demand_first_promotes_and_cancels(tmp_path, monkeypatch) -> None:
    """With the loader held on a first load: prefetches queued before an on-demand load run
    after it, a queued prefetch a layer then needs runs right after the on-demand loads, and
    queued prefetches for layers already computed are cancelled (never read, slot EMPTY)."""
    layers, e = 4, 4
    w = _weights(layers, e)
    tier = SlowTier.write(tmp_path / "x.bin", layers, e, LAYOUT, lambda a, b: w[a, b])
    fast = FastTier(tier, 8)
    gate = threading.Event()
    read = tier.read_into
    order = []

    def gated_read(key, dst):
        gate.wait(5)
        order.append(key)
        read(key, dst)

    monkeypatch.setattr(tier, "read_into", gated_read)
    try:
        assert fast.demand((0, 0))  # the loader picks it up and waits on the gate
        deadline = time.monotonic() + 5
        while fast.queued_loads() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert fast.queued_loads() == 0  # (0, 0) is running, nothing queued
        for key in [(3, 0), (2, 1), (2, 2), (1, 3)]:  # prefetches, issued latest layer first
            assert fast.start_load(key, soft=True)
        assert fast.demand((1, 0))  # on demand: ahead of every queued prefetch
        assert fast.demand((2, 2))  # a queued prefetch now needed: promoted
        assert fast.stats.prefetch_promoted == 1 and fast.stats.late == 1
        # layer 1 has run: its unneeded queued prefetch (1, 3) is cancelled, (2, *) stay
        assert fast.cancel_prefetches(1) == 1
        assert not fast.resident((1, 3)) and fast.resident((2, 1))
        assert fast.stats.prefetch_cancelled == 1
        gate.set()
        fast.drain()
        # on-demand first, then the promoted prefetch, then prefetches by target layer
        assert order == [(0, 0), (1, 0), (2, 2), (2, 1), (3, 0)]
        assert list(fast.loader.order) == order
        assert (1, 3) not in order
        assert fast.stats.loads == 5 and fast.stats.prefetches == 3
        assert fast.stats.bytes_read == 5 * LAYOUT.nbytes
        for key in [(0, 0), (1, 0), (2, 2)]:
            fast.acquire(key)
            fast.views(key)
            fast.unpin(key)
        # a prefetch that already started is not cancelled; a pinned one neither
        assert fast.start_load((3, 3), soft=True)
        fast.drain()
        assert fast.cancel_prefetches() == 0 and fast.resident((3, 3))
        assert fast.stats.violations == 0
    finally:
        fast.close()


def test_loader_cancel_of_a_running_job_is_refused() -> None:
    from vllm_adaptive.moe.loader import DEMAND, Loader, prefetch_priority

    loader = Loader()
    started, release, ran = threading.Event(), threading.Event(), []
    first = loader.submit(DEMAND, lambda: (started.set(), release.wait(5)), tag="first")
    assert started.wait(5)
    later = loader.submit(prefetch_priority(5), lambda: ran.append("later"), tag="later")
    assert not first.cancel()  # running
    assert not loader.promote(first, DEMAND)
    assert later.cancel()
    release.set()
    loader.shutdown()
    assert first.done() and later.cancelled() and ran == []
    assert loader.order == ["first"]


def _adapters(layers: int, distances: int, top_k: int, e: int, seed: int = 7):
    from vllm_adaptive.moe.m2r2 import StreamAdapterConfig, StreamAdapters

    ad = StreamAdapters(StreamAdapterConfig(layers, H, distances, 3, top_k, e))
    ad.init_identity(seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ad.up.copy_(torch.randn(ad.up.shape, generator=g))
    return ad.requires_grad_(False)


def test_m2r2_predictor_routes_the_adapters_estimate() -> None:
    """Layer j's norm and router on the adapters' estimate of layer j's residual, top-k union;
    with zero up-projections the estimate is the residual itself."""
    from vllm_adaptive.moe.m2r2 import rms_norm
    from vllm_adaptive.moe.predictors import M2R2Predictor

    layers, e, k = 4, 6, 2
    g = torch.Generator().manual_seed(8)
    routers = [torch.randn(e, H, generator=g) for _ in range(layers)]
    norms = [torch.rand(H, generator=g) + 0.5 for _ in range(layers)]
    ad = _adapters(layers, 2, k, e)
    p = make_predictor("m2r2", 2, ad)
    assert isinstance(p, M2R2Predictor)
    p.bind(routers, k, norms=norms, eps=1e-5)
    h = torch.randn(3, H, generator=g) * 40
    out = p.predict(1, torch.zeros(3, H), h)
    assert sorted(out) == [2, 3]
    for j, experts in out.items():
        est = ad.estimate(1, j - 1, h)
        want = (rms_norm(est, norms[j], 1e-5) @ routers[j].T).topk(k, dim=-1).indices
        assert experts == sorted(set(want.flatten().tolist()))
    # scale-equivariant: the router reads a normalised input
    assert p.predict(1, torch.zeros(3, H), h * 10) == out
    # zero adapters: the residual itself goes through layer j's norm and router
    with torch.no_grad():
        ad.up.zero_()
    for j, experts in p.predict(0, torch.zeros(3, H), h).items():
        want = (rms_norm(h, norms[j], 1e-5) @ routers[j].T).topk(k, dim=-1).indices
        assert experts == sorted(set(want.flatten().tolist()))
    assert p.predict(0, torch.zeros(0, H), h[:0]) == {}
    with pytest.raises(ValueError, match="lookahead 3"):
        make_predictor("m2r2", 3, ad)


def test_m2r2_adapter_files_are_checked(tmp_path) -> None:
    from vllm_adaptive.moe.m2r2 import StreamAdapterError, StreamAdapters, load_for_engine

    ad = _adapters(4, 2, 2, 6)
    ad.save(tmp_path / "a", {"model_fingerprint": None})
    back, _ = StreamAdapters.load(tmp_path / "a")
    assert torch.equal(back.up, ad.up) and torch.equal(back.down, ad.down)
    kw = {"model_dir": None, "num_layers": 4, "hidden_size": H, "num_experts": 6}
    load_for_engine(tmp_path / "a", top_k=2, lookahead=2, **kw)
    with pytest.raises(StreamAdapterError, match="no M2R2 expert-prediction adapters"):
        load_for_engine(tmp_path / "missing", top_k=2, lookahead=1, **kw)
    with pytest.raises(StreamAdapterError, match="top-k 2, the engine routes top-k 3"):
        load_for_engine(tmp_path / "a", top_k=3, lookahead=1, **kw)
    with pytest.raises(StreamAdapterError, match="up to 2 layers ahead, lookahead is 3"):
        load_for_engine(tmp_path / "a", top_k=2, lookahead=3, **kw)
    with pytest.raises(StreamAdapterError, match="num_layers=4, the model has 5"):
        load_for_engine(tmp_path / "a", top_k=2, lookahead=1, **{**kw, "num_layers": 5})
    (tmp_path / "a" / "moe_m2r2.safetensors").write_bytes(b"garbage")
    with pytest.raises(StreamAdapterError, match="sha256"):
        StreamAdapters.load(tmp_path / "a")


# -- the indexed victim search -----------------------------------------------------------------


def _noisy_predictions(trace, experts: int, lookahead: int, seed: int):
    """Each layer names the next layers' experts, with one random extra and one dropped (a
    predictor with misses and waste: soft pins that are never needed)."""
    import random

    rng = random.Random(seed)
    out = []
    for step in trace:
        per_layer = []
        for layer in range(len(step)):
            pred = {}
            for j in range(layer + 1, min(len(step), layer + lookahead + 1)):
                names = set(step[j][1:]) | {rng.randrange(experts)}
                pred[j] = sorted(names)
            per_layer.append(pred)
        out.append(per_layer)
    return out


@pytest.mark.parametrize("eviction", ["lru", "cyclic"])
@pytest.mark.parametrize("slots", [3, 7, 12])
def test_indexed_victim_search_chooses_what_the_scan_chooses(tmp_path, eviction, slots) -> None:
    """At every load of a trace (with and without a noisy predictor's soft pins), the indexed
    search (O(log n)) picks the very slot the reference scan of every slot picks. Outstanding
    loads are waited for first, so both see the same READY slots."""
    from concurrent.futures import wait as wait_all

    from vllm_adaptive.moe.replay import replay, synthetic_trace

    layers, e = 5, 6
    w = _weights(layers, e)
    tier = SlowTier.write(tmp_path / "x.bin", layers, e, LAYOUT, lambda a, b: w[a, b])
    checked = []
    try:
        for batch, preds in [(1, None), (2, "noisy"), (1, "noisy")]:
            trace = synthetic_trace(12, layers, e, 2, batch, seed=batch)
            predictions = _noisy_predictions(trace, e, 2, seed=3) if preds else None
            fast = FastTier(tier, slots, eviction=eviction)
            indexed = fast._victim

            def both(allow_soft, fast=fast, indexed=indexed):
                wait_all([s.future for s in fast.slots if s.future is not None])
                got = indexed(allow_soft)
                want = fast._victim_scan(allow_soft)
                assert got is want, (fast.current_layer, allow_soft, got, want)
                checked.append(got is not None and got.state != "empty")
                return got

            fast._victim = both
            try:
                r = replay(fast, trace, predictions)
            finally:
                fast.loader.shutdown()
            assert fast.stats.violations == 0 and r.loads > slots
        assert sum(checked) > 50  # most searches evicted something (not just EMPTY slots)
    finally:
        tier.close()


def test_indexed_victim_search_after_cancelled_prefetches(tmp_path, monkeypatch) -> None:
    """Cancelled prefetches leave EMPTY slots: the lowest-index one is the victim, in both
    searches; soft pins released by layer become evictable again in both."""
    layers, e = 4, 4
    w = _weights(layers, e)
    tier = SlowTier.write(tmp_path / "x.bin", layers, e, LAYOUT, lambda a, b: w[a, b])
    fast = FastTier(tier, 4)
    gate = threading.Event()
    read = tier.read_into
    monkeypatch.setattr(tier, "read_into", lambda key, dst: (gate.wait(5), read(key, dst)))
    try:
        fast.current_layer = 0
        assert fast.demand((0, 0))  # holds the loader
        for key in [(1, 1), (2, 2), (1, 3)]:
            assert fast.start_load(key, soft=True)
        assert fast._victim(True) is None and fast._victim_scan(True) is None
        assert fast.cancel_prefetches(1) == 2  # (1, 1) and (1, 3): slots 1 and 3
        assert fast._victim(False) is fast._victim_scan(False) is fast.slots[1]
        gate.set()
        fast.acquire((0, 0))
        fast.unpin((0, 0))
        fast.drain()
        for key in [(3, 0), (3, 1)]:  # fill slots 1 and 3
            assert fast.start_load(key)
        fast.drain()
        for layer in range(layers):
            fast.current_layer = layer
            for soft in (False, True):
                assert fast._victim(soft) is fast._victim_scan(soft)
        fast.release_soft(2)
        fast.current_layer = 2  # cyclic: layer 2 comes back last, (2, 2) goes first
        assert fast._victim(False) is fast._victim_scan(False) is fast.slots[fast.where[2, 2]]
    finally:
        fast.close()
