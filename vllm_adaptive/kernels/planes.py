"""Bit-plane Matryoshka layout: the int8 codes split so each tier reads only its own bytes.

A :class:`~vllm_adaptive.kernels.matryoshka.MatryoshkaWeight` stores one symmetric int8 code
``q`` per parameter and reads the r-bit tier as ``q >> (8 - r)``. Stored as a plain int8 tensor,
every tier still streams the whole byte: the int2 tier of a decode step (memory-bound on a GPU)
moves 1 byte per parameter to use 2 bits of it. The plane layout stores the same bits in three
packed tensors, most significant first, so that tier r reads r/8 byte per parameter while all three
tiers together still take exactly the int8 memory (1 byte per parameter, plus the scales)::

    plane A: bits 7-6 of q (two's complement), 4 per byte   0.25 B/param   int2 tier
    plane B: bits 5-4 of q,                    4 per byte   0.25 B/param   + A = int4 tier
    plane C: bits 3-0 of q,                    2 per byte   0.50 B/param   + A + B = int8

    c2 = q >> 6            = A field - 2          in [-2, 1]
    c4 = q >> 4            = 4 * c2 + B field     in [-8, 7]
    q                      = 16 * c4 + C field    in [-128, 127]

Field order inside a byte follows :mod:`vllm_adaptive.kernels.packed`: element ``4j + i`` of a
row sits in bits ``2i .. 2i+1`` of byte ``j`` (planes A and B), element ``2j + i`` in nibble
``i`` of byte ``j`` (plane C, low nibble first). Plane A holds ``c2 + 2`` (offset binary, the
int2 storage offset of ``packed.py``) rather than the raw two's-complement bits 7-6 (they differ
in the top bit only: ``A = ((q >> 6) & 3) ^ 2``), which makes plane A *bit-identical* to the
``data`` of the int2 tier as a :class:`PackedWeight` (:meth:`MatryoshkaPlanes.int2_tier` shares
it without a copy). Planes B and C hold the raw, unsigned low bits: they refine the code below
them and have no sign of their own.

The tiers are reconstructed exactly as :meth:`MatryoshkaWeight.dequantize` does (bin centres,
``scale_r = 2**(8-r) s``, ``offset_r = 2**(7-r) s``), so ``planes.dequantize(r)`` equals
``weight.dequantize(r)`` bit for bit. Kernels (``triton_packed.py``) read the integer
bin-centre code ``2**(8-r) c_r + 2**(7-r)`` (a value in [-120, 120]) times the int8 scale.

Sizes: K must be a multiple of 4 (planes A and B pack 4 values per byte; nothing is padded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_adaptive.kernels.matryoshka import TIER_BITS, MatryoshkaWeight, tier_scales
from vllm_adaptive.kernels.packed import (
    PackedWeight,
    _check_group,
    dequantize_codes,
    pack_codes,
    unpack_codes,
)

# bytes per parameter each tier reads from the planes (codes only; scales come on top)
TIER_PLANES = {2: ("a",), 4: ("a", "b"), 8: ("a", "b", "c")}


def _check_tier(bits: int) -> None:
    if bits not in TIER_BITS:
        raise ValueError(f"Matryoshka tiers are {TIER_BITS} bits, got {bits!r}")


def _pack_fields(fields: torch.Tensor, width: int) -> torch.Tensor:
    """Pack unsigned ``width``-bit fields ``[N, K]`` (uint8) along K, low bits first."""
    n, k = fields.shape
    per_byte = 8 // width
    f = fields.view(n, k // per_byte, per_byte)
    out = f[..., 0].clone()
    for i in range(1, per_byte):
        out |= f[..., i] << (width * i)
    return out.contiguous()


def _unpack_fields(data: torch.Tensor, width: int, k: int) -> torch.Tensor:
    """Inverse of :func:`_pack_fields`: uint8 fields ``[N, K]``."""
    per_byte = 8 // width
    mask = (1 << width) - 1
    n = data.shape[0]
    parts = [(data >> (width * i)) & mask for i in range(per_byte)]
    return torch.stack(parts, dim=-1).view(n, k)


@dataclass(frozen=True, eq=False)
class MatryoshkaPlanes:
    """The int8 codes of a :class:`MatryoshkaWeight` as three bit planes (see module doc).

    ``a``, ``b``: uint8 ``[N, K/4]``; ``c``: uint8 ``[N, K/2]``; ``scales``: the int8 scales
    ``[N, K/group]`` (``[N, 1]`` per row), unchanged from the base weight.
    """

    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor
    scales: torch.Tensor
    group_size: int | None
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        n, k = self.shape
        if k % 4:
            raise ValueError(
                f"the plane layout packs 4 values per byte along the input dimension: K={k} "
                "must be a multiple of 4 (nothing is padded)"
            )
        g = _check_group(k, self.group_size)
        for name, width in (("a", k // 4), ("b", k // 4), ("c", k // 2)):
            t = getattr(self, name)
            if t.dtype != torch.uint8 or tuple(t.shape) != (n, width):
                raise ValueError(
                    f"plane {name.upper()} must be uint8 {(n, width)}, got {t.dtype} "
                    f"{tuple(t.shape)}"
                )
        if tuple(self.scales.shape) != (n, k // g):
            raise ValueError(f"scales must be {(n, k // g)}, got {tuple(self.scales.shape)}")

    # -- descriptive -------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.a.device

    @property
    def group_len(self) -> int:
        return self.group_size if self.group_size is not None else self.shape[1]

    @property
    def nbytes(self) -> int:
        """All three planes plus scales: the same as the int8 weight they came from."""
        planes = sum(t.numel() * t.element_size() for t in (self.a, self.b, self.c))
        return planes + self.scales.numel() * self.scales.element_size()

    def tier_nbytes(self, bits: int) -> int:
        """Bytes a kernel reads for the ``bits`` tier: its planes plus the scales."""
        _check_tier(bits)
        planes = sum(getattr(self, p).numel() for p in TIER_PLANES[bits])
        return planes + self.scales.numel() * self.scales.element_size()

    # -- data ------------------------------------------------------------------------------------
    def codes(self, bits: int) -> torch.Tensor:
        """Tier codes ``[N, K]`` (int8), equal to ``MatryoshkaWeight.codes(bits)``."""
        _check_tier(bits)
        k = self.shape[1]
        c2 = unpack_codes(self.a, 2, k)  # A holds c2 + 2, the int2 storage format
        if bits == 2:
            return c2
        c4 = c2.to(torch.int16) * 4 + _unpack_fields(self.b, 2, k).to(torch.int16)
        if bits == 4:
            return c4.to(torch.int8)
        q = c4 * 16 + _unpack_fields(self.c, 4, k).to(torch.int16)
        return q.to(torch.int8)

    def dequantize(self, bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``bits`` tier as a float weight; equal to ``MatryoshkaWeight.dequantize``."""
        scale, offset = tier_scales(self.scales, bits)
        return dequantize_codes(self.codes(bits), scale, offset, dtype)

    def int2_tier(self) -> PackedWeight:
        """The int2 tier as a :class:`PackedWeight` whose ``data`` *is* plane A (no copy)."""
        scale, offset = tier_scales(self.scales, 2)
        return PackedWeight(
            bits=2,
            group_size=self.group_size,
            data=self.a,
            scales=scale,
            offsets=offset,
            shape=self.shape,
            scheme="matryoshka-msb",
        )

    def to_weight(self) -> MatryoshkaWeight:
        """Back to the single-int8-tensor :class:`MatryoshkaWeight`."""
        base = PackedWeight(
            bits=8,
            group_size=self.group_size,
            data=self.codes(8),
            scales=self.scales,
            offsets=None,
            shape=self.shape,
            scheme="symmetric",
        )
        return MatryoshkaWeight(base)

    def to(self, device: torch.device | str) -> MatryoshkaPlanes:
        return MatryoshkaPlanes(
            self.a.to(device),
            self.b.to(device),
            self.c.to(device),
            self.scales.to(device),
            self.group_size,
            self.shape,
        )


def to_planes(m: MatryoshkaWeight) -> MatryoshkaPlanes:
    """Split ``m``'s int8 codes into planes A (bits 7-6), B (bits 5-4) and C (bits 3-0)."""
    n, k = m.shape
    if k % 4:
        raise ValueError(
            f"the plane layout packs 4 values per byte along the input dimension: K={k} "
            "must be a multiple of 4 (nothing is padded)"
        )
    q = m.base.data
    u = q.view(torch.uint8)
    a = pack_codes(torch.bitwise_right_shift(q, 6), 2)  # c2 + 2, four per byte
    b = _pack_fields((u >> 4) & 3, 2)
    c = _pack_fields(u & 15, 4)
    return MatryoshkaPlanes(a, b, c, m.base.scales, m.group_size, (n, k))
