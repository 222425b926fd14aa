"""Expert tiers: the bounded fast tier in memory over the slow tier on disk (mechanism, no policy).

**Fast tier** (:class:`FastTier`): a fixed number of preallocated slots (one record each,
bounded in bytes by the caller), an eviction order over them ("lru", or "cyclic": the layer that
comes back last in the layer cycle first) plus two kinds of pins: hard pins (an expert the
current layer is about to compute; never evicted) and soft pins (an expert a predictor
prefetched for a later layer; evicted only by an on-demand load that finds nothing else). The
victim of a load is found from an index (heaps with lazy deletion), not by scanning every slot.
Loads run on one background thread (:class:`Loader`) in priority order, not FIFO: on-demand
loads first, then prefetches by target layer (earliest first); a queued prefetch the compute
turns out to need is promoted to on-demand (:meth:`FastTier.demand`), and queued prefetches for
layers already computed are cancelled (:meth:`FastTier.cancel_prefetches`). Why: with a FIFO the
on-demand loads of layer l waited behind prefetches for later layers, and pre-gating stalled
more than no prediction at all (docs/moe-runtime.md). The job drops the evicted record's pages,
then copies the new record from the mapping into the slot. The state machine (EMPTY, LOADING,
READY) is only changed by the caller's thread; the loader thread only copies.
:meth:`FastTier.acquire` returns an expert ready for compute, waiting on its load only when it
is not ready yet: that wait is the stall time. :meth:`FastTier.views` is the only way to read a
slot's weights and checks that the slot is READY and holds the asked (layer, expert); a failure
of that check counts in ``stats.violations`` (must stay 0) and is logged.

Which experts to load, pin and prefetch is the caller's business (``moe/runtime.py``).

The slow tier is :mod:`vllm_adaptive.moe.slow_tier`, the load thread
:mod:`vllm_adaptive.moe.loader`. The module is over 400 lines because :class:`FastTier` is one
class: its slot states, eviction index and pins change together under one lock.
"""

from __future__ import annotations

import collections
import heapq
import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import asdict, dataclass, field

import torch

from vllm_adaptive.moe.loader import DEMAND, Loader, prefetch_priority
from vllm_adaptive.moe.slow_tier import Key, SlowTier

logger = logging.getLogger("vllm.adaptive.moe")

EMPTY, LOADING, READY = "empty", "loading", "ready"
EVICTIONS = ("lru", "cyclic")


@dataclass
class ExpertSlot:
    index: int
    key: Key | None = None
    state: str = EMPTY
    future: Future | None = None
    evicted: Key | None = None  # the record this slot's queued load replaces (dropped by it)
    pins: int = 0  # hard pins: about to be computed; never evicted
    soft: bool = False  # prefetched for a later layer; evicted only as a last resort
    last_use: int = 0


