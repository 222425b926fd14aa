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

While every row of a step runs one precision, a compiled graph skips the Python op: it calls
``vllm_adaptive_native::geared_linear_routed`` (``kernels/csrc/geared_routes.cpp``), which
reads the layer's ``uniform_routed`` flag (the route code of the step's precision) and runs that
tier's C++ op (``geared_fp16_linear``, ``geared_int4_linear``, ``geared_int8_linear``: the
measured kernel for the row count) or, for the full gear, vLLM's own oneDNN GEMM of the layer;
with the flag clear it calls the Python op above. Each layer registers the tiers it can run in
C++ once (``GearedLinear.route``), so a policy whose gears change from step to step (GEARBX)
stays in C++ at every gear. The Python op costs 10-30 us a call (121 calls a step on the default
model).
"""

from __future__ import annotations

import functools
import inspect
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
#: fewest rows per call a packed tier hands to the layer's own weight: below it a step reads its
#: weights from memory, where fewer bytes win (AVX512-BF16 EPYC, a whole step's linears cold:
#: 4-bit 16.5 ms against oneDNN bf16 17.6 at 8 rows, 32 against 21 at 16); a single layer timed
#: in cache would undercount that
FULL_MIN_ROWS = 16
#: weights of at least this many bytes never stay in cache, so a single layer's timing is how it
#: runs in a step: for them the layer's own weight may take rows from 2 on (the LM head, 56 MB
#: in bf16: at 8 rows its int8 tier's FMA loop, 2.4 ms, loses to oneDNN's bf16 GEMM streaming
#: it; at 1 row the int8 tier reads it in 0.87 ms against about 1.9)
STREAMED_BYTES = 16 << 20
#: a packed tier hands rows to the layer's own weight only where it holds that weight up to
#: rounding: max |dequantized - weight| at most this share of max |weight| (the default model's
#: Q4_1 grid in int4 g32 asymmetric: 0.15-0.3%, bf16 rounding; symmetric int4: 6-7%). Else the
#: rows would compute another model than the gear, and a token's KV would depend on how many
#: rows shared its step.
FULL_SAME_WEIGHT_TOL = 0.01
_NEXT_INDEX = itertools.count()
#: ``uniform_routed``'s value while every row runs a precision the layer registered in C++
#: (csrc/geared_routes.cpp's codes); 0: the Python op
ROUTE_CODES = {"fp16": 1, "int4": 2, "int8": 3, "full": 4}
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
        # packed precision -> rows per call from which the layer's own weight runs instead
        # (measured faster there by ``autotune``: prompts, large batches); absent: never
        self.full_from: dict[str, int] = {}
        self.autotuned_rows = 0  # rows per call ``autotune`` measured up to
        w = layer.weight
        self.full_bytes = w.numel() * w.element_size()
        self.nested_calls = 0  # mixed W8A8 / W8A16 batches served by one GEMM
        # ``x -> y`` at the one precision every row of this step runs (set by the controller
        # each time that changes); None: rows may differ, ``forward`` groups them
        self.fast: Callable[[torch.Tensor], torch.Tensor] | None = None
        # the route code of ``fast``'s precision while C++ serves it: what the compiled graph's
        # op reads (``route``); 0: the Python op
        self.uniform_routed = torch.zeros(1, dtype=torch.uint8)
        self.routed: frozenset[str] = frozenset()  # precisions registered in C++ (``route``)
        self.uniform: str | None = None  # the precision every row of the coming steps runs
        self.index = next(_NEXT_INDEX)
        _LINEARS[self.index] = self
        # the packed tiers that give the layer's weight back up to rounding, checked now: once
        # vLLM's CPU method has processed its weights a bf16 layer's weight lives only in
        # oneDNN's packed handle (``layer.weight`` is emptied)
        self.holding_weight = {
            p for p, t in tiers.tiers.items() if _is_cpu_packed(t) and _holds_weight(t, w)
        }

    def set_uniform(self, precision: str | None) -> None:
        """Every row of the coming steps runs ``precision`` (None: rows may differ)."""
        self.uniform = precision
        self.fast = None if precision is None else self.call_for(precision)
        self._flag_routed()

    def _flag_routed(self) -> None:
        routed = self.uniform in self.routed and self.fast is not None
        self.uniform_routed[0] = ROUTE_CODES[self.uniform] if routed else 0

    def route(self) -> bool:
        """Register with the C++ op ``geared_linear_routed`` every precision of this layer it
        can run without a Python frame (the fp16, int4 and int8 tiers' kernel layouts and, per
        row count, the measured dispatch table, flattened; the full gear's oneDNN handle where
        vLLM's CPU linear holds one), replacing an earlier registration; False where none can
        be: no native kernels here, tiers that come and go, a bias on a packed tier, or a
        dispatch that picks a path the ops do not run."""
        ops = native.geared_routes()
        routed: set[str] = set()
        if ops is not None:
            ops.geared_route_clear(self.index)
            if not getattr(self, "_routes_finalizer", None):
                self._routes_finalizer = weakref.finalize(self, ops.geared_route_clear, self.index)
            offload = self.controller is not None and self.controller.config.offload_inactive
            precisions = set(self.level_precisions)
            for precision, args in (
                ("fp16", self._fp16_route),
                ("int4", self._int4_route),
                ("int8", self._int8_route),
            ):
                if offload or self.layer.bias is not None or precision not in precisions:
                    continue
                got = args()
                if got is not None:
                    getattr(ops, f"geared_route_{precision}")(self.index, *got)
                    routed.add(precision)
            handle = None if offload or "full" not in precisions else self._onednn_handle()
            if handle is not None:
                ops.geared_route_full(self.index, handle, self.layer.bias)
                routed.add("full")
        self.routed = frozenset(routed)
        self._flag_routed()
        return bool(routed)

    def _onednn_handle(self) -> torch.Tensor | None:
        """vLLM's oneDNN GEMM handle of this layer's own weight, which its CPU linear (set by
        the unquantized method on CPUs) closes over; None where the full gear runs otherwise."""
        if type(self.base_method).__name__ != "UnquantizedLinearMethod":
            return None
        fn = getattr(self.layer, "cpu_linear", None)
        code = getattr(fn, "__code__", None)
        if code is None or "onednn_mm" not in code.co_names:
            return None
        handler = inspect.getclosurevars(fn).nonlocals.get("handler")
        handle = getattr(handler, "handler_tensor", None)
        return handle if isinstance(handle, torch.Tensor) else None

    def _int4_route(self) -> tuple | None:
        from vllm_adaptive.kernels import matmul as mm

        tier = self.tiers.tiers.get("int4")
        dtype = self.layer.weight.dtype
        op = native.geared_int4_linear_op()
        if not isinstance(tier, mm.PackedWeight) or op is None or tier.device.type != "cpu":
            return None
        if dtype not in (torch.float32, torch.bfloat16) or "int4" in self.tiers.released:
            return None
        names = self._row_paths("int4", tier, dtype)
        if names is None or not set(names) <= {mm.NATIVE_INT4, mm.INT4PACK, "full"}:
            return None
        w4, scales, offsets = mm.prepared_native_int4(tier)
        int4pack = sz = None
        group = 0
        if mm.INT4PACK in names:
            int4pack, sz, group = mm.prepared_int4pack(tier, dtype)
        codes = {mm.INT4PACK: 0, mm.NATIVE_INT4: 1, "full": 2}
        native_rows = torch.tensor([codes[n] for n in names], dtype=torch.uint8)
        return w4, scales, offsets, int4pack, sz, group, native_rows

    def _row_paths(self, precision: str, tier, dtype: torch.dtype) -> list[str] | None:
        """The path a packed tier's rows take, by row count (index; the last entry serves every
        larger count: prefill rows), ``"full"`` from ``full_from`` on (the Python op runs the
        layer's own weight); None where the count beyond the table would take another path."""
        last = 2 * BUCKETS[-1]
        full_from = self.full_from.get(precision, 1 << 62)
        names = [
            "full" if m >= full_from else kernel_name(tier, max(m, 1), dtype)
            for m in range(last + 1)
        ]
        tail = "full" if full_from <= last else kernel_name(tier, 1 << 20, dtype)
        return names if tail == names[-1] else None

    def _int8_route(self) -> tuple | None:
        from vllm_adaptive.kernels import matmul as mm

        tier = self.tiers.tiers.get("int8")
        dtype = self.layer.weight.dtype
        op = native.geared_int8_linear_op()
        if not isinstance(tier, mm.PackedWeight) or op is None or tier.device.type != "cpu":
            return None
        if dtype not in (torch.float32, torch.bfloat16) or "int8" in self.tiers.released:
            return None
        names = self._row_paths("int8", tier, dtype)
        if names is None or not set(names) <= {mm.NATIVE_INT8, "full"}:
            return None
        w8, scales = mm.prepared_native_int8(tier)
        codes = {mm.NATIVE_INT8: 1, "full": 2}
        native_rows = torch.tensor([codes[n] for n in names], dtype=torch.uint8)
        return w8, scales, native_rows

    def _fp16_route(self) -> tuple | None:
        tier = self.tiers.tiers.get("fp16")
        op = native.geared_fp16_linear_op()
        if not isinstance(tier, Fp16Weight) or op is None:
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
        if packed is None or precision in self.tiers.released or precision in self.full_from:
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
        self.autotuned_rows = max_tokens

    def measure_full_from(self) -> None:
        """Where a packed tier holds the layer's own weight up to rounding (a gear on the
        checkpoint's grid: :data:`FULL_SAME_WEIGHT_TOL`) and its kernels lose to that weight at
        many rows (a bf16 engine's oneDNN GEMM against 4-bit kernels: 2x faster at 100 rows on
        an AVX512-BF16 EPYC, slower at 8), rows from the first bucket of :data:`FULL_MIN_ROWS`
        or more (2 or more for weights of :data:`STREAMED_BYTES`) where the float weight wins
        at every larger bucket run it. Once the layer's own method has processed its weights
        (vLLM's CPU GEMM is bound then)."""
        from vllm_adaptive.kernels import autotune
        from vllm_adaptive.kernels.packed import PackedWeight

        max_tokens = self.autotuned_rows
        w = self.layer.weight
        min_rows = 2 if self.full_bytes >= STREAMED_BYTES else FULL_MIN_ROWS
        if not self.keep_full or w.device.type != "cpu" or max_tokens < min_rows:
            return
        full = functools.partial(self.base_method.apply, self.layer, bias=None)
        table = autotune.table()
        for precision, tier in self.tiers.tiers.items():
            if not isinstance(tier, PackedWeight) or precision in self.tiers.released:
                continue
            if precision not in self.holding_weight:
                continue
            n, k = tier.shape
            key = f"full-vs-{tier.describe().replace(' ', '-')}:{n}x{k}"
            key += f":{str(w.dtype).removeprefix('torch.')}"
            kernels = {"full": full, "packed": functools.partial(linear, tier)}
            table.ensure(key, kernels, k, dtype=w.dtype, max_tokens=max_tokens)
            best = table.measured_bests(key)
            big = sorted(b for b in best if b >= min_rows)
            start = None
            for b in reversed(big):
                if best[b] != "full":
                    break
                start = b
            if start is not None:
                self.full_from[precision] = start
        table.save()

    def run(self, x: torch.Tensor, precision: str) -> torch.Tensor:
        bias = self.layer.bias
        if precision == "full" or x.shape[0] >= self.full_from.get(precision, 1 << 62):
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


def _is_cpu_packed(tier) -> bool:
    from vllm_adaptive.kernels.packed import PackedWeight

    return isinstance(tier, PackedWeight) and tier.device.type == "cpu"


def _holds_weight(tier, weight: torch.Tensor) -> bool:
    """Whether a packed tier reproduces ``weight`` up to :data:`FULL_SAME_WEIGHT_TOL`."""
    from vllm_adaptive.kernels.packed import dequantize

    w = weight.detach().float()
    if w.shape != tuple(tier.shape) or w.numel() == 0:
        return False
    err = float((dequantize(tier, torch.float32) - w).abs().max())
    return err <= FULL_SAME_WEIGHT_TOL * float(w.abs().max())


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
