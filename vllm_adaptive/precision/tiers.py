"""Packed tiers of one linear weight, and what they keep resident.

Two ways to hold the precisions a linear may run at:

- ``independent``: each precision quantized straight from the float weight: int8 symmetric,
  per row (torch's int8pack layout) or, where the plugin's native int8 kernel runs, in groups
  with float16 scales (GGUF's Q8_0: a checkpoint dequantized from Q8_0 comes back exactly, and
  the kernel is faster than int8pack), int4 / int2 with the configured group size and
  symmetry, fp16 and W8A8 (:mod:`vllm_adaptive.kernels.float_linear`, W8A8 optionally smoothed).
  Best quality per tier; memory is the sum of the tiers.
- ``matryoshka``: one symmetric int8 tensor (grouped as configured); int4 and int2 are its most
  significant bits (:mod:`vllm_adaptive.kernels.matryoshka`). All tiers cost the int8 storage;
  kernels that need their own layout (CPU int4pack) prepare it when the tier is activated.

``release`` / ``restore`` move a tier's kernel layouts off and back onto the device: on a GPU
the packed tensors go to host memory; on CPU the host *is* the device, so releasing drops the
prepared kernel layouts (rebuilt on restore from the stored codes) and the bytes that change are
exactly those layouts.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from vllm_adaptive.gears import BITS
from vllm_adaptive.kernels.float_linear import Fp16Weight, W8A8Weight, W8A16Weight
from vllm_adaptive.kernels.matmul import dispatch_paths, prepare
from vllm_adaptive.kernels.matryoshka import MatryoshkaWeight, matryoshka_quantize
from vllm_adaptive.kernels.packed import DoubleQuantizationWarning, PackedWeight, quantize

FLOAT_TIERS = (Fp16Weight, W8A8Weight, W8A16Weight)


def _storages(obj, seen: dict[int, int]) -> None:
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _storages(o, seen)
    elif isinstance(obj, dict):
        for o in obj.values():
            _storages(o, seen)


def _tensor_bytes(*objs) -> int:
    """Bytes of the distinct storages behind ``objs`` (views of one tensor count once)."""
    seen: dict[int, int] = {}
    for o in objs:
        _storages(o, seen)
    return sum(seen.values())


def packed_resident_bytes(p: PackedWeight) -> int:
    """Codes, scales, offsets and every prepared kernel layout of ``p``."""
    return _tensor_bytes([p.data, p.scales, p.offsets], p.prepared)


def _shares(t, p: PackedWeight) -> bool:
    """Whether a prepared tensor is a view of the weight's own codes / scales / offsets."""
    if not isinstance(t, torch.Tensor):
        return False
    own = {x.untyped_storage().data_ptr() for x in (p.data, p.scales, p.offsets) if x is not None}
    return t.untyped_storage().data_ptr() in own