@dataclass
class TierStats:
    hits: int = 0  # compute found its expert READY
    misses: int = 0  # compute found it absent or still loading (it waited)
    late: int = 0  # misses whose load was already under way (a prefetch that came late)
    loads: int = 0
    prefetches: int = 0  # loads started by a predictor
    prefetch_skipped: int = 0  # prefetches that found no evictable slot
    prefetch_promoted: int = 0  # queued prefetches a layer needed: moved to on-demand priority
    prefetch_cancelled: int = 0  # queued prefetches for layers already computed: never read
    evictions: int = 0
    stall_seconds: float = 0.0
    load_seconds: float = 0.0  # the loader thread's time in loads (written by it alone)
    bytes_read: int = 0
    violations: int = 0  # compute on a slot that was not READY with the asked key

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass
class FastTier:
    """``num_slots`` preallocated records over a :class:`SlowTier` (see the module docstring)."""

    slow: SlowTier
    num_slots: int
    stats: TierStats = field(default_factory=TierStats)
    #: "cyclic" (the default): evict the expert whose layer comes back last in the layer cycle
    #: (the layer that just ran first; LRU order within a layer); "lru": the least recently used.
    #: Why cyclic: layers run in a fixed cycle, so once the experts a step needs (plus a
    #: predictor's wrong guesses) outgrow the tier, LRU evicts exactly the layer needed next and
    #: reloads every expert every step; "cyclic" is Belady's choice for that cycle. Measured
    #: (docs/moe-runtime.md, "Eviction policy"): in an engine-free replay of the MoEfied model's
    #: routing, cyclic needs as few or fewer loads per step in every case (with pre-gating at 50%,
    #: batch 1: 120 against 292) and hits as often or more except within 0.01 with a perfect
    #: predictor; in the engine bench, prediction lifted the hit rate only with cyclic.
    eviction: str = "cyclic"
    current_layer: int = 0  # set by the caller before each layer

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"the fast tier needs at least one slot, got {self.num_slots}")
        if self.eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got {self.eviction!r}")
        layout = self.slow.layout
        self.buffer = torch.zeros((self.num_slots, layout.stride), dtype=torch.uint8)
        self._np = self.buffer.numpy()
        self.slots = [ExpertSlot(i) for i in range(self.num_slots)]
        self.where: dict[Key, int] = {}
        self._clock = 0
        self.loader = Loader()
        self._prefetching: set[int] = set()  # slots whose load was started as a prefetch
        self.loader_threads: set[int] = set()
        # The eviction index (see _victim): EMPTY slots by index, evictable slots per bucket by
        # last use, both heaps with lazy deletion; slots whose load finished (appended by the
        # loader thread, polled by the caller's); soft-pinned slots per layer.
        self._empty: list[int] = list(range(self.num_slots))
        self._buckets: dict[tuple[bool, int], list[tuple[int, int]]] = {}
        self._done: collections.deque[int] = collections.deque()
        self._soft: dict[int, set[int]] = {}
        self._views = []
        shapes = dict(layout.parts)
        for i in range(self.num_slots):
            row = {}
            for name, (off, n) in layout.offsets().items():
                row[name] = self.buffer[i, off : off + n].view(layout.dtype).view(shapes[name])
            self._views.append(row)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    # -- loader thread ------------------------------------------------------------------------

    def _job(self, index: int, key: Key, evicted: Key | None) -> None:
        t0 = time.perf_counter()
        self.loader_threads.add(threading.get_ident())
        if evicted is not None:
            self.slow.drop(evicted)
        self.slow.read_into(key, self._np[index])
        self.stats.load_seconds += time.perf_counter() - t0

    def queued_loads(self) -> int:
        """Loads submitted and not started yet (the loader's backlog)."""
        return self.loader.queued()

    # -- state (caller's thread only) ---------------------------------------------------------

    def _poll(self, slot: ExpertSlot) -> None:
        if slot.state == LOADING and slot.future is not None and slot.future.done():
            slot.future.result()  # re-raise a failed load here
            slot.state, slot.future, slot.evicted = READY, None, None
            self._index(slot)

    # -- eviction order -------------------------------------------------------------------------
    #
    # The victim is, in this order: the EMPTY slot of lowest index; else among the READY slots
    # without hard pins (soft-pinned ones only with allow_soft, and after all others) the one of
    # smallest _rank. _victim_scan is that definition, a scan of every slot (O(slots) per load:
    # 22-32 us per load at 120 slots, 42-63 at 240, measured); _victim finds the same slot from
    # an index (heaps with lazy deletion, O(log n) amortised per load: 1.4-3.4 us;
    # tests/unit/test_moe_tiers.py checks that both choose the same slot at every load of a
    # trace).

    def _rank(self, slot: ExpertSlot) -> tuple:
        """Eviction order: the smallest goes first (soft pins last)."""
        if self.eviction == "cyclic" and slot.key is not None:
            layers = self.slow.num_layers
            comes_back_in = (slot.key[0] - self.current_layer - 1) % layers
            return (slot.soft, -comes_back_in, slot.last_use)
        return (slot.soft, 0, slot.last_use)

    def _victim_scan(self, allow_soft: bool) -> ExpertSlot | None:
        """The reference victim search (see above): every slot, O(slots)."""
        best, best_rank = None, None
        for slot in self.slots:
            self._poll(slot)
            if slot.state == LOADING or slot.pins:
                continue
            if slot.state == EMPTY:
                return slot
            if slot.soft and not allow_soft:
                continue
            rank = self._rank(slot)
            if best is None or rank < best_rank:
                best, best_rank = slot, rank
        return best

    def _bucket(self, slot: ExpertSlot) -> tuple[bool, int]:
        # cyclic: one bucket per (soft, layer), searched in cycle order; lru: one per soft
        layer = slot.key[0] if self.eviction == "cyclic" and slot.key is not None else 0
        return (slot.soft, layer)

    def _index(self, slot: ExpertSlot) -> None:
        """Record ``slot`` as evictable if it is (READY, no hard pin); call after any change of
        its state, pins, soft pin or last use. Entries that stop being true are skipped later."""
        if slot.state == EMPTY:
            heapq.heappush(self._empty, slot.index)
            return
        if slot.state != READY or slot.pins:
            return
        heap = self._buckets.setdefault(self._bucket(slot), [])
        heapq.heappush(heap, (slot.last_use, slot.index))
        if len(heap) > 2 * self.num_slots + 64:  # stale entries: compact (amortised O(1))
            heap[:] = [e for e in heap if self._current(e, self._bucket(slot))]
            heapq.heapify(heap)

    def _current(self, entry: tuple[int, int], bucket: tuple[bool, int]) -> bool:
        slot = self.slots[entry[1]]
        return (
            slot.state == READY
            and not slot.pins
            and slot.last_use == entry[0]
            and self._bucket(slot) == bucket
        )

    def _top(self, bucket: tuple[bool, int]) -> ExpertSlot | None:
        heap = self._buckets.get(bucket)
        while heap:
            if self._current(heap[0], bucket):
                return self.slots[heap[0][1]]
            heapq.heappop(heap)
        return None

    def _victim(self, allow_soft: bool) -> ExpertSlot | None:
        """The slot :meth:`_victim_scan` would choose, from the index."""
        while self._done:  # loads finished since the last search: READY now
            self._poll(self.slots[self._done.popleft()])
        while self._empty:
            slot = self.slots[self._empty[0]]
            if slot.state == EMPTY:
                return slot
            heapq.heappop(self._empty)
        layers = self.slow.num_layers
        if self.eviction == "cyclic":  # the current layer first, then backwards round the cycle
            order = [(self.current_layer - i) % layers for i in range(layers)]
        else:
            order = [0]
        for soft in (False, True) if allow_soft else (False,):
            for layer in order:
                slot = self._top((soft, layer))
                if slot is not None:
                    return slot
        return None

    def state(self, key: Key) -> str:
        i = self.where.get(key)
        if i is None:
            return EMPTY
        self._poll(self.slots[i])
        return self.slots[i].state

    def resident(self, key: Key) -> bool:
        return key in self.where

    def start_load(
        self, key: Key, *, pin: bool = False, soft: bool = False, allow_soft_evict: bool = False
    ) -> bool:
        """Make ``key`` resident or start loading it; False when no slot could be freed.
        ``pin``: add a hard pin; ``soft``: mark it prefetched (soft-pinned)."""
        i = self.where.get(key)
        if i is None:
            slot = self._victim(allow_soft_evict)
            if slot is None:
                if soft:
                    self.stats.prefetch_skipped += 1
                return False
            evicted = slot.key
            if evicted is not None:
                del self.where[evicted]
                self.stats.evictions += 1
            slot.key, slot.state, slot.soft, slot.pins = key, LOADING, False, 0
            slot.evicted = evicted
            self._clock += 1
            slot.last_use = self._clock
            priority = prefetch_priority(key[0]) if soft else DEMAND
            slot.future = self.loader.submit(
                priority, lambda i=slot.index, k=key, ev=evicted: self._job(i, k, ev), tag=key
            )
            slot.future.add_done_callback(lambda _f, i=slot.index: self._done.append(i))
            self.where[key] = slot.index
            self.stats.loads += 1
            self.stats.bytes_read += self.slow.layout.nbytes
            if soft:
                self.stats.prefetches += 1
                self._prefetching.add(slot.index)
        else:
            slot = self.slots[i]
        if pin:
            slot.pins += 1
        if soft and not slot.soft:
            slot.soft = True
            self._soft.setdefault(key[0], set()).add(slot.index)
            self._index(slot)
        return True

    def pin(self, key: Key) -> bool:
        """Hard-pin ``key`` if resident (READY or LOADING)."""
        i = self.where.get(key)
        if i is None:
            return False
        self.slots[i].pins += 1
        return True

    def unpin(self, key: Key) -> None:
        slot = self.slots[self.where[key]]
        if slot.pins <= 0:
            raise RuntimeError(f"unpin of {key}, which is not pinned")
        slot.pins -= 1
        if not slot.pins:
            self._index(slot)

    def cancel_prefetches(self, upto_layer: int | None = None) -> int:
        """Cancel the queued (not started) prefetches for layers <= ``upto_layer`` (every layer
        with None) that no layer pinned: they come too late to help. Their slots become EMPTY
        (the record they were to replace is dropped here instead). Returns how many."""
        n = 0
        for index in sorted(self._prefetching):
            slot = self.slots[index]
            self._poll(slot)
            if slot.state != LOADING:
                self._prefetching.discard(index)
            if (
                slot.state != LOADING
                or not slot.soft
                or slot.pins
                or slot.key is None
                or (upto_layer is not None and slot.key[0] > upto_layer)
                or slot.future is None
                or not slot.future.cancel()
            ):
                continue
            if slot.evicted is not None:
                self.slow.drop(slot.evicted)
            del self.where[slot.key]
            self._soft.get(slot.key[0], set()).discard(index)
            slot.key, slot.state, slot.future, slot.evicted = None, EMPTY, None, None
            slot.soft = False
            self._index(slot)
            self.stats.loads -= 1  # it never read anything
            self.stats.prefetches -= 1
            self.stats.bytes_read -= self.slow.layout.nbytes
            self.stats.prefetch_cancelled += 1
            self._prefetching.discard(index)
            n += 1
        return n

    def release_soft(self, layer: int | None = None) -> None:
        """Clear the soft pins of ``layer``'s experts (every layer's with None)."""
        for la in list(self._soft) if layer is None else [layer]:
            for index in self._soft.pop(la, ()):
                slot = self.slots[index]
                if slot.soft and slot.key is not None and slot.key[0] == la:
                    slot.soft = False
                    self._index(slot)

    def demand(self, key: Key) -> bool:
        """The current layer needs ``key``: count a hit (READY), a late prefetch (LOADING) or a
        miss (absent), hard-pin it and start its load if absent. False: absent and no slot can
        be freed now (pinned or loading); call :meth:`load_blocking` when pins are released."""
        i = self.where.get(key)
        if i is not None:
            slot = self.slots[i]
            self._poll(slot)
            if slot.state == READY:
                self.stats.hits += 1
            else:
                self.stats.misses += 1
                self.stats.late += 1
                if slot.future is not None and self.loader.promote(slot.future, DEMAND):
                    self.stats.prefetch_promoted += 1
            slot.pins += 1
            return True
        self.stats.misses += 1
        return self.start_load(key, pin=True, allow_soft_evict=True)

    def load_blocking(self, key: Key) -> None:
        """Start loading absent ``key`` (hard-pinned), waiting for loads under way to free a
        slot when every slot is busy; the wait counts as stall."""
        t0 = time.perf_counter()
        while not self.start_load(key, pin=True, allow_soft_evict=True):
            pending = [s.future for s in self.slots if s.state == LOADING and s.future]
            if not pending:
                raise RuntimeError(
                    f"fast tier: no slot for expert {key}: all {self.num_slots} are pinned"
                )
            wait(pending, return_when=FIRST_COMPLETED)
        self.stats.stall_seconds += time.perf_counter() - t0

    def acquire(self, key: Key) -> None:
        """Wait until resident ``key`` is READY (that wait is the stall) and mark it used."""
        slot = self.slots[self.where[key]]
        self._poll(slot)
        if slot.state != READY:
            t0 = time.perf_counter()
            if slot.future is not None:
                slot.future.result()
            self._poll(slot)
            self.stats.stall_seconds += time.perf_counter() - t0
        self._clock += 1
        slot.last_use = self._clock
        self._index(slot)

    def views(self, key: Key) -> dict[str, torch.Tensor]:
        """The weights of ``key`` for compute; checks that its slot is READY and holds it."""
        i = self.where.get(key)
        slot = self.slots[i] if i is not None else None
        if slot is not None:
            self._poll(slot)
        if slot is None or slot.state != READY or slot.key != key:
            self.stats.violations += 1
            logger.error(
                "vllm-adaptive moe: expert %s computed from a slot that is not READY with it "
                "(slot %s)",
                key,
                None if slot is None else (slot.index, slot.key, slot.state),
            )
            if slot is None:
                raise RuntimeError(f"expert {key} is not in the fast tier")
        return self._views[slot.index]

    def drain(self) -> None:
        """Wait for every load under way."""
        for slot in self.slots:
            if slot.future is not None:
                slot.future.result()
            self._poll(slot)

    def close(self) -> None:
        self.loader.shutdown()
        self.slow.close()
