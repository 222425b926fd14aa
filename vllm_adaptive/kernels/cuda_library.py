"""The field's low-bit GEMM kernels for :class:`PackedWeight` on CUDA GPUs, behind one registry.

- ``tinygemm``: torch's built-in int4 kernel (``aten._weight_int4pack_mm``, from gpt-fast and
  torchao). It computes ``(q - 8) * scale + zero`` per group of 32 / 64 / 128 / 256 inputs with
  bf16 activations, which covers int4 and int2 codes (int2 codes are int4 codes in [-2, 1]),
  symmetric and asymmetric, per-row (the scale repeated over the largest group dividing K) or
  group-wise.
- ``gemlite``: GemLite's Triton kernels (PyPI ``gemlite``, the ``[gpu]`` extra; used by vLLM
  through HQQ, by torchao and SGLang): int8 per-row weights (``A16W8``) and group-wise int8 / int4
  / int2 (``A16Wn``, ``W = (q - z) * s``), fp16 / bf16 activations.

Each entry says whether it can run a weight (``supports``: None, or why not) and builds a
function ``x -> x @ W^T`` with every layout prepared ahead (``build``): the function only
launches the kernel, so it can be captured in a CUDA graph. A production kernel such as vLLM's
Marlin or Machete (in the CUDA vLLM wheel) is one more :class:`CudaKernel` registered here; the
dispatch table in :mod:`vllm_adaptive.kernels.matmul` names kernels, not code.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_adaptive.kernels import int4pack_layout
from vllm_adaptive.kernels.packed import PackedWeight

TINYGEMM = "tinygemm"
GEMLITE = "gemlite"

TINYGEMM_GROUPS = int4pack_layout.GROUPS  # what aten._weight_int4pack_mm accepts
TINYGEMM_INNER_K_TILES = (8, 4, 2)
GEMLITE_GROUPS = (32, 64, 128, 256)

Kernel = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class CudaKernel:
    name: str
    #: whether the library is importable on this machine (checked once, cheaply)
    installed: Callable[[], bool]
    #: None when the kernel computes this weight with this activation dtype; else the reason
    supports: Callable[[PackedWeight, torch.dtype], str | None]
    #: ``x -> x @ W^T`` for 2-D contiguous ``x`` of the dtype, layouts prepared once
    build: Callable[[PackedWeight, torch.dtype], Kernel]


# ---------------------------------------------------------------------------------------------
# tinygemm (torch)
# ---------------------------------------------------------------------------------------------


def _tinygemm_inner_k_tiles(k: int) -> int | None:
    return next((t for t in TINYGEMM_INNER_K_TILES if k % (t * 16) == 0), None)


def _tinygemm_supports(packed: PackedWeight, dtype: torch.dtype) -> str | None:
    n, k = packed.shape
    if dtype != torch.bfloat16:
        return f"tinygemm takes bf16 activations, not {dtype}"
    if packed.bits not in (4, 2):
        return f"tinygemm reads 4-bit codes, not {packed.bits}-bit"
    if n % 8:
        return f"tinygemm needs N % 8 == 0 (N={n})"
    if _tinygemm_inner_k_tiles(k) is None:
        return f"tinygemm needs K % 32 == 0 (K={k})"
    if int4pack_layout.kernel_group(packed) is None:
        return f"tinygemm groups are {TINYGEMM_GROUPS}, not {packed.group_size}"
    return None


def _tinygemm_layout(packed: PackedWeight) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(packed int4 weight, group, [K/g, N, 2] bf16 scale-and-zero)."""
    n, k = packed.shape
    g = int4pack_layout.kernel_group(packed)
    q = (packed.codes().to(torch.int32) + 8).to(torch.uint8)  # (q - 8) is the signed code
    nibbles = (q[:, ::2] << 4 | q[:, 1::2]).contiguous()  # element 2j in the high nibble
    weight = torch.ops.aten._convert_weight_to_int4pack(nibbles, _tinygemm_inner_k_tiles(k))
    return weight, g, int4pack_layout.scale_zeros(packed, g, torch.bfloat16)


