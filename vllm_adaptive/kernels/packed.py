"""Packed integer weight formats: int8, int4 (two per byte) and int2 (four per byte).

A weight ``W`` of shape ``[N, K]`` (``nn.Linear`` layout: N outputs, K inputs) is stored as
integer codes ``c`` plus scales (and, for asymmetric grids, offsets), one per output row
(``group_size=None``) or one per group of ``group_size`` consecutive inputs of a row::

    W[n, k] ~= c[n, k] * scale[n, k // g]  (+ offset[n, k // g] when asymmetric)

Codes are signed. The ranges follow GEARBX (section 5.1, table 4) for the symmetric quantizer,
``qmax = 2**(bits-1) - 1``: int8 in [-127, 127], int4 in [-7, 7], int2 in {-1, 0, 1}, so the
int2 format is GEARBX's *ternary* one. Storage uses GEARBX's offsets (section 5.2 and 16.2:
int4 +8, int2 +2), so each field holds an unsigned value and the full two's-complement range is
storable: int4 fields hold codes in [-8, 7], int2 fields codes in [-2, 1]. The symmetric quantizer
never emits -8 / -2; the asymmetric quantizer (all ``2**bits`` levels) and the Matryoshka tiers
(``matryoshka.py``, whose int2 tier is the 2 most significant bits of an int8 code) do. Ternary
rather than a 4-level symmetric int2 because that is what both papers call int2 and it keeps the
symmetric family uniform (zero representable, ``qmax = 2**(bits-1) - 1``); the 4-level int2 grid
is what the Matryoshka int2 tier gives, in the same storage.

Packing is along the input dimension of each row, little end first: int4 byte ``j`` of a row
holds element ``2j`` in its low nibble and ``2j+1`` in its high nibble; int2 byte ``j`` holds
elements ``4j .. 4j+3`` in bits 0-1, 2-3, 4-5, 6-7. Sizes that do not fill whole bytes (K odd for
int4, K not a multiple of 4 for int2) and group sizes that do not divide K raise ``ValueError``
naming the constraint; nothing is padded (every linear layer of the models in scope has K a
multiple of 64).

Quantizers:

- ``quantize(w, bits, group_size)``: symmetric absmax, GEARBX eq. in section 5.1 with its scale
  floor (1e-4 for fp16 scales, 1e-8 otherwise).
- ``quantize(w, bits, group_size, symmetric=False)``: asymmetric min/max with all ``2**bits``
  levels (``scale = (max - min) / (2**bits - 1)``), GGUF Q4_1-style for bits=4, group 32. On the
  default model, whose weights come from a Q4_1 GGUF, 4-bit asymmetric group-32 is the
  grid-aligned quantizer and symmetric 4-bit is not.

Codes are computed against the scales *as stored* (rounded to ``scale_dtype``), so
``dequantize(quantize(w))`` is exactly ``codes * scale (+ offset)`` in float32, cast to the
requested dtype.

``quantize`` warns with :class:`DoubleQuantizationWarning` when the source already lies on a
coarse grid (GEARBX section 6.4 / 13.3): most groups of 32 consecutive inputs hold at most 16
distinct values.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

SUPPORTED_BITS = (8, 4, 2)

# GEARBX section 16.2: integer offsets used in storage.
STORAGE_OFFSET = {4: 8, 2: 2}

# Double-quantization heuristic: a group of DQ_GROUP consecutive inputs "lies on a coarse grid"
# when it holds at most DQ_MAX_LEVELS distinct values (a 4-bit grid has 16 levels); warn when at
# least DQ_FRACTION of the sampled groups do. Random float weights give ~32 distinct values per
# group of 32; the Q4_1-derived default model gives <= 16 in every group.
DQ_GROUP = 32
DQ_MAX_LEVELS = 16
DQ_FRACTION = 0.5
DQ_SAMPLE_ROWS = 256


class DoubleQuantizationWarning(UserWarning):
    """The weight being quantized already lies on a coarse grid (it was quantized before)."""


def code_range(bits: int, symmetric: bool = True) -> tuple[int, int]:
    """Inclusive (lo, hi) of the codes a quantizer emits for ``bits``."""
    _check_bits(bits)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        return -qmax, qmax
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def storage_range(bits: int) -> tuple[int, int]:
    """Inclusive range of codes the storage format can hold (full two's complement)."""
    _check_bits(bits)
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def scale_floor(scale_dtype: torch.dtype) -> float:
    """GEARBX scale floor: 1e-4 for fp16 scales, 1e-8 otherwise (fp32 / bf16 range)."""
    return 1e-4 if scale_dtype == torch.float16 else 1e-8


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")


def _check_group(k: int, group_size: int | None) -> int:
    """Validate ``group_size`` against K; return the effective group length."""
    if group_size is None:
        return k
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int or None, got {group_size!r}")
    if k % group_size:
        raise ValueError(
            f"group_size={group_size} must divide the input dimension K={k} "
            "(groups run along the input dimension; nothing is padded)"
        )
    return group_size


def _check_packable(k: int, bits: int) -> None:
    per_byte = 8 // bits
    if k % per_byte:
        raise ValueError(
            f"int{bits} packing stores {per_byte} values per byte along the input dimension: "
            f"K={k} must be a multiple of {per_byte} (nothing is padded)"
        )


# ---------------------------------------------------------------------------------------------
# Bit packing
# ---------------------------------------------------------------------------------------------


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack signed int8 codes ``[N, K]`` into the storage tensor for ``bits``.

    bits=8: the int8 codes themselves. bits=4: uint8 ``[N, K/2]``. bits=2: uint8 ``[N, K/4]``.
    Codes outside the storable range raise ``ValueError``.
    """
    _check_bits(bits)
    if codes.dim() != 2:
        raise ValueError(f"codes must be 2-D [N, K], got shape {tuple(codes.shape)}")
    if codes.dtype != torch.int8:
        raise ValueError(f"codes must be int8, got {codes.dtype}")
    lo, hi = storage_range(bits)
    if codes.numel() and (int(codes.min()) < lo or int(codes.max()) > hi):
        raise ValueError(
            f"int{bits} codes must lie in [{lo}, {hi}], got [{int(codes.min())}, "
            f"{int(codes.max())}]"
        )
    if bits == 8:
        return codes.contiguous()
    n, k = codes.shape
    _check_packable(k, bits)
    per_byte = 8 // bits
    u = (codes.to(torch.int16) + STORAGE_OFFSET[bits]).to(torch.uint8)
    u = u.view(n, k // per_byte, per_byte)
    out = u[..., 0].clone()
    for i in range(1, per_byte):
        out |= u[..., i] << (bits * i)
    return out.contiguous()


def unpack_codes(data: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: int8 codes ``[N, K]``."""
    _check_bits(bits)
    if bits == 8:
        if data.dtype != torch.int8:
            raise ValueError(f"int8 storage must be int8, got {data.dtype}")
        return data
    if data.dtype != torch.uint8:
        raise ValueError(f"int{bits} storage must be uint8, got {data.dtype}")
    _check_packable(k, bits)
    per_byte = 8 // bits
    n = data.shape[0]
    if data.shape[1] * per_byte != k:
        raise ValueError(f"int{bits} storage of width {data.shape[1]} cannot hold K={k}")
    mask = (1 << bits) - 1
    fields = [(data >> (bits * i)) & mask for i in range(per_byte)]
    u = torch.stack(fields, dim=-1).view(n, k)
    return (u.to(torch.int8) - STORAGE_OFFSET[bits]).to(torch.int8)


# ---------------------------------------------------------------------------------------------
# PackedWeight
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A quantized ``[N, K]`` weight: packed codes, scales and optional offsets.

    ``data``: int8 ``[N, K]`` (bits=8) or uint8 ``[N, K*bits/8]`` (bits 4, 2).
    ``scales``: ``[N, K/group]`` (``[N, 1]`` when ``group_size`` is None), dtype ``scale_dtype``.
    ``offsets``: same shape as ``scales`` for asymmetric grids, None for symmetric ones.
    ``scheme``: how the codes were produced ("symmetric", "asymmetric", "matryoshka-msb"...),
    for reports only.

    Kernel-specific layouts prepared by :mod:`vllm_adaptive.kernels.matmul` are cached in
    ``prepared`` (once per weight, not per call); they are derived data and never compared.
    """

    bits: int
    group_size: int | None
    data: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    shape: tuple[int, int]
    scheme: str = "symmetric"
    prepared: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        n, k = self.shape
        g = _check_group(k, self.group_size)
        want = (n, k) if self.bits == 8 else (n, k * self.bits // 8)
        if self.bits != 8:
            _check_packable(k, self.bits)
        want_dtype = torch.int8 if self.bits == 8 else torch.uint8
        if tuple(self.data.shape) != want or self.data.dtype != want_dtype:
            raise ValueError(
                f"int{self.bits} storage for shape {self.shape} must be {want_dtype} {want}, "
                f"got {self.data.dtype} {tuple(self.data.shape)}"
            )
        if tuple(self.scales.shape) != (n, k // g):
            raise ValueError(f"scales must be {(n, k // g)}, got {tuple(self.scales.shape)}")
        if self.offsets is not None and (
            self.offsets.shape != self.scales.shape or self.offsets.dtype != self.scales.dtype
        ):
            raise ValueError("offsets must match scales in shape and dtype")

    # -- descriptive -------------------------------------------------------------------------
    @property
    def symmetric(self) -> bool:
        return self.offsets is None

    @property
    def scale_dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def group_len(self) -> int:
        """Inputs per scale: ``group_size``, or K for per-row scales."""
        return self.group_size if self.group_size is not None else self.shape[1]

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes held: codes + scales (+ offsets); prepared kernel layouts not included."""
        total = self.data.numel() * self.data.element_size()
        total += self.scales.numel() * self.scales.element_size()
        if self.offsets is not None:
            total += self.offsets.numel() * self.offsets.element_size()
        return total

    def describe(self) -> str:
        """Short name for reports, e.g. ``int4 g32 asymmetric``."""
        grp = "per-row" if self.group_size is None else f"g{self.group_size}"
        return f"int{self.bits} {grp} {self.scheme}"

    # -- data ------------------------------------------------------------------------------------
    def codes(self) -> torch.Tensor:
        """Signed int8 codes ``[N, K]`` (unpacked)."""
        return unpack_codes(self.data, self.bits, self.shape[1])

    def to(self, device: torch.device | str) -> PackedWeight:
        """A copy on ``device`` (prepared layouts are not carried over)."""
        off = None if self.offsets is None else self.offsets.to(device)
        return PackedWeight(
            self.bits,
            self.group_size,
            self.data.to(device),
            self.scales.to(device),
            off,
            self.shape,
            self.scheme,
        )


# ---------------------------------------------------------------------------------------------
# Double-quantization check
# ---------------------------------------------------------------------------------------------


def coarse_grid_fraction(
    weight: torch.Tensor,
    group: int = DQ_GROUP,
    max_levels: int = DQ_MAX_LEVELS,
    sample_rows: int = DQ_SAMPLE_ROWS,
) -> float:
    """Fraction of groups of ``group`` consecutive inputs holding <= ``max_levels`` values.

    Looks at up to ``sample_rows`` evenly spaced rows. Returns 0.0 when K < ``group``.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    usable = (k // group) * group
    if usable == 0 or n == 0:
        return 0.0
    rows = torch.linspace(0, n - 1, steps=min(n, sample_rows), dtype=torch.float64)
    rows = rows.round().long().unique()
    blocks = weight[rows.to(weight.device), :usable].reshape(-1, group)
    s, _ = blocks.sort(dim=-1)
    distinct = 1 + (s[:, 1:] != s[:, :-1]).sum(dim=-1)
    return float((distinct <= max_levels).float().mean())


def check_double_quantization(weight: torch.Tensor, stacklevel: int = 3) -> float:
    """Warn (:class:`DoubleQuantizationWarning`) if ``weight`` already lies on a coarse grid."""
    frac = coarse_grid_fraction(weight)
    if frac >= DQ_FRACTION:
        warnings.warn(
            f"weight {tuple(weight.shape)} already lies on a coarse grid: {frac:.0%} of the "
            f"sampled groups of {DQ_GROUP} consecutive inputs hold at most {DQ_MAX_LEVELS} "
            "distinct values, so it was probably quantized before (e.g. a GGUF Q4_0/Q4_1 "
            "source). Re-quantizing it onto a grid that is not aligned with the original one "
            "compounds the error; for a Q4_1 source the asymmetric 4-bit group-32 quantizer "
            "(quantize(w, 4, 32, symmetric=False)) reproduces it. Pass "
            "check_double_quant=False to silence.",
            DoubleQuantizationWarning,
            stacklevel=stacklevel,
        )
    return frac


# ---------------------------------------------------------------------------------------------
# Quantize / dequantize
# ---------------------------------------------------------------------------------------------


def _grouped(weight: torch.Tensor, g: int) -> torch.Tensor:
    n, k = weight.shape
    return weight.reshape(n, k // g, g)


def quantize(
    weight: torch.Tensor,
    bits: int,
    group_size: int | None = None,
    *,
    symmetric: bool = True,
    scale_dtype: torch.dtype = torch.float32,
    check_double_quant: bool = True,
) -> PackedWeight:
    """Quantize a float ``[N, K]`` weight to a :class:`PackedWeight`.

    ``group_size=None``: one scale per output row; otherwise one per ``group_size`` inputs.
    ``symmetric=True``: absmax, codes in ``[-(2**(bits-1)-1), 2**(bits-1)-1]`` (int2 =
    ternary). ``symmetric=False``: min/max with an offset, all ``2**bits`` levels.
    """
    _check_bits(bits)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"weight must be a float tensor, got {weight.dtype}")
    if not scale_dtype.is_floating_point:
        raise ValueError(f"scale_dtype must be a float dtype, got {scale_dtype}")
    n, k = weight.shape
    g = _check_group(k, group_size)
    if bits != 8:
        _check_packable(k, bits)
    if check_double_quant:
        check_double_quantization(weight, stacklevel=3)

    w = _grouped(weight.detach().to(torch.float32), g)
    floor = scale_floor(scale_dtype)
    if symmetric:
        lo, hi = code_range(bits, symmetric=True)
        absmax = w.abs().amax(dim=-1)
        scales = (absmax / hi).clamp_min(floor).to(scale_dtype)
        offsets = None
        s = scales.to(torch.float32).unsqueeze(-1)
        codes = torch.round(w / s).clamp_(lo, hi)
    else:
        lo, hi = code_range(bits, symmetric=False)
        wmin = w.amin(dim=-1)
        wmax = w.amax(dim=-1)
        scales = ((wmax - wmin) / (hi - lo)).clamp_min(floor).to(scale_dtype)
        s = scales.to(torch.float32)
        offsets = (wmin - lo * s).to(scale_dtype)
        o = offsets.to(torch.float32).unsqueeze(-1)
        codes = torch.round((w - o) / s.unsqueeze(-1)).clamp_(lo, hi)
    codes = codes.to(torch.int8).reshape(n, k)
    return PackedWeight(
        bits=bits,
        group_size=group_size,
        data=pack_codes(codes, bits),
        scales=scales.contiguous(),
        offsets=None if offsets is None else offsets.contiguous(),
        shape=(n, k),
        scheme="symmetric" if symmetric else "asymmetric",
    )


def dequantize_codes(
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``codes * scale (+ offset)`` in float32, cast to ``dtype``; scales are ``[N, groups]``."""
    n, k = codes.shape
    groups = scales.shape[1]
    w = codes.to(torch.float32).view(n, groups, k // groups)
    w = w * scales.to(torch.float32).unsqueeze(-1)
    if offsets is not None:
        w = w + offsets.to(torch.float32).unsqueeze(-1)
    return w.view(n, k).to(dtype)


def dequantize(packed: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float ``[N, K]`` weight a :class:`PackedWeight` represents, in ``dtype``."""
    return dequantize_codes(packed.codes(), packed.scales, packed.offsets, dtype)
