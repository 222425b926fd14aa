"""A geared linear layer: one linear that runs the precision its tokens' gear names.

The model glue (`models/geared_linear_method.py`) installs it over a vLLM linear layer's
``quant_method`` after weights load; that method's ``apply`` calls one custom op,
``torch.ops.vllm_adaptive.geared_linear(x, index, out_features)``, so that a compiled model
graph (vLLM's torch.compile) keeps the call opaque and the gear is read at run time from the
step plan, not frozen into the graph. Inside the op the tokens of the step are grouped by the
precision their gear level maps to in this layer's group, each group is multiplied by its packed
tier through :func:`vllm_adaptive.kernels.matmul.matmul` (``full``: the layer's own method;
``fp16`` / ``w8a8``: the float-activation kernels of :mod:`vllm_adaptive.kernels.float_linear`,
the kernel chosen per token count by the machine's measured dispatch table; W8A8 / W8A16 on bf16
activations: the AMX int8 GEMM where the CPU has one), and the results are
scattered back in token order; rows at W8A8 and W8A16 on shared int8 codes run as one oneDNN
GEMM (:func:`~vllm_adaptive.kernels.float_linear.nested_w8a8_w8a16`). The LM head is geared the
same way (its tiers are copies: the embedding it may be tied to keeps its float weight).

While every row of a step runs the fp16 tier, a compiled graph skips the Python op: it calls
``vllm_adaptive_native::geared_fp16_linear`` (``kernels/csrc/fp16_linear.cpp``), which reads the
layer's ``uniform_fp16`` flag and runs the measured kernel for the row count in C++; with the
flag clear it calls the Python op above (``GearedLinear.route`` says what it needs).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable

import torch

from vllm_adaptive.kernels import native
from vllm_adaptive.kernels.autotune import BUCKETS
from vllm_adaptive.kernels.float_linear import Fp16Weight, W8A16Weight, nested_w8a8_w8a16
from vllm_adaptive.kernels.weights import (
    HALF_DTYPES,
    autotune_weight,
    half_call,
    kernel_name,
    linear,
)
from vllm_adaptive.precision.tiers import LinearTiers

#: the op's ``index`` -> its layer; weak, so that a finished engine's layers are freed with it
_LINEARS: weakref.WeakValueDictionary[int, GearedLinear] = weakref.WeakValueDictionary()
_NEXT_INDEX = itertools.count()
_LIB = torch.library.Library("vllm_adaptive", "FRAGMENT")  # noqa: TID251 - our own namespace


class GearedLinear:
    """Mechanism for one linear layer: its tiers and its level -> precision map."""

    def __init__(
        self,
        layer: torch.nn.Module,
        name: str,
        level_precisions: tuple[str, ...],
        tiers: LinearTiers,
        base_method,
        controller,
    ) -> None:
        self.layer = layer
        self.name = name
        self.level_precisions = level_precisions  # index: code (0 low, 1 mid, 2 high, 3 off)
        self.tiers = tiers
        self.base_method = base_method
        self.controller = controller
        self.keep_full = True  # mode "off" requests run the float weight on any engine
        w = layer.weight
        self.full_bytes = w.numel() * w.element_size()
        self.nested_calls = 0  # mixed W8A8 / W8A16 batches served by one GEMM
        # ``x -> y`` at the one precision every row of this step runs (set by the controller
        # each time that changes); None: rows may differ, ``forward`` groups them
        self.fast: Callable[[torch.Tensor], torch.Tensor] | None = None
        # 1 while ``fast`` is the fp16 tier: what the compiled graph's C++ op reads (``route``)
        self.uniform_fp16 = torch.zeros(1, dtype=torch.uint8)
        self.index = next(_NEXT_INDEX)
        _LINEARS[self.index] = self

    def set_uniform(self, precision: str | None) -> None:
        """Every row of the coming steps runs ``precision`` (None: rows may differ)."""
        self.fast = None if precision is None else self.call_for(precision)
        self.uniform_fp16[0] = int(precision == "fp16" and self.fast is not None)

    def route(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
        """What ``torch.ops.vllm_adaptive_native.geared_fp16_linear`` needs to run this
        layer's fp16 tier without a Python frame (its native and FBGEMM layouts, and per row
        count up to the last dispatch bucket whether the native kernel runs), or None where it
        cannot: no fp16 tier, a bias, tiers that come and go, or no native kernel here."""
        tier = self.tiers.tiers.get("fp16")
        if not isinstance(tier, Fp16Weight) or self.layer.bias is not None:
            return None
        if self.controller is not None and self.controller.config.offload_inactive:
            return None
        if native.geared_fp16_linear_op() is None:
            return None
        # index: row count (0 rows: the native kernel returns the empty result)
        names = ["native_fp16"]
        names += [kernel_name(tier, m, torch.float32) for m in range(1, BUCKETS[-1] + 1)]
        if not set(names) <= {"native_fp16", "fbgemm_fp16"}:
            return None
        for name in set(names):
            tier.prepare(name)
        fbgemm = tier.prepared.get("fbgemm_fp16") if "fbgemm_fp16" in names else None
        if "fbgemm_fp16" in names and not isinstance(fbgemm, torch.Tensor):
            return None  # TorchScript-packed FBGEMM (older torch): the Python op calls it
        native_rows = torch.tensor([n == "native_fp16" for n in names], dtype=torch.uint8)
        return tier.prepared["native_fp16"], fbgemm, native_rows

    def call_for(self, precision: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """The whole layer at ``precision`` as one callable: the hot path of a step whose rows
        all run one gear (one Python frame between the op and the kernel's dispatch)."""
        bias = self.layer.bias
        if precision == "full":
            return functools.partial(self.base_method.apply, self.layer, bias=bias)
        packed = self.tiers.tiers[precision]
        if packed is None or precision in self.tiers.released:
            return functools.partial(self.run, precision=precision)
        if bias is None:
            return functools.partial(linear, packed)
        return lambda x: linear(packed, x) + bias

    def autotune(self, max_tokens: int) -> None:
        """Measure this layer's float-activation tiers' kernels (once per precision and shape
        on this machine; the table is cached on disk)."""
        half = self.layer.weight.dtype in HALF_DTYPES
        for tier in self.tiers.tiers.values():
            if tier is None or (half and half_call(tier) is not None):
                continue  # bf16 rows of this tier run its one half-precision kernel
            autotune_weight(tier, max_tokens, self.layer.weight.dtype)

    def run(self, x: torch.Tensor, precision: str) -> torch.Tensor:
        bias = self.layer.bias
        if precision == "full":
            return self.base_method.apply(self.layer, x, bias)
        packed = self.tiers.tiers[precision]
        if packed is None or precision in self.tiers.released:
            self.tiers.restore(precision, x.device, x.dtype)
            packed = self.tiers.tiers[precision]
        y = linear(packed, x)
        return y + bias if bias is not None else y

    @property
    def nested(self) -> bool:
        """W8A8 and W8A16 share this layer's int8 codes: one GEMM serves a batch of both."""
        w = self.tiers.tiers.get("w8a16")
        return isinstance(w, W8A16Weight) and w.shared

    def run_nested(self, x: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        """The step's W8A8 rows and its W8A16 rows ``high`` in one GEMM (oneDNN's symmetric
        per-token quantizer for both: a single W8A8 row that dispatch would give FBGEMM's
        asymmetric one may round one step differently)."""
        self.nested_calls += 1
        for precision in ("w8a8", "w8a16"):
            if precision in self.tiers.released:
                self.tiers.restore(precision, x.device, x.dtype)
        xc = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        y = nested_w8a8_w8a16(self.tiers.tiers["w8a16"], xc, high).to(x.dtype)
        bias = self.layer.bias
        return y + bias if bias is not None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = self.controller.groups(self.level_precisions, x.shape[0])
        if len(groups) == 1:
            return self.run(x, groups[0][0])
        if self.nested and {p for p, _ in groups} == {"w8a8", "w8a16"}:
            return self.run_nested(x, dict(groups)["w8a16"])
        out = x.new_empty(x.shape[0], self.tiers.shape[0])
        for precision, index in groups:
            out.index_copy_(0, index, self.run(x.index_select(0, index), precision))
        return out


def geared_linears() -> list[GearedLinear]:
    """Every live geared linear of this process, in creation order."""
    return [g for _, g in sorted(_LINEARS.items())]


def _geared_linear(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    g = _LINEARS[index]
    fast = g.fast
    return fast(x) if fast is not None else g.forward(x)


def _geared_linear_fake(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


_LIB.define("geared_linear(Tensor x, int index, int out_features) -> Tensor")
for _key in ("CPU", "CUDA"):
    _LIB.impl("geared_linear", _geared_linear, _key)
_LIB._register_fake("geared_linear", _geared_linear_fake)
