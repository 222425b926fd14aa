"""Packed weight formats and the matmul entry point for entropy-routed precision.

- :mod:`vllm_adaptive.kernels.packed`: :class:`PackedWeight` (int8 / int4 / int2 codes with
  per-row or group-wise scales, symmetric or asymmetric), exact bit packing, quantizers, the
  double-quantization check.
- :mod:`vllm_adaptive.kernels.matryoshka`: one int8 tensor from which the int4 and int2 tiers
  are read as its most significant bits.
- :mod:`vllm_adaptive.kernels.planes`: the same int8 codes as three bit planes (bits 7-6, 5-4,
  3-0), so a tier reads only its own bytes (0.25 / 0.5 / 1 byte per parameter).
- :mod:`vllm_adaptive.kernels.triton_packed`: Triton kernels reading packed weights and plane
  tiers directly (imported on demand; ``TRITON_AVAILABLE`` says whether triton is there).
- :mod:`vllm_adaptive.kernels.matmul`: ``matmul(x, packed)``, dispatching on a table measured
  on this project's CPU (see ``docs/packed-kernels.md``); CUDA devices use the Triton kernel when
  triton is installed, other devices dequantize and matmul.
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
from vllm_adaptive.kernels.planes import MatryoshkaPlanes, to_planes

__all__ = [
    "DoubleQuantizationWarning",
    "MatryoshkaPlanes",
    "MatryoshkaWeight",
    "PackedWeight",
    "dequantize",
    "matryoshka_quantize",
    "quantize",
    "to_planes",
]
