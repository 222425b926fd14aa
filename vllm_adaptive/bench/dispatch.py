"""Which kernels an engine's linears actually run, read from inside its worker.

A speed figure means little without the kernel behind it (a W8A8 checkpoint that silently
dequantizes, an fp16 path that fell back to float32). Two readings, both through
`LLM.apply_model` (importable functions, sent by reference):

- ``kernel_dispatch``: the model's own dispatch table, when the model exposes one as a
  ``kernel_dispatch()`` method (the plugin's kernels fill it in; None for stock vLLM);
- ``linear_methods``: for every linear layer of any model, the class of its quant method,
  scheme and kernel, counted (e.g. ``UnquantizedLinearMethod``, or
  ``CompressedTensorsLinearMethod/CompressedTensorsW8A8Int8/CPUInt8ScaledMMLinearKernel:
  _apply_weights_onednn`` for vLLM's int8 CPU path).
"""

from __future__ import annotations

import sys
from typing import Any


def kernel_dispatch(model: Any) -> Any:
    """The model's kernel dispatch table (JSON-able), or None if it exposes none."""
    for obj in (model, getattr(model, "model", None)):
        fn = getattr(obj, "kernel_dispatch", None)
        if callable(fn):
            return fn()
    return None


def _describe_linear(module: Any) -> str | None:
    method = getattr(module, "quant_method", None)
    if method is None or not hasattr(module, "input_size"):
        return None
    parts = [type(method).__name__]
    scheme = getattr(module, "scheme", None)
    if scheme is not None:
        parts.append(type(scheme).__name__)
        kernel = getattr(scheme, "kernel", None)
        if kernel is not None:
            name = type(kernel).__name__
            fn = getattr(kernel, "linear_method", None)
            parts.append(f"{name}:{fn.__name__}" if hasattr(fn, "__name__") else name)
    return "/".join(parts)


def linear_methods(model: Any) -> dict[str, int]:
    """How many linear layers run each (quant method / scheme / kernel) combination."""
    counts: dict[str, int] = {}
    for _, module in model.named_modules():
        desc = _describe_linear(module)
        if desc is not None:
            counts[desc] = counts.get(desc, 0) + 1
    return counts


def collect_dispatch(llm: Any) -> dict[str, Any]:
    """``{"dispatch": table or None, "linear_methods": counts}`` of a running engine (first
    worker); a failed reading is logged and recorded, never fatal."""
    out: dict[str, Any] = {"dispatch": None, "linear_methods": None}
    for key, fn in (("dispatch", kernel_dispatch), ("linear_methods", linear_methods)):
        try:
            out[key] = llm.apply_model(fn)[0]
        except Exception as e:  # noqa: BLE001 - a reading, not a measurement
            print(f"[bench]   warning: {key} not readable ({e})", file=sys.stderr, flush=True)
            out[key] = {"error": f"{type(e).__name__}: {e}"}
    return out