def _tinygemm_build(packed: PackedWeight, dtype: torch.dtype) -> Kernel:
    op = torch.ops.aten._weight_int4pack_mm
    weight, g, scale_zeros = _tinygemm_layout(packed)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return op(x, weight, g, scale_zeros)

    return fn


# ---------------------------------------------------------------------------------------------
# GemLite
# ---------------------------------------------------------------------------------------------


def _gemlite_installed() -> bool:
    return importlib.util.find_spec("gemlite") is not None


def _gemlite_supports(packed: PackedWeight, dtype: torch.dtype) -> str | None:
    n, k = packed.shape
    if dtype not in (torch.float16, torch.bfloat16):
        return f"GemLite takes fp16 / bf16 activations, not {dtype}"
    if packed.group_size is None:
        if packed.bits == 8 and packed.symmetric:
            return None
        return "GemLite's per-row weights are symmetric int8; others need a group"
    if packed.group_size not in GEMLITE_GROUPS:
        return f"GemLite groups here are {GEMLITE_GROUPS}, not {packed.group_size}"
    if k % 128 or n % 16:
        return f"GemLite needs K % 128 == 0 and N % 16 == 0 (K={k}, N={n})"
    return None


def _gemlite_build(packed: PackedWeight, dtype: torch.dtype) -> Kernel:
    import gemlite
    from gemlite import helper

    # GemLite's split-K kernels add partial sums atomically in the output dtype where the GPU
    # can (bf16 on Hopper): one token's int4 output then carried a 3.5% max error on an H100.
    # Off, they add in float32 and cast once.
    gemlite.set_native_atomic_bfp16(False)

    device = str(packed.device)
    if packed.group_size is None:  # int8 per-row, symmetric
        layer = helper.A16W8(device=device, dtype=dtype).from_weights(
            weight=packed.codes().to(torch.int8), scales=packed.scales[:, :1].to(dtype)
        )
        return layer
    mid = 2 ** (packed.bits - 1)
    q = (packed.codes().to(torch.int32) + mid).to(torch.uint8)
    scales = packed.scales.to(torch.float32)
    if packed.offsets is None:
        zeros = torch.full_like(scales, float(mid))
    else:  # c * s + o == (q - z) * s with q = c + mid, z = mid - o / s
        zeros = mid - packed.offsets.float() / scales
    layer = helper.A16Wn(device=device, dtype=dtype).from_weights(
        q, scales.to(dtype), zeros.to(dtype), packed.bits, packed.group_size
    )
    return layer


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

KERNELS: dict[str, CudaKernel] = {
    TINYGEMM: CudaKernel(TINYGEMM, lambda: True, _tinygemm_supports, _tinygemm_build),
    GEMLITE: CudaKernel(GEMLITE, _gemlite_installed, _gemlite_supports, _gemlite_build),
}

_installed: dict[str, bool] = {}


def installed(name: str) -> bool:
    """Whether kernel ``name``'s library is importable here (cached)."""
    got = _installed.get(name)
    if got is None:
        got = _installed[name] = KERNELS[name].installed()
    return got


def runnable(name: str, packed: PackedWeight, dtype: torch.dtype) -> bool:
    """Whether kernel ``name`` is installed and computes ``packed`` with ``dtype`` activations."""
    return installed(name) and KERNELS[name].supports(packed, dtype) is None


def kernel(name: str, packed: PackedWeight, dtype: torch.dtype) -> Kernel:
    """The prepared kernel, cached on the weight (released with it)."""
    key = ("cuda-kernel", name, dtype)
    fn = packed.prepared.get(key)
    if fn is None:
        why = KERNELS[name].supports(packed, dtype)
        if why is not None:
            raise ValueError(f"{name} cannot run {packed.describe()}: {why}")
        fn = packed.prepared[key] = KERNELS[name].build(packed, dtype)
    return fn
