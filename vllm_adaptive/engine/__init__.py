"""The engine glue: the only package whose modules import vLLM.

Everything here exists to plug the plugin into vLLM. The rest of the glue (the models, the
attention backend, the bench) gets vLLM's names only through
:mod:`~vllm_adaptive.engine.vllm_api`; the algorithms (``depth/``, ``precision/``, ``moe/``,
``kernels/``, ``m2r2/``) import nothing of this package: what they need of vLLM comes in as
arguments or through the ports implemented here (``CpuStepAttention``, ``kernel_ops``). Both
rules are checked by ``tests/unit/test_import_graph.py``.

- ``plugin``: the ``vllm.general_plugins`` entry point (every vLLM process): applies the
  intrusions vLLM needs before it builds engines and its HTTP app.
- ``intrusions``: every change to vLLM's own objects, one registry entry each (what it
  replaces, the vLLM versions it was written for, when it is applied), applied once and logged.
- ``vllm_api``: every vLLM name the rest of the package uses, with the modules that use it.
- ``request_validator``: the logits processor the general plugin adds (intrusion
  ``request-validator``; not an entry point, so that ``VLLM_PLUGINS=""`` is stock): overrides
  checked at admission (HTTP 400), and the per-step batch hook.
- ``attention_metadata``: the only reader of vLLM's forward context, and `CpuStepAttention`,
  what the depth runtime asks of the engine's attention.
- ``kernel_ops``: vLLM's CPU ops handed to the plugin's kernels.
- ``metrics``: the ``vllm.stat_logger_plugins`` entry point (``vllm_adaptive:*`` on /metrics).
- ``routes``: the ``vllm.endpoint_plugins`` entry point (``GET /v1/adaptive/requests/{tag}``).
- ``ray_serve``: the Ray Serve LLM callback that gives each replica's CPU worker its cores.

Importing this package imports nothing of vLLM.
"""
