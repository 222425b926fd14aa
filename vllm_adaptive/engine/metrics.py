"""Adaptive metrics on vLLM's ``/metrics``, via a ``vllm.stat_logger_plugins`` entry point.

The depth runtime and the precision controller run in the worker process and write cumulative
totals to ``engine-<pid>.json`` (:mod:`vllm_adaptive.telemetry_exchange`). vLLM's
frontend instantiates :class:`AdaptiveStatLogger` (``AsyncLLM`` loads the
stat-logger plugin group, so ``vllm serve`` and ``AsyncLLM`` get it; the
offline ``LLM`` class does not load stat-logger plugins: read
:func:`~vllm_adaptive.telemetry_exchange.read_engine_stats` there). Every
``record()`` (once per engine step) re-reads the files, at most once per
second, into one process-wide :class:`AdaptiveTelemetryCollector` registered
in prometheus_client's default registry, which vLLM's ``/metrics`` serves:

==========================================  =======  =====================================
``vllm_adaptive:decode_tokens_total``       counter  decode tokens
``vllm_adaptive:exit_tokens_total{depth}``  counter  decode tokens by layers run (full
                                                     depth included)
``vllm_adaptive:layers_executed_total``     counter  decode token-layers executed
``vllm_adaptive:mean_decode_depth``         gauge    layers_executed / decode_tokens
                                                     (absent before the first decode token)
``vllm_adaptive:decision_seconds_total``    counter  time spent deciding exits or gears
``vllm_adaptive:forward_seconds_total``     counter  forward time
``vllm_adaptive:gear_tokens_total{gear}``   counter  decode tokens by precision gear (low,
                                                     mid, high; off: adaptive_mode "off")
``vllm_adaptive:gear_shifts_total``         counter  gear changes between consecutive decode
                                                     tokens of a request
``vllm_adaptive:moe_tokens_total``          counter  tokens through a tiered MoE model
``vllm_adaptive:moe_expert_hits_total``     counter  experts a layer needed that were READY
                                                     in the fast tier
``vllm_adaptive:moe_expert_misses_total``   counter  ... absent or still loading
``vllm_adaptive:moe_expert_loads_total``    counter  slow-tier loads (on demand + prefetch)
``vllm_adaptive:moe_expert_evictions_total`` counter fast-tier evictions
``vllm_adaptive:moe_prefetches_total``      counter  prefetch loads a predictor started
``vllm_adaptive:moe_prefetches_promoted_total`` counter queued prefetches a layer then
                                                     needed (moved to on-demand priority)
``vllm_adaptive:moe_prefetches_cancelled_total`` counter queued prefetches cancelled (their
                                                     layer had run; never read)
``vllm_adaptive:moe_stall_seconds_total``   counter  compute waiting for expert loads
``vllm_adaptive:moe_read_bytes_total``      counter  bytes read from the slow tier
``vllm_adaptive:moe_expert_hit_rate``       gauge    hits / (hits + misses) (absent before
                                                     the first expert is needed)
==========================================  =======  =====================================

MoE engines (``adaptive.moe``, ``moe/runtime.py``) count the ``moe_`` families and their forward
time; the stall per token is ``moe_stall_seconds_total / moe_tokens_total``.

Depth engines count exits; precision engines count every decode token at full depth (all
layers run, at some precision) and add the gear families. The families are exported on every
server with the plugin; they stay 0 on engines without either mechanism.

Why a custom collector: the files already hold cumulative totals. A
prometheus_client ``Counter`` can only be incremented, so exporting a file
total through it would mean tracking deltas (and breaking on a restarted
worker); a ``Gauge`` named ``*_total`` would carry the wrong TYPE, and
Prometheus tooling treats ``rate()`` over a gauge as a mistake. A collector
yielding ``CounterMetricFamily`` exports the file total as-is with TYPE
counter, which is what Prometheus expects of a total maintained elsewhere
(the same pattern as its process and platform collectors). A total that goes
down (a new stats directory) reads to Prometheus as a counter reset, which
``rate()`` handles.

The collector also refreshes (same one-second throttle) when scraped, so
totals written after the last engine step of a burst still show up while the
server is idle. It is created and registered once per process however many
engines (stat loggers) a process creates. Errors reading the files are logged
and never reach vLLM's output loop or its ``/metrics`` handler.

Limitation: with ``--api-server-count`` > 1 vLLM serves ``/metrics`` from a
prometheus multiprocess registry that ignores collectors in the default
registry, so these families are absent there (a warning says so).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry
from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from vllm_adaptive.telemetry_exchange import read_engine_stats, stats_dir

logger = logging.getLogger("vllm.adaptive.metrics")

PREFIX = "vllm_adaptive:"
#: The counters exported from summed file fields: (metric name, file key, help).
COUNTERS = (
    ("decode_tokens_total", "decode_tokens", "Decode tokens run by adaptive-depth engines."),
    (
        "layers_executed_total",
        "layers_executed",
        "Decoder layers executed by decode tokens (token-layers).",
    ),
    (
        "decision_seconds_total",
        "decision_seconds",
        "Seconds spent deciding early exits or precision gears.",
    ),
    ("forward_seconds_total", "forward_seconds", "Seconds spent in adaptive forward passes."),
    (
        "gear_shifts_total",
        "gear_shifts",
        "Precision gear changes between consecutive decode tokens of a request.",
    ),
    ("moe_tokens_total", "moe_tokens", "Tokens run through a tiered MoE model."),
    (
        "moe_expert_hits_total",
        "moe_hits",
        "Experts a layer needed that were ready in the fast tier.",
    ),
    (
        "moe_expert_misses_total",
        "moe_misses",
        "Experts a layer needed that were absent from the fast tier or still loading.",
    ),
    ("moe_expert_loads_total", "moe_loads", "Expert loads from the slow tier."),
    ("moe_expert_evictions_total", "moe_evictions", "Experts evicted from the fast tier."),
    ("moe_prefetches_total", "moe_prefetches", "Expert prefetch loads a predictor started."),
    (
        "moe_prefetches_promoted_total",
        "moe_prefetch_promoted",
        "Queued expert prefetches a layer needed before they started (promoted to on-demand).",
    ),
    (
        "moe_prefetches_cancelled_total",
        "moe_prefetch_cancelled",
        "Queued expert prefetches cancelled because their layer had already run.",
    ),
    (
        "moe_stall_seconds_total",
        "moe_stall_seconds",
        "Seconds the MoE compute waited for expert loads.",
    ),
    ("moe_read_bytes_total", "moe_bytes_read", "Bytes read from the expert slow tier."),
)
EXIT_TOKENS = "exit_tokens_total"
GEAR_TOKENS = "gear_tokens_total"
MEAN_DEPTH = "mean_decode_depth"
MOE_HIT_RATE = "moe_expert_hit_rate"
MIN_REFRESH_INTERVAL_S = 1.0


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def aggregate_engine_stats(stats: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Sum engine stats dicts: the totals the metrics export. Bad fields count as absent."""
    totals: dict[str, Any] = {key: 0.0 for _, key, _ in COUNTERS}
    exits: dict[int, float] = {}
    gears: dict[str, float] = {}
    for entry in stats:
        for _, key, _ in COUNTERS:
            value = _number(entry.get(key))
            if value is not None:
                totals[key] += value
        by_depth = entry.get("exit_tokens")
        if isinstance(by_depth, Mapping):
            for depth, count in by_depth.items():
                value = _number(count)
                try:
                    layers = int(depth)
                except (TypeError, ValueError):
                    continue
                if value is not None:
                    exits[layers] = exits.get(layers, 0.0) + value
        by_gear = entry.get("gear_tokens")
        if isinstance(by_gear, Mapping):
            for gear, count in by_gear.items():
                value = _number(count)
                if isinstance(gear, str) and value is not None:
                    gears[gear] = gears.get(gear, 0.0) + value
    totals["exit_tokens"] = {str(d): exits[d] for d in sorted(exits)}
    totals["gear_tokens"] = dict(sorted(gears.items()))
    return totals


