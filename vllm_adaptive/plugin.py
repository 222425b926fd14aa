"""vLLM general-plugin entry point (`vllm.general_plugins`).

vLLM calls `register()` in every process it starts, possibly more than once
per process, so registration is idempotent. In the frontend it runs before the
engine and worker processes are spawned, so the telemetry exchange directory
it ensures (`$ADAPTIVE_STATS_DIR`) is inherited by all of them.

It also applies the plugin's runtime replacements of vLLM functions
(:mod:`vllm_adaptive.vllm_patches`: the per-request checks that need the engine's config or
must run before a streaming response starts), in every process, before vLLM builds its
engines and its HTTP app.
"""

from __future__ import annotations


def register() -> None:
    from vllm_adaptive.telemetry_exchange import ensure_stats_dir

    ensure_stats_dir()

    from vllm_adaptive.vllm_patches import apply_vllm_patches

    apply_vllm_patches()

    from vllm import ModelRegistry

    from vllm_adaptive.models import ADAPTIVE_ARCHITECTURES

    for arch in ADAPTIVE_ARCHITECTURES:
        for name, target in ((arch.adaptive, arch.adaptive_cls), (arch.stock, arch.dispatch_cls)):
            current = ModelRegistry.models.get(name)
            module, _, cls = target.partition(":")
            if (
                getattr(current, "module_name", None) == module
                and getattr(current, "class_name", None) == cls
            ):
                continue
            ModelRegistry.register_model(name, target)
