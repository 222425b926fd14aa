"""One entry point for every reduced-precision weight: build it from a float weight by precision
name, and multiply by it on the fastest kernel this machine has for it.

Mechanisms that run layers at another precision (geared linears, the Exit River, the low-bit
self-draft and its head) all go through here, so they share formats, kernels and the measured
dispatch:

- ``fp16`` / ``w8a8`` / ``w8a16``: :mod:`vllm_adaptive.kernels.float_linear`, the kernel per
  token count from :mod:`vllm_adaptive.kernels.autotune` (measured once per machine);
- ``int8`` / ``int4`` / ``int2``: :class:`~vllm_adaptive.kernels.packed.PackedWeight`, the path
  from :mod:`vllm_adaptive.kernels.matmul`.
"""

from __future__ import annotations

import warnings

import torch

from vllm_adaptive.kernels import autotune
from vllm_adaptive.kernels.float_linear import Fp16Weight, W8A8Weight, W8A16Weight
from vllm_adaptive.kernels.matmul import (
    bound_kernel,
    choose_path_cached,
    measured_candidates,
    use_measured_rules,
)
from vllm_adaptive.kernels.packed import DoubleQuantizationWarning, PackedWeight, quantize

Weight = PackedWeight | Fp16Weight | W8A8Weight | W8A16Weight
FLOAT_FORMATS = (Fp16Weight, W8A8Weight, W8A16Weight)
BITS = {"int8": 8, "int4": 4, "int2": 2}


def quantize_weight(
    w: torch.Tensor,
    precision: str,
    group_size: int | None = 32,
    symmetric: bool = True,
    smooth: torch.Tensor | None = None,
) -> Weight:
    """``w`` ``[N, K]`` at ``precision``; int8 is per-row symmetric (the packed kernel's layout),
    int4 / int2 use ``group_size`` and ``symmetric``; ``smooth`` applies to w8a8 only."""
    w32 = w.detach().to(torch.float32)
    if precision == "fp16":
        return Fp16Weight.from_float(w32)
    if precision == "w8a8":
        return W8A8Weight.from_float(w32, smooth)
    if precision == "w8a16":
        return W8A16Weight.from_float(w32)
    if precision not in BITS:
        raise ValueError(f"no reduced-precision format {precision!r}")
    bits = BITS[precision]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DoubleQuantizationWarning)
        if bits == 8:
            return quantize(w32, 8, None, check_double_quant=False)
        return quantize(w32, bits, group_size, symmetric=symmetric, check_double_quant=False)


def dispatch_key(precision: str, weight: Weight) -> str:
    n, k = weight.shape
    return f"{precision}:{n}x{k}"


def precision_of(weight: Weight) -> str:
    if isinstance(weight, Fp16Weight):
        return "fp16"
    if isinstance(weight, W8A8Weight):
        return "w8a8"
    if isinstance(weight, W8A16Weight):
        return "w8a16"
    return f"int{weight.bits}"


def autotune_weight(
    weight: Weight, max_tokens: int = autotune.BUCKETS[-1], dtype: torch.dtype = torch.float32
) -> None:
    """Measure a weight's kernels for ``dtype`` activations on this machine (once per format
    and shape): the float-activation formats' kernels, and packed weights' native kernel
    against the path it replaces where one exists (else :mod:`vllm_adaptive.kernels.matmul`'s
    static rules)."""
    table = autotune.table()
    if isinstance(weight, FLOAT_FORMATS):
        key = dispatch_key(precision_of(weight), weight)
        if not table.knows(key, weight.kernels()):
            kernels = {name: weight.bind(name) for name in weight.kernels()}
            table.ensure(key, kernels, weight.shape[1], max_tokens=max_tokens)
        weight.keep_only(table.chosen(key))
        return
    paths = measured_candidates(weight, dtype)
    if paths:
        n, k = weight.shape
        key = f"{weight.describe().replace(' ', '-')}:{n}x{k}"
        if dtype != torch.float32:  # each activation dtype has its own paths and timings
            key += f":{str(dtype).removeprefix('torch.')}"
        if not table.knows(key, paths):
            kernels = {p: bound_kernel(weight, p, dtype) for p in paths}
            table.ensure(key, kernels, k, dtype=dtype, max_tokens=max_tokens)
        best = table.measured_bests(key)
        if best:
            use_measured_rules(weight, dtype, best)


def kernel_name(weight: Weight, tokens: int, dtype: torch.dtype) -> str:
    """The kernel (or packed path) :func:`linear` runs for ``tokens`` rows."""
    if isinstance(weight, FLOAT_FORMATS):
        key = dispatch_key(precision_of(weight), weight)
        return autotune.table().choose(key, tokens, weight.kernels()[0])
    return choose_path_cached(weight, tokens, dtype)


HALF_DTYPES = (torch.bfloat16, torch.float16)
_NO_HALF = "none"  # ``prepared`` marker: this weight has no half-precision kernel here


def half_call(weight: Weight):
    """``x -> x @ W^T`` for bf16 / fp16 ``x`` without a float32 round trip (W8A8 / W8A16 on the
    AMX int8 GEMM), bound once per weight; None where none runs (the float32 kernels then)."""
    if not isinstance(weight, (W8A8Weight, W8A16Weight)):
        return None
    fn = weight.prepared.get(("half", "call"))
    if fn is None:
        fn = weight.amx_call() or _NO_HALF
        weight.prepared[("half", "call")] = fn
    return None if fn is _NO_HALF else fn


def linear(weight: Weight, x: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` for 2-D ``x``, in x's dtype (float-activation formats compute in float32,
    except W8A8 / W8A16 on half-precision activations where AMX runs them: :func:`half_call`)."""
    if x.shape[0] == 0:
        return x.new_empty(0, weight.shape[0])
    xc = x if x.is_contiguous() else x.contiguous()
    if isinstance(weight, FLOAT_FORMATS):
        if x.dtype in HALF_DTYPES:
            fn = half_call(weight)
            if fn is not None:
                return fn(xc)
        m = x.shape[0]
        fn = weight.prepared.get(("tokens", m))  # hot path: one dict lookup per call
        if fn is None:
            name = kernel_name(weight, m, x.dtype)
            fn = weight.prepared.get(("bound", name))
            if fn is None:
                fn = weight.prepared[("bound", name)] = weight.bind(name)
            weight.prepared[("tokens", m)] = fn
        y = fn(xc if xc.dtype == torch.float32 else xc.float())
        return y if y.dtype == x.dtype else y.to(x.dtype)
    path = choose_path_cached(weight, x.shape[0], x.dtype)
    return bound_kernel(weight, path, x.dtype)(xc)