class AdaptiveTelemetryCollector(Collector):
    """Exports the latest totals of the engine stats files (see the module docstring)."""

    def __init__(
        self,
        reader: Callable[[], list[dict[str, Any]]] = read_engine_stats,
        min_interval_s: float = MIN_REFRESH_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._reader = reader
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last_refresh: float | None = None
        self._totals = aggregate_engine_stats([])
        self._warned = False

    @property
    def totals(self) -> dict[str, Any]:
        return self._totals

    def refresh(self, force: bool = False) -> bool:
        """Re-read the files unless that happened less than ``min_interval_s`` ago. Never raises."""
        now = self._clock()
        with self._lock:
            if (
                not force
                and self._last_refresh is not None
                and now - self._last_refresh < self._min_interval_s
            ):
                return False
            self._last_refresh = now
        try:
            totals = aggregate_engine_stats(self._reader())
        except Exception:
            if not self._warned:
                self._warned = True
                logger.exception("adaptive telemetry: reading engine stats failed")
            return False
        self._totals = totals
        return True

    def _families(self, totals: Mapping[str, Any] | None) -> list[Metric]:
        families: list[Metric] = []
        for name, key, doc in COUNTERS:
            family = CounterMetricFamily(PREFIX + name, doc)
            if totals is not None:
                family.add_metric([], totals[key])
            families.append(family)
        exits = CounterMetricFamily(
            PREFIX + EXIT_TOKENS,
            "Decode tokens by the number of decoder layers they ran (full depth included).",
            labels=["depth"],
        )
        mean = GaugeMetricFamily(
            PREFIX + MEAN_DEPTH, "Mean decoder layers run per decode token (cumulative)."
        )
        gears = CounterMetricFamily(
            PREFIX + GEAR_TOKENS,
            "Decode tokens by the precision gear they ran at (off: adaptive_mode off).",
            labels=["gear"],
        )
        hit_rate = GaugeMetricFamily(
            PREFIX + MOE_HIT_RATE,
            "Fraction of needed experts that were ready in the fast tier (cumulative).",
        )
        if totals is not None:
            demanded = totals["moe_hits"] + totals["moe_misses"]
            if demanded > 0:
                hit_rate.add_metric([], totals["moe_hits"] / demanded)
            for depth, count in totals["exit_tokens"].items():
                exits.add_metric([depth], count)
            if totals["decode_tokens"] > 0:
                mean.add_metric([], totals["layers_executed"] / totals["decode_tokens"])
            for gear, count in totals["gear_tokens"].items():
                gears.add_metric([gear], count)
        return [*families, exits, mean, gears, hit_rate]

    def describe(self) -> list[Metric]:
        return self._families(None)

    def collect(self) -> list[Metric]:
        self.refresh()
        try:
            return self._families(self._totals)
        except Exception:  # never break vLLM's /metrics
            logger.exception("adaptive telemetry: exporting metrics failed")
            return []


_collector: AdaptiveTelemetryCollector | None = None
_collector_lock = threading.Lock()


def install_collector(registry: CollectorRegistry = REGISTRY) -> AdaptiveTelemetryCollector:
    """The process-wide collector, registered in ``registry``; idempotent."""
    global _collector
    with _collector_lock:
        if _collector is None:
            _collector = AdaptiveTelemetryCollector()
        try:
            registry.register(_collector)
        except ValueError:
            # Already registered (a second engine in this process), or another copy of
            # this collector (a reloaded module) owns the names: it reads the same files.
            pass
        return _collector


class AdaptiveStatLogger(AggregateStatLoggerBase):
    """vLLM stat logger (entry point ``vllm.stat_logger_plugins``) that feeds the collector.

    One instance covers every data-parallel engine of the frontend: the stats
    files are per process, not per engine index. It is not a
    ``PrometheusStatLogger``, so vLLM keeps its own Prometheus logger.
    """

    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
        self.engine_indexes = engine_indexes or [0]
        self.collector = install_collector()
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            logger.warning(
                "adaptive telemetry: PROMETHEUS_MULTIPROC_DIR is set (api_server_count > 1); "
                "vLLM's /metrics then serves only multiprocess metrics and the "
                "vllm_adaptive: families are not exported"
            )

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        self.collector.refresh()

    def log_engine_initialized(self) -> None:
        logger.info("adaptive telemetry: engine stats exchanged in %s", stats_dir())
