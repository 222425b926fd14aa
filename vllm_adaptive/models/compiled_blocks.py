"""Decoder blocks compiled for mechanisms that run the stack layer by layer.

vLLM compiles a model's whole forward into one graph. Adaptive depth cannot use that graph:
which tokens run which layer is decided between layers. Run eagerly instead, each block pays
vLLM's per-op Python (custom-op dispatch, native norms, rotary) for every layer of every
step: 0.56-0.72x of the compiled stock step at one request on SmolLM2 with no token exiting
(docs/results.md, "adaptive depth on compiled blocks"). Compiling each block on its own keeps
inductor's fused norms, activation and rotary, with only the plan between blocks in Python.
Steps with nothing to decide between blocks (no row may exit: a budget of 1.0, prefill-only
steps, requests with adaptivity off) run the whole stack as one more graph, :class:`CompiledSpan`
over every block and the final norm: one call a step, as vLLM's own compiled forward, instead of
one per block
(through `vllm serve` on an AVX2 EPYC the 29 extra calls cost 1.3 ms of a 33 ms fp16 step).

Steps that decide (some row may stop at a probe layer) run the stack in spans, one graph per
stretch between two probe layers (:func:`with_compiled_spans`), where the signal needs no more
than the probe layer's output: half the graph calls of one per block at SmolLM2's 14 probes.

Each graph is compiled at vLLM's warm-up (the model's fallback path runs the same blocks), so no
request waits on it: one graph for any token count (dynamic shapes, traced size-oblivious) and
one for a single token (a decode step at one request), which the first graph's view shapes
exclude. (With vLLM's warm-up skipped, ``VLLM_CPU_CI_ENV``, the first steps compile them.)
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import types
import weakref
from collections.abc import Sequence

import torch
from torch import nn

from vllm_adaptive.models.interface import ModelParts


class CompiledSpan:
    """Consecutive blocks ``block(positions, hidden, residual)``, one after the other, through
    two compiled graphs, one for a single token and one for any other count;
    ``compile_seconds`` is the time :meth:`warm_up` took."""

    def __init__(self, blocks: Sequence[nn.Module], name: str) -> None:
        self.blocks = tuple(blocks)
        self._many = _DirectGraph(f"{name}_many", dynamic=None)  # the token dim, marked below
        self._one = _DirectGraph(f"{name}_one", dynamic=False)
        self._many_compiled = False
        self.compile_seconds: float | None = None

    def __call__(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if hidden.shape[0] == 1:
            return self._one(self.blocks, positions, hidden, residual)
        if not self._many_compiled:
            return self._compile_many(positions, hidden, residual)
        return self._many(self.blocks, positions, hidden, residual)

    def _compile_many(self, positions, hidden, residual):
        import torch.fx.experimental._config as fx_config

        # read while tracing. Size-oblivious: no guard (dropped, so silently assumed) that
        # the count is not 0 or 1; no duck shapes: no assumed equality between a sliced
        # input's buffer and the token count (vLLM's positions are a view of a longer one)
        old = fx_config.backed_size_oblivious, fx_config.use_duck_shape
        fx_config.backed_size_oblivious, fx_config.use_duck_shape = True, False
        # Only the token count varies, as in vLLM's graph: with every dim dynamic
        # (``dynamic=True``) inductor's kernels also took the hidden sizes at run time, and at
        # 8 rows the graph's own time was 1 ms a step over vLLM's (AMX Xeon, profiled)
        for t in (positions, hidden, residual):
            if t is not None:
                torch._dynamo.mark_dynamic(t, 0)
        try:
            out = self._many(self.blocks, positions, hidden, residual)
        finally:
            fx_config.backed_size_oblivious, fx_config.use_duck_shape = old
        self._many_compiled = True
        return out

    @property
    def direct(self) -> bool:
        """Both graphs compiled and called through their captured bytecode."""
        return self._many._direct is not None and self._one._direct is not None

    def warm_up(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Compile both graphs on a step where attention does not run (vLLM's warm-up, with
        more than one token); returns the output for all the tokens."""
        t0 = time.perf_counter()
        out = self(positions, hidden, residual)
        one = None if residual is None else residual[:1]
        self(positions[:1], hidden[:1], one)
        self.compile_seconds = time.perf_counter() - t0
        return out


