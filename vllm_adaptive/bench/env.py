"""What machine a figure was measured on: CPU model, ISA flags, cores, OS (no vLLM, no torch).

Timings on these CPUs depend on the ISA (AVX512-BF16 or AVX2 only, see shared/BRIEF.md), so
every bench JSON records the flags next to its figures.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

#: flags that decide which kernels a CPU can run fast (the full list is recorded too)
KEY_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16")


def cpu_info() -> dict[str, Any]:
    """``{"model", "flags", "key_flags", "cores", "machine", "system"}``; never raises."""
    model, flags = None, []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if model is None and line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif not flags and line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
            if model is not None and flags:
                break
    except OSError:
        pass
    if model is None and platform.system() == "Darwin":
        try:
            model = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return {
        "model": model or platform.processor() or None,
        "key_flags": [f for f in KEY_FLAGS if f in flags],
        "flags": flags,
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        "system": f"{platform.system()} {platform.release()}",
    }


def versions(*dists: str) -> dict[str, str | None]:
    """Installed version of each distribution (None when absent)."""
    out: dict[str, str | None] = {}
    for d in dists:
        try:
            out[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            out[d] = None
    return out
