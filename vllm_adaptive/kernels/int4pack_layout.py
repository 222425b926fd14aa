"""The group and scale-and-zero layout of torch's int4pack kernels, shared by the CPU kernel
(``aten._weight_int4pack_mm_for_cpu``) and the CUDA one (tinygemm, ``aten._weight_int4pack_mm``).

Both compute ``(q - 8) * scale + zero`` per group of 32 / 64 / 128 / 256 inputs, so int4 and int2
codes (int2 codes are int4 codes in [-2, 1]), symmetric (zero = 0) and asymmetric (zero =
offset) weights fit; per-row scales are repeated over the largest such group dividing K.
"""

from __future__ import annotations

import torch

from vllm_adaptive.kernels.packed import PackedWeight

GROUPS = (256, 128, 64, 32)  # what both kernels accept


def kernel_group(packed: PackedWeight) -> int | None:
    """The group length the kernels run ``packed`` with, or None if none fits."""
    k = packed.shape[1]
    if packed.group_size is None:
        return next((g for g in GROUPS if k % g == 0), None)
    return packed.group_size if packed.group_size in GROUPS else None


def scale_zeros(packed: PackedWeight, group: int, dtype: torch.dtype) -> torch.Tensor:
    """``[K / group, N, 2]`` (scale, zero) in ``dtype``, the kernels' layout."""
    reps = packed.group_len // group
    scales = packed.scales.to(torch.float32)
    zeros = torch.zeros_like(scales) if packed.offsets is None else packed.offsets.float()
    if reps > 1:
        scales = scales.repeat_interleave(reps, dim=1)
        zeros = zeros.repeat_interleave(reps, dim=1)
    return torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()
