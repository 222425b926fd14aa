"""Hands vLLM's CPU ops to the plugin's kernels (`kernels/library.py`), which import nothing
of vLLM themselves. `plugin.register` calls `provide` in every vLLM process; tools and tests
that run kernels without an engine call it first."""

from __future__ import annotations

from vllm_adaptive.kernels import library


def _load() -> library.VllmCpuOps | None:
    try:
        from vllm_adaptive.engine.vllm_api import custom_ops
    except Exception:  # noqa: BLE001 - no vLLM, or a build without CPU ops
        return None
    return library.VllmCpuOps(custom_ops=custom_ops)


def provide() -> None:
    """Let the kernels load vLLM's CPU ops when they first need them."""
    library.provide(_load)
