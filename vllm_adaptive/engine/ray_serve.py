"""Ray Serve LLM glue: give each replica's vLLM CPU worker its own cores.

Ray Serve LLM (``ray.serve.llm``) runs one vLLM ``AsyncLLM`` per replica, and
every replica of a deployment gets the same ``runtime_env``. On a CPU node
vLLM's ``VLLM_CPU_OMP_THREADS_BIND=auto`` then pins every replica's worker to
the same cores (it knows nothing of its neighbours). :class:`ReplicaCpuBinding`
is a Ray Serve LLM callback (``LLMConfig.callback_config``) that runs in the
replica before its engine starts and binds the worker to a slice of the cores
this process may use, chosen by the replica's rank on its node:

.. code-block:: yaml

    callback_config:
      callback_class: vllm_adaptive.engine.ray_serve:ReplicaCpuBinding
      callback_kwargs: {cpus_per_replica: 1}

It only sets ``VLLM_CPU_OMP_THREADS_BIND`` (vLLM's own variable, read by
``vllm/utils/ompmultiprocessing.py`` when the worker is spawned); it leaves an
explicit value alone and does nothing on non-CPU platforms. Importing this
module needs Ray (the ``ray`` extra); the plugin itself never imports it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ray.llm._internal.common.callbacks.base import CallbackBase

# Under "vllm", so vLLM's handlers (configured when the replica imports vllm) show it.
logger = logging.getLogger("vllm.adaptive.ray_serve")

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def replica_cpus(available: list[int], local_rank: int, cpus_per_replica: int) -> list[int]:
    """The cores of replica ``local_rank``: consecutive slices of ``available``, wrapping
    around when there are more replicas than slices (then replicas share cores)."""
    if cpus_per_replica < 1:
        raise ValueError(f"cpus_per_replica must be >= 1 (got {cpus_per_replica})")
    if not available:
        raise ValueError("no CPUs available to bind")
    cpus = sorted(available)
    slices = max(1, len(cpus) // cpus_per_replica)
    start = (local_rank % slices) * cpus_per_replica
    return cpus[start : start + cpus_per_replica] or cpus[:cpus_per_replica]


class ReplicaCpuBinding(CallbackBase):
    """Ray Serve LLM callback: pin this replica's vLLM CPU worker to its own cores."""

    def __init__(self, *args: Any, cpus_per_replica: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cpus_per_replica = int(cpus_per_replica)

    async def on_before_node_init(self) -> None:
        if os.environ.get(BIND_ENV, "auto") != "auto":
            logger.info("vllm-adaptive: %s=%s set explicitly", BIND_ENV, os.environ[BIND_ENV])
            return
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        from ray import serve

        rank = serve.get_replica_context().rank.local_rank
        cpus = replica_cpus(sorted(os.sched_getaffinity(0)), rank, self.cpus_per_replica)
        os.environ[BIND_ENV] = ",".join(str(c) for c in cpus)
        logger.info(
            "vllm-adaptive: replica local rank %d binds its vLLM worker to CPUs %s",
            rank,
            os.environ[BIND_ENV],
        )