@dataclass
class LinearTiers:
    """The packed precisions of one linear weight ``[N, K]``."""

    shape: tuple[int, int]
    tiers: dict[
        str, PackedWeight | Fp16Weight | W8A8Weight | W8A16Weight | None
    ]  # None: released Matryoshka
    matryoshka: MatryoshkaWeight | None = None
    released: set[str] = field(default_factory=set)

    @classmethod
    def build(
        cls,
        weight: torch.Tensor,
        precisions: set[str],
        layout: str,
        group_size: int | None,
        symmetric: bool,
        smooth: torch.Tensor | None = None,
        int8_group_size: int | None = None,
    ) -> LinearTiers:
        """``smooth``: SmoothQuant factors for the W8A8 tier (``precision/smoothing.py``).
        ``int8_group_size``: the int8 tier's group of K (float16 scales), None per row. The
        W8A16 tier is never smoothed (its activations need no help; smoothing only moves
        error into the weight); it shares the W8A8 tier's codes when that one is unsmoothed."""
        w = weight.detach().to(torch.float32)
        tiers: dict[str, PackedWeight | Fp16Weight | W8A8Weight | W8A16Weight] = {}
        m = None
        if "fp16" in precisions:
            tiers["fp16"] = Fp16Weight.from_float(w)
        if "w8a8" in precisions:
            tiers["w8a8"] = W8A8Weight.from_float(w, smooth)
        if "w8a16" in precisions:
            low = tiers.get("w8a8")
            if low is not None and low.inv_smooth is None:
                tiers["w8a16"] = W8A16Weight(base=low, shared=True)
            else:
                tiers["w8a16"] = W8A16Weight.from_float(w)
        precisions = precisions - {"fp16", "w8a8", "w8a16"}
        with warnings.catch_warnings():
            # The caller reports double quantization once per model, not once per weight.
            warnings.simplefilter("ignore", DoubleQuantizationWarning)
            if layout == "matryoshka":
                m = matryoshka_quantize(w, group_size, check_double_quant=False)
                for p in precisions - {"full"}:
                    tiers[p] = m.tier(BITS[p])
            else:
                for p in precisions - {"full"}:
                    bits = BITS[p]
                    if bits == 8:
                        tiers[p] = quantize(
                            w,
                            8,
                            int8_group_size,
                            scale_dtype=torch.float32 if int8_group_size is None else torch.float16,
                            check_double_quant=False,
                        )
                    else:
                        tiers[p] = quantize(
                            w, bits, group_size, symmetric=symmetric, check_double_quant=False
                        )
        return cls(shape=tuple(w.shape), tiers=tiers, matryoshka=m)

    def prepare(self, dtype: torch.dtype) -> None:
        """Build kernel layouts of every non-released packed tier for activations of ``dtype``
        (float-activation tiers prepare the kernels the autotuned dispatch picks, on use)."""
        for name, p in self.tiers.items():
            if name not in self.released and isinstance(p, PackedWeight):
                for path in dispatch_paths(p, dtype):
                    prepare(p, dtype, path)

    def release(self, precision: str) -> None:
        p = self.tiers[precision]
        if isinstance(p, FLOAT_TIERS):
            p.release()  # kernel layouts go; the fp16 / int8 tensors stay
        elif p.device.type != "cpu":
            self.tiers[precision] = p.to("cpu")
        elif self.matryoshka is not None and BITS[precision] != 8:
            self.matryoshka.tiers.pop(BITS[precision], None)  # rebuilt from the int8 bits
            self.tiers[precision] = None
        else:
            p.prepared.clear()
        self.released.add(precision)

    def restore(self, precision: str, device: torch.device, dtype: torch.dtype) -> None:
        p = self.tiers[precision]
        if isinstance(p, FLOAT_TIERS):
            self.released.discard(precision)  # kernels are re-bound on their next call
            return
        if p is None:
            p = self.tiers[precision] = self.matryoshka.tier(BITS[precision])
        if p.device != device:
            p = self.tiers[precision] = p.to(device)
        for path in dispatch_paths(p, dtype):
            prepare(p, dtype, path)
        self.released.discard(precision)

    def resident_bytes(self, precision: str) -> int:
        """Device bytes one tier adds (its codes, scales and prepared kernel layouts).

        A Matryoshka int8 tier is the shared storage (see :meth:`shared_bytes`); only its
        prepared scales are its own.
        """
        p = self.tiers[precision]
        if isinstance(p, W8A16Weight):
            return p.resident_bytes()
        if isinstance(p, FLOAT_TIERS):
            return (
                p.nbytes
                + sum(
                    t.numel() * t.element_size()
                    for t in p.prepared.values()
                    if isinstance(t, torch.Tensor)
                )
                + (
                    p.nbytes
                    if any(not isinstance(t, torch.Tensor) for t in p.prepared.values())
                    else 0
                )
            )  # FBGEMM / oneDNN packed copies: about the format's own size
        if p is None or (precision in self.released and p.device.type != "cpu"):
            return 0
        if self.matryoshka is not None and p is self.matryoshka.base:
            return _tensor_bytes(p.prepared) - _tensor_bytes(
                [t for t in p.prepared.values() if _shares(t, p)]
            )
        return packed_resident_bytes(p)

    def shared_bytes(self) -> int:
        """The Matryoshka int8 storage (shared by all its tiers), 0 for independent tiers."""
        return packed_resident_bytes(self.matryoshka.base) if self.matryoshka else 0