#: inductor's options as vLLM's CPU platform sets them for its own graph
#: (``vllm/platforms/cpu.py``): no per-call size or NaN asserts in the generated code
INDUCTOR_OPTIONS = {
    "dce": True,
    "size_asserts": False,
    "nan_asserts": False,
    "epilogue_fusion": True,
    "cpp.dynamic_threads": True,
}


def _run(blocks, positions, hidden, residual):
    for block in blocks:
        hidden, residual = block(positions, hidden, residual)
    return hidden, residual


class _DirectGraph:
    """``_run`` compiled as one graph, then called through the bytecode dynamo made for it.

    Dynamo keeps compiled graphs per code object: every layer calling one shared function (or
    ``LlamaDecoderLayer.forward``) would share one cache, whose guards (the layer's attention
    name, a first layer without residual) fail from layer to layer until the recompile limit
    sends the rest back to eager; so each graph runs a code object of its own. And dynamo's
    cache look-up on each call cost 230 us a block here (7 ms of a 40 ms step at one request,
    more than the eager Python the graph removes), guards dropped or not. vLLM calls its own
    compiled forward through dynamo's transformed bytecode, as this does: nothing is checked
    per call, which holds by construction (a block always sees the same dtypes, with or
    without a residual, and the token count picks the graph).
    """

    def __init__(self, name: str, dynamic: bool | None) -> None:
        # a name of its own: code objects compare by content, so two engines' blocks of the
        # same name in one process would take each other's bytecode in ``_WAITING``
        name = f"{name}_{next(_SERIAL)}"
        code = _run.__code__.replace(co_name=name, co_qualname=name)
        fn = types.FunctionType(code, _run.__globals__, name)
        options = {**INDUCTOR_OPTIONS, "guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
        self._compiled = torch.compile(fn, dynamic=dynamic, fullgraph=True, options=options)
        self._direct: types.FunctionType | None = None
        _install_bytecode_hook()
        _WAITING[code] = self

    def __call__(self, *args):
        if self._direct is not None:
            return self._direct(*args)
        return self._compiled(*args)


#: code objects of graphs not compiled yet -> their graph (weak: a dead engine's go with it)
_WAITING: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_hook_installed = False
_SERIAL = itertools.count()


def _capture_bytecode(old_code: types.CodeType, new_code: types.CodeType) -> None:
    graph = _WAITING.pop(old_code, None)
    if graph is not None:
        graph._direct = types.FunctionType(new_code, _run.__globals__, old_code.co_name)


def _install_bytecode_hook() -> None:
    global _hook_installed
    if not _hook_installed:
        torch._dynamo.convert_frame.register_bytecode_hook(_capture_bytecode)
        _hook_installed = True


class _FinalNorm(nn.Module):
    """The model's final norm called as a block, so that the whole-stack graph ends with it
    (vLLM's compiled forward fuses it; run eagerly after the graph it cost 0.3 ms a step)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.norm(hidden, residual)


def with_compiled_blocks(parts: ModelParts) -> ModelParts:
    """The same parts, each layer's ``run_block`` going through a :class:`CompiledSpan` of its
    own, and ``run_stack`` through one over every layer and the final norm."""
    layers = tuple(
        dataclasses.replace(
            layer, compiled=CompiledSpan((layer.block,), f"adaptive_block_{layer.index}")
        )
        for layer in parts.layers
    )
    blocks = [layer.block for layer in parts.layers]
    stack = CompiledSpan([*blocks, _FinalNorm(parts.final_norm)], "adaptive_stack")
    return dataclasses.replace(parts, layers=layers, compiled_stack=stack)


def with_compiled_spans(parts: ModelParts, cuts: Sequence[int]) -> ModelParts:
    """The same parts with :attr:`ModelParts.spans`: the stack cut after each layer count in
    ``cuts`` (counts within ``1 .. len(layers) - 1``), each stretch one :class:`CompiledSpan`.
    The per-block graphs give way to them (a block runs eagerly where a step cannot use the
    spans): compiling both doubled the depth engine's warm-up (130 s against 61-64 s)."""
    n = len(parts.layers)
    bounds = [0, *sorted({c for c in cuts if 0 < c < n}), n]
    spans = tuple(
        (a, b, CompiledSpan([layer.block for layer in parts.layers[a:b]], f"adaptive_span_{a}_{b}"))
        for a, b in itertools.pairwise(bounds)
    )
    layers = tuple(dataclasses.replace(layer, compiled=None) for layer in parts.layers)
    return dataclasses.replace(parts, layers=layers, spans=spans)
