"""The plugin's environment variables, read in one place.

Their names carry no ``VLLM_`` prefix: vLLM warns "Unknown vLLM environment variable detected"
at every start for each ``VLLM_*`` variable it does not know, so a plugin variable with that
prefix would put noise in every server log. The old ``VLLM_ADAPTIVE_*`` names still work, with a
deprecation warning (and vLLM's own warning, which only renaming removes).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Collection
from pathlib import Path

logger = logging.getLogger("vllm.adaptive.environment")

#: Where prepared models, kernel dispatch tables and test artifacts live.
CACHE = "ADAPTIVE_CACHE"
#: ``on`` (default), ``off`` (no kernel measuring: each format's first kernel) or ``refresh``.
AUTOTUNE = "ADAPTIVE_AUTOTUNE"
_warned: set[str] = set()


def setting(name: str, default: str | None = None) -> str | None:
    """The variable ``name``, else its deprecated ``VLLM_``-prefixed name, else ``default``."""
    value = os.environ.get(name)
    if value is not None:
        return value
    old = "VLLM_" + name
    value = os.environ.get(old)
    if value is None:
        return default
    if old not in _warned:
        _warned.add(old)
        logger.warning("vllm-adaptive: %s is deprecated: name it %s", old, name)
    return value


def cache_root() -> Path:
    """$ADAPTIVE_CACHE, or ~/.cache/vllm-adaptive."""
    value = setting(CACHE)
    return Path(value) if value else Path.home() / ".cache" / "vllm-adaptive"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's ISA flags as /proc/cpuinfo spells them (Linux; empty elsewhere). Here, not in
    the kernels' modules, so that code which must not import vLLM (training) can read them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_model() -> str | None:
    """The CPU's model name as /proc/cpuinfo spells it (Linux; None elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return None


def native_bf16(flags: Collection[str]) -> bool:
    """Whether the CPU computes bf16 natively (stock's bf16 then beats its float32)."""
    return "avx512_bf16" in flags or "amx_bf16" in flags
