"""vLLM general-plugin entry point (`vllm.general_plugins`).

vLLM calls `register()` in every process it starts, possibly more than once
per process, so registration is idempotent. In the frontend it runs before the
engine and worker processes are spawned, so the telemetry exchange directory
it ensures (`$ADAPTIVE_STATS_DIR`) is inherited by all of them.

It hands vLLM's CPU ops to the plugin's kernels (`kernel_ops.provide`, loaded at first use),
and applies the plugin's changes to vLLM that must be in place before vLLM builds its
engines and its HTTP app (the model classes, the per-request checks): the entries of
:mod:`vllm_adaptive.engine.intrusions` applied at registration. In vLLM's engine and worker
processes it starts the orphan watch (:mod:`vllm_adaptive.engine.lifetime`): they end with the
process that started them.
"""

from __future__ import annotations


def register() -> None:
    from vllm_adaptive.engine.lifetime import die_with_parent

    die_with_parent()

    from vllm_adaptive.telemetry_exchange import ensure_stats_dir

    ensure_stats_dir()

    from vllm_adaptive.engine.kernel_ops import provide

    provide()  # the plugin's kernels call vLLM's CPU ops (loaded at first use)

    from vllm_adaptive.engine.intrusions import apply_at_register

    apply_at_register()
