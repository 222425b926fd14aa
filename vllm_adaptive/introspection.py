"""What an engine is actually running, readable from outside the worker.

Pass these functions to `LLM.apply_model` (they are importable, so vLLM can
send them to the worker by reference).
"""

from __future__ import annotations

import os
from typing import Any


def describe_model(model: Any) -> dict[str, Any]:
    """Class of the loaded model and its adaptive config (None for stock)."""
    cls = type(model)
    adaptive = getattr(model, "adaptive_config", None)
    return {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "adaptive_config": adaptive.model_dump() if adaptive is not None else None,
    }


def gear_telemetry(model: Any) -> dict[str, Any] | None:
    """Per-request gear statistics and traces of a precision engine (None without one)."""
    controller = getattr(model, "precision", None)
    return controller.telemetry() if controller is not None else None


def depth_telemetry(model: Any) -> dict[str, Any] | None:
    """Engine exit statistics and per-request depth records of an adaptive-depth engine."""
    runtime = getattr(model, "depth", None)
    return runtime.telemetry() if runtime is not None else None


def worker_report(model: Any) -> dict[str, Any]:
    """Everything above for one worker, with its process id: a caller that fans out over
    several engines (Ray Serve replicas, where the router picks the engine) can then tell
    which engine answered."""
    return {
        "pid": os.getpid(),
        **describe_model(model),
        "gears": gear_telemetry(model),
        "depth": depth_telemetry(model),
    }


def kernel_dispatch(model: Any) -> dict[str, Any]:
    """The float-activation kernels this worker measured and picked per format, shape and
    token-count bucket, and the machine they were measured on (``kernels/autotune.py``)."""
    from vllm_adaptive.kernels import autotune

    return {"machine": autotune.cpu_info(), "dispatch": autotune.table().summary()}
