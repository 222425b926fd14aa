"""Matryoshka layout: one int8 tensor whose most significant bits are the int4 and int2 tiers.

QuickSilver (section 2.5, appendix E) assigns each token 8, 4 or 2 bits; Matryoshka quantization
makes the three precisions one nested object: an int8 code ``q`` is stored once and the r-bit
tier is its r most significant bits, read with an arithmetic shift::

    c_r = q >> (8 - r)            # int4: q >> 4 in [-8, 7];  int2: q >> 6 in [-2, 1]

so holding all three tiers costs the int8 memory (plus one scale per row or group) only, and the
tiers nest exactly: ``c_2 == c_4 >> 2``. A shift is a floor, so the tier code names a *bin* of
``2**(8-r)`` int8 codes, and the tier is reconstructed at the bin centre::

    W_r = s * (2**(8-r) * c_r + 2**(7-r))  =  scale_r * c_r + offset_r,
    scale_r = s * 2**(8-r),  offset_r = s * 2**(7-r)   (exact power-of-two multiples of s)

which is a symmetric mid-rise grid with 2**r levels and no zero level (int4: +-8s, +-24s, ...,
+-120s; int2: +-32s, +-96s). A tier is therefore a :class:`PackedWeight` with an offset, and
runs through the same matmul entry point (on CPU through the int4pack kernel, whose
``(q - 8) * scale + zero`` form takes the offset as its zero).

The base int8 grid is GEARBX's symmetric absmax (``q`` in [-127, 127]). The papers give no
slicing rule beyond "lower bit-widths of one quantized weight"; MatQuant-style rounding
(``round(q / 2**(8-r))``) instead of the shift would put a zero level in the tier but clip the
positive end (int2 levels {-128, -64, 0, 64}s) and is not a pure read of stored bits, so the
shift is used. ``docs/packed-kernels.md`` measures the sliced tiers against tiers quantized
directly (same grid and GEARBX's own symmetric int4 / ternary int2) on the default model.

Memory note: slicing is free for the *storage*; a kernel that wants a tier in its own layout (the
CPU int4pack kernel) needs that layout prepared, which :meth:`MatryoshkaWeight.tier` caches and
:meth:`MatryoshkaWeight.drop_tiers` frees. A GPU kernel can read the MSBs in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_adaptive.kernels.packed import (
    PackedWeight,
    dequantize_codes,
    pack_codes,
    quantize,
    storage_range,
)

TIER_BITS = (8, 4, 2)


def _check_tier(bits: int) -> None:
    if bits not in TIER_BITS:
        raise ValueError(f"Matryoshka tiers are {TIER_BITS} bits, got {bits!r}")


def slice_codes(codes8: torch.Tensor, bits: int) -> torch.Tensor:
    """The ``bits`` most significant bits of int8 codes, as signed int8 codes."""
    _check_tier(bits)
    if codes8.dtype != torch.int8:
        raise ValueError(f"codes must be int8, got {codes8.dtype}")
    if bits == 8:
        return codes8
    return torch.bitwise_right_shift(codes8, 8 - bits)


def tier_scales(scales8: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale_r, offset_r) of the ``bits`` tier from the int8 scales (offset None for 8)."""
    _check_tier(bits)
    if bits == 8:
        return scales8, None
    return scales8 * float(2 ** (8 - bits)), scales8 * float(2 ** (7 - bits))


@dataclass(frozen=True, eq=False)
class MatryoshkaWeight:
    """An int8 symmetric :class:`PackedWeight` read at 8, 4 or 2 bits."""

    base: PackedWeight
    tiers: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.base.bits != 8 or not self.base.symmetric:
            raise ValueError("a Matryoshka base must be a symmetric int8 PackedWeight")

    @property
    def shape(self) -> tuple[int, int]:
        return self.base.shape

    @property
    def group_size(self) -> int | None:
        return self.base.group_size

    @property
    def nbytes(self) -> int:
        """Storage for all three tiers: the int8 codes and scales only."""
        return self.base.nbytes

    def codes(self, bits: int) -> torch.Tensor:
        """Tier codes ``[N, K]`` (int8), sliced from the stored int8 codes."""
        return slice_codes(self.base.data, bits)

    def dequantize(self, bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``bits`` tier as a float weight, read straight from the int8 storage."""
        scale, offset = tier_scales(self.base.scales, bits)
        return dequantize_codes(self.codes(bits), scale, offset, dtype)

    def tier(self, bits: int) -> PackedWeight:
        """The ``bits`` tier as a :class:`PackedWeight` (for :func:`matmul`); cached.

        bits=8 is the base itself. Lower tiers hold their own packed codes (``bits/8`` bytes per
        parameter more) so kernels can prepare layouts on them; :meth:`drop_tiers` frees them.
        """
        _check_tier(bits)
        if bits == 8:
            return self.base
        got = self.tiers.get(bits)
        if got is None:
            scale, offset = tier_scales(self.base.scales, bits)
            got = PackedWeight(
                bits=bits,
                group_size=self.base.group_size,
                data=pack_codes(self.codes(bits), bits),
                scales=scale,
                offsets=offset,
                shape=self.base.shape,
                scheme="matryoshka-msb",
            )
            self.tiers[bits] = got
        return got

    def drop_tiers(self) -> None:
        self.tiers.clear()


def matryoshka_quantize(
    weight: torch.Tensor,
    group_size: int | None = None,
    *,
    scale_dtype: torch.dtype = torch.float32,
    check_double_quant: bool = True,
) -> MatryoshkaWeight:
    """Symmetric int8 quantization of ``weight``, readable at 8, 4 and 2 bits."""
    base = quantize(
        weight,
        8,
        group_size,
        symmetric=True,
        scale_dtype=scale_dtype,
        check_double_quant=check_double_quant,
    )
    return MatryoshkaWeight(base)


def quantize_on_tier_grid(weight: torch.Tensor, m: MatryoshkaWeight, bits: int) -> PackedWeight:
    """Quantize ``weight`` *directly* to the grid of ``m``'s ``bits`` tier (same scales).

    Nearest mid-rise level: ``c = clamp(floor(w / scale_r), lo, hi)``. Compared with the sliced
    tier this isolates the cost of going through the int8 rounding first (double rounding):
    the two codes differ by at most one.
    """
    _check_tier(bits)
    if bits == 8:
        raise ValueError("the 8-bit tier is the base itself")
    scale, offset = tier_scales(m.base.scales, bits)
    n, k = m.shape
    groups = scale.shape[1]
    w = weight.detach().to(torch.float32).reshape(n, groups, k // groups)
    lo, hi = storage_range(bits)
    codes = torch.floor(w / scale.to(torch.float32).unsqueeze(-1)).clamp_(lo, hi)
    codes = codes.to(torch.int8).reshape(n, k)
    return PackedWeight(
        bits=bits,
        group_size=m.group_size,
        data=pack_codes(codes, bits),
        scales=scale,
        offsets=offset,
        shape=m.shape,
        scheme="direct-midrise",
    )
