"""Packed weight tiers in MLX's own quantized format, run by ``mx.quantized_matmul``.

MLX stores a quantized ``[N, K]`` weight as unsigned ``bits``-wide codes packed little end first
into uint32 words along K, with one scale and one bias per group of ``group_size`` inputs:
``w = scale * q + bias`` (``mx.dequantize``); its kernels read that layout on every device, CPU
and Metal alike. Three grids fill it:

- ``"affine"``: ``mx.quantize`` itself, MLX's asymmetric min/max quantizer (all ``2**bits``
  levels): what the config calls ``symmetric: false``.
- ``"symmetric"``: GEARBX's absmax grid, the vLLM path's symmetric quantizer
  (``kernels/packed.py``): codes in ``[-qmax, qmax]``, ``qmax = 2**(bits-1) - 1`` (int2 is
  ternary), stored as ``q = c + 2**(bits-1)`` with ``bias = -2**(bits-1) * scale``, exact.
- ``"matryoshka"``: QuickSilver's nested tiers (``kernels/matryoshka.py``): one symmetric int8
  code ``c8`` per weight; the r-bit tier is ``c8 >> (8 - r)`` read at its bin centre,
  ``scale * 2**(8-r) * c_r + scale * 2**(7-r)``, again an exact affine form.

Scales are computed in float32 and rounded to the weight's dtype before the codes are taken,
so ``mx.dequantize`` returns exactly ``codes * scale (+ bias)``. MLX's affine kernels take group
sizes 32, 64 and 128 that divide K; nothing coarser (no per-row groups), which
`check_group_size` turns into an error naming the config key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

MLX_GROUP_SIZES = (32, 64, 128)
SCHEMES = ("affine", "symmetric", "matryoshka")
SCALE_FLOOR = 1e-8  # GEARBX's floor for float32 / bfloat16 scales


@dataclass(frozen=True, eq=False)
class QuantTier:
    """One packed precision of a linear weight (MLX layout)."""

    wq: Any  # uint32 [N, K * bits / 32]
    scales: Any  # [N, K / group_size], weight dtype
    biases: Any  # [N, K / group_size], weight dtype
    bits: int
    group_size: int
    scheme: str

    def matmul(self, x: Any) -> Any:
        """``x @ W^T`` with the packed weight."""
        import mlx.core as mx

        return mx.quantized_matmul(
            x,
            self.wq,
            self.scales,
            self.biases,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
        )

    def dequantize(self) -> Any:
        import mlx.core as mx

        return mx.dequantize(
            self.wq, self.scales, self.biases, group_size=self.group_size, bits=self.bits
        )

    @property
    def nbytes(self) -> int:
        return int(self.wq.nbytes + self.scales.nbytes + self.biases.nbytes)


def check_group_size(group_size: int | None, k: int, key: str) -> int:
    """The group size if MLX's kernels take it for inputs of width ``k``; else a ValueError
    naming ``key``."""
    if group_size not in MLX_GROUP_SIZES:
        raise ValueError(
            f"{key}: {group_size!r} is not a group size MLX's quantized kernels support "
            f"({list(MLX_GROUP_SIZES)}; no per-row groups)"
        )
    if k % group_size:
        raise ValueError(f"{key}: {group_size} does not divide this model's input width {k}")
    return group_size


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes ``[N, K]`` (values < 2**bits) into MLX's uint32 words ``[N, K*bits/32]``."""
    per_word = 32 // bits
    n, k = q.shape
    if k % per_word:
        raise ValueError(f"K={k} is not a multiple of {per_word} ({bits}-bit codes per word)")
    u = q.astype(np.uint32).reshape(n, k // per_word, per_word)
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)[None, None, :]
    return np.bitwise_or.reduce(u << shifts, axis=-1).astype(np.uint32)


def _groups(w: Any, group_size: int) -> np.ndarray:
    import mlx.core as mx

    a = np.array(w.astype(mx.float32))
    n, k = a.shape
    return a.reshape(n, k // group_size, group_size)


def _round_to(x: np.ndarray, dtype: Any) -> np.ndarray:
    """float32 values rounded to ``dtype`` (the scales' storage dtype), back as float32."""
    import mlx.core as mx

    return np.array(mx.array(x).astype(dtype).astype(mx.float32))


def _tier(
    codes_u: np.ndarray, scale: np.ndarray, bias: np.ndarray, bits: int, g: int, scheme: str, dt
) -> QuantTier:
    import mlx.core as mx

    n = codes_u.shape[0]
    return QuantTier(
        wq=mx.array(pack_codes(codes_u.reshape(n, -1), bits)),
        scales=mx.array(scale[..., 0]).astype(dt),
        biases=mx.array(bias[..., 0]).astype(dt),
        bits=bits,
        group_size=g,
        scheme=scheme,
    )


def symmetric_codes(w: Any, bits: int, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """GEARBX absmax: (signed codes [N, G, g], scales [N, G, 1] rounded to the weight dtype)."""
    x = _groups(w, group_size)
    qmax = 2 ** (bits - 1) - 1
    scale = np.maximum(np.abs(x).max(-1, keepdims=True) / qmax, SCALE_FLOOR)
    scale = _round_to(scale.astype(np.float32), w.dtype)
    codes = np.clip(np.rint(x / scale), -qmax, qmax).astype(np.int32)
    return codes, scale


def quantize(w: Any, bits: int, group_size: int, scheme: str) -> QuantTier:
    """One tier of the ``[N, K]`` weight ``w`` (an mx.array) on the ``scheme`` grid."""
    import mlx.core as mx

    if scheme == "affine":
        wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
        return QuantTier(wq, scales, biases, bits, group_size, scheme)
    if scheme == "symmetric":
        codes, scale = symmetric_codes(w, bits, group_size)
        half = 2 ** (bits - 1)
        return _tier(codes + half, scale, -half * scale, bits, group_size, scheme, w.dtype)
    if scheme == "matryoshka":
        return matryoshka_tiers(w, group_size, (bits,))[bits]
    raise ValueError(f"scheme must be one of {SCHEMES}, not {scheme!r}")


def matryoshka_tiers(w: Any, group_size: int, bits: tuple[int, ...]) -> dict[int, QuantTier]:
    """Tiers ``bits`` (each 8, 4 or 2) sliced from one symmetric int8 quantization of ``w``."""
    c8, s = symmetric_codes(w, 8, group_size)
    out = {}
    for r in bits:
        if r not in (8, 4, 2):
            raise ValueError(f"Matryoshka tiers are 8, 4 or 2 bits, got {r}")
        c = c8 >> (8 - r)  # arithmetic shift: the r most significant bits
        scale = s * float(2 ** (8 - r))
        offset = s * float(2 ** (7 - r)) if r < 8 else 0.0 * s
        half = 2 ** (r - 1)
        out[r] = _tier(c + half, scale, offset - half * scale, r, group_size, "matryoshka", w.dtype)
    return out
