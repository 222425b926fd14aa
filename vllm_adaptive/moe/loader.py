"""The fast tier's load thread: one background thread running load jobs in priority order
(on-demand loads first, then prefetches by target layer), off the compute thread's CPUs."""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future

logger = logging.getLogger("vllm.adaptive.moe")


def _off_compute_cpus() -> set[int] | None:
    """Move the calling (loader) thread off the compute thread's CPUs, where there are others.
    Why: vLLM's CPU worker binds its compute thread to its cores and threads it starts inherit
    that mask, so the loads would time-share the compute core instead of overlapping with it.
    Returns the loader's CPUs (None: unchanged)."""
    try:
        mine = os.sched_getaffinity(0)
        others = set(range(os.cpu_count() or 1)) - mine
        if not others:
            return None
        os.sched_setaffinity(0, others)  # 0: this thread
        return others
    except (AttributeError, OSError):
        return None


# Load priorities (smaller first): on-demand loads, then prefetches by the layer they are for.
DEMAND = (0, 0)


def prefetch_priority(layer: int) -> tuple[int, int]:
    return (1, layer)


class Loader:
    """One background thread running load jobs in priority order (see the module docstring).

    :meth:`submit` returns the job's :class:`~concurrent.futures.Future`; :meth:`promote`
    raises the priority of a job still queued; cancelling a queued job is the future's own
    ``cancel()`` (the thread skips it). Jobs with equal priority run in submission order."""

    def __init__(self, name: str = "moe-loader") -> None:
        self._heap: list[tuple[tuple[int, int], int, Future]] = []
        self._jobs: dict[Future, tuple[tuple[int, int], Callable[[], None]]] = {}
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self.cpus: set[int] | None = None  # set by the thread: its CPUs when it moved off
        self.order: list[object] = []  # tags of the jobs run, in order (bounded; for tests)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, priority: tuple[int, int], fn: Callable[[], None], tag=None) -> Future:
        future: Future = Future()
        future.tag = tag  # type: ignore[attr-defined]
        with self._cv:
            if self._closed:
                raise RuntimeError("the loader is closed")
            self._jobs[future] = (priority, fn)
            heapq.heappush(self._heap, (priority, next(self._seq), future))
            self._cv.notify()
        return future

    def promote(self, future: Future, priority: tuple[int, int]) -> bool:
        """Give a queued job a higher priority; False when it started or finished already."""
        with self._cv:
            job = self._jobs.get(future)
            if job is None or future.done() or future.running():
                return False
            if priority < job[0]:
                self._jobs[future] = (priority, job[1])
                # the old entry stays in the heap and is skipped when popped (priority changed)
                heapq.heappush(self._heap, (priority, next(self._seq), future))
            return True

    def queued(self) -> int:
        with self._cv:
            return sum(not f.cancelled() for f in self._jobs)

    def _run(self) -> None:
        self.cpus = _off_compute_cpus()
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                priority, _, future = heapq.heappop(self._heap)
                job = self._jobs.get(future)
                if job is None or job[0] != priority:
                    continue  # the stale entry of a promoted job
                del self._jobs[future]
                fn = job[1]
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                fn()
            except BaseException as e:  # handed to whoever waits on the future
                future.set_exception(e)
            else:
                future.set_result(None)
            self.order.append(getattr(future, "tag", None))
            del self.order[:-256]

    def shutdown(self) -> None:
        """Finish the queued jobs, then stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()
