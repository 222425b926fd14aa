"""M2R2 (Mixture of Multi-rate Residuals): accelerator adapters, the ARLA exit router and
their training (pure torch + transformers; no vLLM here).

- `adapters.M2R2Adapters` / `AdapterConfig` / `AdapterError`: the adapters and their files;
- `arla.ARLA`: the exit router of exit mode;
- `reference`: the slow and accelerated streams in plain torch (training and the reference the
  inference side is checked against);
- `train`: the `vllm-adaptive train m2r2` command (`args`: its torch-free argument parser).

The names below are imported lazily so that `vllm_adaptive.m2r2.args` stays torch-free.
"""

from __future__ import annotations

__all__ = ["ARLA", "AdapterConfig", "AdapterError", "M2R2Adapters"]


def __getattr__(name: str):
    if name in ("AdapterConfig", "AdapterError", "M2R2Adapters"):
        from vllm_adaptive.m2r2 import adapters

        return getattr(adapters, name)
    if name == "ARLA":
        from vllm_adaptive.m2r2.arla import ARLA

        return ARLA
    raise AttributeError(name)
