"""Packed weight formats and the matmul entry point for entropy-routed precision.

- :mod:`vllm_adaptive.kernels.packed`: :class:`PackedWeight` (int8 / int4 / int2 codes with
  per-row or group-wise scales, symmetric or asymmetric), exact bit packing, quantizers, the
  double-quantization check.
- :mod:`vllm_adaptive.kernels.matryoshka`: one int8 tensor from which the int4 and int2 tiers
  are read as its most significant bits.
- :mod:`vllm_adaptive.kernels.matmul`: ``matmul(x, packed)``, dispatching on a table measured
  on this project's CPU (see ``docs/packed-kernels.md``); other devices dequantize and matmul.
  Import it from the submodule (``from vllm_adaptive.kernels.matmul import matmul``): the
  package does not re-export the function, so that ``vllm_adaptive.kernels.matmul`` stays the
  module.
"""

from vllm_adaptive.kernels.matryoshka import MatryoshkaWeight, matryoshka_quantize
from vllm_adaptive.kernels.packed import (
    DoubleQuantizationWarning,
    PackedWeight,
    dequantize,
    quantize,
)

__all__ = [
    "DoubleQuantizationWarning",
    "MatryoshkaWeight",
    "PackedWeight",
    "dequantize",
    "matryoshka_quantize",
    "quantize",
]
