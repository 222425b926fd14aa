"""vLLM's CPU ops as the plugin's kernels call them (oneDNN's GEMMs, the AMX int8 GEMM, the AMX
weight packing), handed to `kernels/` by the engine glue so that kernels import nothing of
vLLM.

vLLM runs the plugin's `register()` in every process it starts; it provides a loader here
(`engine/kernel_ops.provide`), resolved at the first kernel that asks, so registering costs
nothing. Tools and tests that run kernels without an engine call the same ``provide()`` first.
Where nothing was provided (no vLLM on the machine), the kernels that need vLLM's ops are not
offered and dispatch measures the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VllmCpuOps:
    #: ``vllm._custom_ops`` (importing it registers ``torch.ops._C``): oneDNN GEMM handles and
    #: calls, the AMX packed linear, the CPU attention ops
    custom_ops: Any


_loader: Callable[[], VllmCpuOps | None] | None = None
_ops: VllmCpuOps | None = None


def provide(loader: Callable[[], VllmCpuOps | None]) -> None:
    """Where the kernels get vLLM's ops from (called again: the newer loader wins)."""
    global _loader, _ops
    _loader, _ops = loader, None


def vllm_ops() -> VllmCpuOps | None:
    """vLLM's CPU ops; None when none were provided or they cannot load here."""
    global _ops
    if _ops is None and _loader is not None:
        _ops = _loader()
    return _ops
