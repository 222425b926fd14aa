"""Triton kernels: ``y = x @ W^T`` straight from packed storage, fp32 accumulation.

One kernel, specialised at compile time on the weight format:

- :class:`PackedWeight` int8 / int4 / int2 (``packed.py`` storage: int8 codes; two int4 codes
  per byte, offset +8, element ``2j`` in the low nibble; four int2 codes per byte, offset +2,
  element ``4j+i`` in bits ``2i..2i+1``), symmetric or asymmetric, per-row or group-wise;
- :class:`MatryoshkaPlanes` tiers 2 / 4 / 8 (``planes.py``): tier 2 loads plane A only, tier 4
  planes A and B, tier 8 all three, so a tier reads 0.25 / 0.5 / 1 byte per parameter. A tier is
  computed as ``s * (2**(8-r) c_r + 2**(7-r))``: the integer bin-centre code (in [-120, 120])
  times the int8 scale, no offset term.

No dequantized copy of W is ever materialised: each program loads a ``[BLOCK_K, BLOCK_N]`` tile
of packed bytes (the byte holding element k is at ``k // per_byte``; neighbouring k share a byte,
so the repeated addresses should coalesce or hit L1 and DRAM read each packed byte once: simple,
not yet tuned or measured on a GPU), decodes it in registers with shifts and masks, and feeds
``tl.dot`` with an fp32 accumulator.

Scales and offsets are applied in one of two ways, chosen per launch:

- *block scales* (per-row weights, or ``group_size % BLOCK_K == 0``): every K block lies in one
  group, so the integer codes go into the dot unscaled (exact in fp16 / bf16: |code| <= 128) and
  the block's partial sum is scaled once per output column,
  ``acc += dot(x, c) * s[n] (+ rowsum(x) * o[n])``. The scale (and offset) of group
  ``k0 // group`` is one ``[BLOCK_N]`` vector load per K block.
- *element scales* (any other group size dividing K, e.g. 8 or 48): the scale and offset of each
  element are gathered (``scales[n, k // group]``, cached after the first touch), the tile is
  dequantised in registers, ``w = c * s (+ o)``, cast to x's dtype and multiplied.

The default block sizes (:func:`default_config`) lower ``BLOCK_K`` to the group size when the group
is a power of two of at least 16 smaller than ``BLOCK_K``, so every power-of-two group from 16 up
(g32, g64, g128, ...) takes the block-scale path.

Configurations (:func:`default_config`; ``config=`` overrides, e.g. for sweeps):

- decode, ``M <= 16``: ``BLOCK_M=16`` (the smallest ``tl.dot`` tile), ``BLOCK_N=64``,
  ``BLOCK_K=128``, plus split-K: the K blocks are divided over up to 16 programs per output tile
  so that small matrices still occupy about two programs per SM; partial sums are
  ``atomic_add``-ed into a zeroed fp32 buffer (so the summation order, and the last bits of the
  result, vary from run to run) and cast to x's dtype.
- GEMM, ``M > 16``: ``BLOCK_M=32`` (M <= 32) or 64, ``BLOCK_N=64``, ``BLOCK_K=64``, split-K only
  while there are fewer output tiles than SMs.

fp32 activations run the dot with ``input_precision="ieee"`` (no TF32). The kernels run under
Triton's CPU interpreter (``TRITON_INTERPRET=1`` set before triton is imported) for the tests;
there the bf16 dot and int -> bf16 casts are wrong in Triton 3.9, so the kernel upcasts bf16
operands to fp32 (exact) before the dot when interpreted and always converts codes through fp32.

The module imports without triton (``TRITON_AVAILABLE`` is then False and the entry points
raise ``RuntimeError``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_adaptive.kernels.packed import PackedWeight
from vllm_adaptive.kernels.planes import MatryoshkaPlanes

try:  # guarded: the package must import where triton is absent (CPU-only installs)
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except Exception:  # ImportError, or a triton that fails to initialise
    triton = None
    tl = None
    TRITON_AVAILABLE = False

# Weight formats (the kernel's FMT constexpr).
FMT_INT8 = 0
FMT_INT4 = 1
FMT_INT2 = 2
FMT_PLANES2 = 3
FMT_PLANES4 = 4
FMT_PLANES8 = 5
_PACKED_FMT = {8: FMT_INT8, 4: FMT_INT4, 2: FMT_INT2}
_PLANES_FMT = {2: FMT_PLANES2, 4: FMT_PLANES4, 8: FMT_PLANES8}

ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DECODE_MAX_M = 16
MAX_SPLIT_K = 16


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters. ``element_scales=True`` forces the per-element scale path."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    element_scales: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot), got {v}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: small, so that the default configs exercise split-K too


def default_config(
    m: int, n: int, k: int, group_len: int, per_row: bool, device: torch.device | str = "cuda"
) -> KernelConfig:
    """Block sizes for an ``[m, k] x [k, n]`` product (see the module doc)."""
    device = torch.device(device)
    if m <= DECODE_MAX_M:
        bm, bn, bk, warps, stages = 16, 64, 128, 4, 3
    else:
        bm, bn, bk, warps, stages = (32 if m <= 32 else 64), 64, 64, 4, 3
    if not per_row and group_len % bk and 16 <= group_len < bk and group_len & (group_len - 1) == 0:
        bk = group_len  # one group per K block: the block-scale path
    tiles = _cdiv(m, bm) * _cdiv(n, bn)
    sms = _sm_count(device)
    target = 2 * sms if m <= DECODE_MAX_M else sms
    split = 1
    if tiles < target:
        split = max(1, min(MAX_SPLIT_K, _cdiv(k, bk), target // tiles))
    return KernelConfig(bm, bn, bk, split, warps, stages)


if TRITON_AVAILABLE:

    @triton.jit
    def _load_codes(w0, w1, w2, sw0, sw1, sw2, k, n, mask, FMT: tl.constexpr):
        """Integer codes (int32) of the ``[BLOCK_K, BLOCK_N]`` tile at (k, n)."""
        if FMT == 0:  # int8, one per byte
            c = tl.load(w0 + n * sw0 + k, mask=mask, other=0).to(tl.int32)
        elif FMT == 1:  # int4, 2 per byte, offset 8, element 2j in the low nibble
            byte = tl.load(w0 + n * sw0 + (k >> 1), mask=mask, other=0).to(tl.int32)
            c = ((byte >> ((k & 1) * 4)) & 15) - 8
        elif FMT == 2:  # int2, 4 per byte, offset 2, element 4j+i in bits 2i..2i+1
            byte = tl.load(w0 + n * sw0 + (k >> 2), mask=mask, other=0).to(tl.int32)
            c = ((byte >> ((k & 3) * 2)) & 3) - 2
        else:  # Matryoshka planes: bin-centre code 2**(8-r) c_r + 2**(7-r), r = tier
            a = tl.load(w0 + n * sw0 + (k >> 2), mask=mask, other=0).to(tl.int32)
            c2 = ((a >> ((k & 3) * 2)) & 3) - 2
            if FMT == 3:
                c = c2 * 64 + 32
            else:
                b = tl.load(w1 + n * sw1 + (k >> 2), mask=mask, other=0).to(tl.int32)
                c4 = c2 * 4 + ((b >> ((k & 3) * 2)) & 3)
                if FMT == 4:
                    c = c4 * 16 + 8
                else:
                    lo = tl.load(w2 + n * sw2 + (k >> 1), mask=mask, other=0).to(tl.int32)
                    c = c4 * 16 + ((lo >> ((k & 1) * 4)) & 15)
        return c

    @triton.jit
    def _packed_mm_kernel(
        x_ptr,
        w0_ptr,
        w1_ptr,
        w2_ptr,
        s_ptr,
        o_ptr,
        y_ptr,
        M,
        N,
        K,
        G,
        BLOCKS_PER_SPLIT,
        stride_xm,
        stride_w0,
        stride_w1,
        stride_w2,
        stride_s,
        stride_ym,
        FMT: tl.constexpr,
        HAS_OFFSET: tl.constexpr,
        BLOCK_SCALES: tl.constexpr,
        UPCAST: tl.constexpr,
        SPLIT_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        n64 = offs_n.to(tl.int64)
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        kb_start = pid_k * BLOCKS_PER_SPLIT
        kb_end = tl.minimum(kb_start + BLOCKS_PER_SPLIT, tl.cdiv(K, BLOCK_K))
        for kb in range(kb_start, kb_end):
            k0 = kb * BLOCK_K
            offs_k = k0 + rk
            k_mask = offs_k < K
            x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w_mask = k_mask[:, None] & n_mask[None, :]
            c = _load_codes(
                w0_ptr,
                w1_ptr,
                w2_ptr,
                stride_w0,
                stride_w1,
                stride_w2,
                offs_k[:, None],
                n64[None, :],
                w_mask,
                FMT,
            )
            if BLOCK_SCALES:
                grp = k0 // G
                s = tl.load(s_ptr + n64 * stride_s + grp, mask=n_mask, other=0.0).to(tl.float32)
                if UPCAST:
                    part = tl.dot(x.to(tl.float32), c.to(tl.float32), input_precision="ieee")
                else:
                    part = tl.dot(x, c.to(tl.float32).to(x.dtype))
                acc += part * s[None, :]
                if HAS_OFFSET:
                    o = tl.load(o_ptr + n64 * stride_s + grp, mask=n_mask, other=0.0)
                    xs = tl.sum(x.to(tl.float32), axis=1)
                    acc += xs[:, None] * o.to(tl.float32)[None, :]
            else:
                sidx = n64[None, :] * stride_s + (offs_k // G)[:, None]
                w = c.to(tl.float32) * tl.load(s_ptr + sidx, mask=w_mask, other=0.0).to(tl.float32)
                if HAS_OFFSET:
                    w += tl.load(o_ptr + sidx, mask=w_mask, other=0.0).to(tl.float32)
                if UPCAST:
                    acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
                else:
                    acc = tl.dot(x, w.to(x.dtype), acc)
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        y_mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
        else:
            tl.atomic_add(y_ptrs, acc, mask=y_mask)

    INTERPRETED = type(_packed_mm_kernel).__name__ == "InterpretedFunction"
else:
    INTERPRETED = False


def _check_runnable(x: torch.Tensor, k: int) -> None:
    if not TRITON_AVAILABLE:
        raise RuntimeError("triton is not installed: the Triton kernels cannot run")
    if x.device.type != "cuda" and not (INTERPRETED and x.device.type == "cpu"):
        raise RuntimeError(
            f"the Triton kernels need a CUDA tensor (or CPU tensors with TRITON_INTERPRET=1 set "
            f"before triton is imported); x is on {x.device}"
        )
    if x.dtype not in ACT_DTYPES:
        raise ValueError(f"x must be one of {ACT_DTYPES}, got {x.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects K={k}")


def _launch(
    x: torch.Tensor,
    fmt: int,
    planes: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    shape: tuple[int, int],
    group_size: int | None,
    config: KernelConfig | None,
) -> torch.Tensor:
    n, k = shape
    _check_runnable(x, k)
    for t in (*planes, scales):
        if t.device != x.device:
            raise ValueError(f"x is on {x.device}, the weight on {t.device}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_zeros(*lead, n)
    per_row = group_size is None
    g = k if per_row else group_size
    cfg = config or default_config(m, n, k, g, per_row, x.device)
    nkb = _cdiv(k, cfg.block_k)
    per_split = _cdiv(nkb, max(1, min(cfg.split_k, nkb)))
    split = _cdiv(nkb, per_split)  # no empty splits
    block_scales = (per_row or g % cfg.block_k == 0) and not cfg.element_scales
    scales = scales.contiguous()
    offsets = None if offsets is None else offsets.contiguous()
    w0, w1, w2 = (p if p.stride(-1) == 1 else p.contiguous() for p in planes)
    if split == 1:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    upcast = x.dtype == torch.float32 or (INTERPRETED and x.dtype == torch.bfloat16)
    grid = (_cdiv(n, cfg.block_n), _cdiv(m, cfg.block_m), split)
    _packed_mm_kernel[grid](
        x2,
        w0,
        w1,
        w2,
        scales,
        scales if offsets is None else offsets,
        y,
        m,
        n,
        k,
        g,
        per_split,
        x2.stride(0),
        w0.stride(0),
        w1.stride(0),
        w2.stride(0),
        scales.stride(0),
        y.stride(0),
        FMT=fmt,
        HAS_OFFSET=offsets is not None,
        BLOCK_SCALES=block_scales,
        UPCAST=upcast,
        SPLIT_K=split,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split > 1:
        y = y.to(x.dtype)
    return y.reshape(*lead, n)


def packed_matmul(
    x: torch.Tensor, packed: PackedWeight, config: KernelConfig | None = None
) -> torch.Tensor:
    """``x @ W^T`` for a :class:`PackedWeight`, ``x``: ``[..., K]`` fp16 / bf16 / fp32."""
    d = packed.data
    return _launch(
        x,
        _PACKED_FMT[packed.bits],
        (d, d, d),
        packed.scales,
        packed.offsets,
        packed.shape,
        packed.group_size,
        config,
    )


def planes_matmul(
    x: torch.Tensor, planes: MatryoshkaPlanes, bits: int, config: KernelConfig | None = None
) -> torch.Tensor:
    """``x @ W_r^T`` for the ``bits`` tier of :class:`MatryoshkaPlanes` (reads only its planes)."""
    if bits not in _PLANES_FMT:
        raise ValueError(f"Matryoshka tiers are {tuple(_PLANES_FMT)} bits, got {bits!r}")
    # unused plane pointers alias plane A; the kernel never dereferences them for lower tiers
    w1 = planes.b if bits >= 4 else planes.a
    w2 = planes.c if bits == 8 else planes.a
    return _launch(
        x,
        _PLANES_FMT[bits],
        (planes.a, w1, w2),
        planes.scales,
        None,
        planes.shape,
        planes.group_size,
        config,
    )


def weight_bytes_read(w: PackedWeight | MatryoshkaPlanes, bits: int | None = None) -> int:
    """Bytes of weight storage one product reads: codes (the tier's planes) + scales (+ offsets)."""
    if isinstance(w, MatryoshkaPlanes):
        if bits is None:
            raise ValueError("planes need the tier bits")
        return w.tier_nbytes(bits)
    return w.nbytes


__all__ = [
    "INTERPRETED",
    "TRITON_AVAILABLE",
    "KernelConfig",
    "default_config",
    "packed_matmul",
    "planes_matmul",
    "weight_bytes_read",
]
