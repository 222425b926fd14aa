"""vLLM's side of a geared linear: the quant method installed over a linear layer after its
weights load, which hands the layer's calls to its `GearedLinear` (`precision/linear.py`).
A subclass of vLLM's `LinearMethodBase`, so it is glue, not mechanism."""

from __future__ import annotations

import torch

from vllm_adaptive.engine.vllm_api import LinearMethodBase
from vllm_adaptive.kernels import native
from vllm_adaptive.precision.linear import GearedLinear


class GearedLinearMethod(LinearMethodBase):
    """Replaces a linear layer's quant method; the original one still serves the full gear."""

    def __init__(self, geared: GearedLinear) -> None:
        self.geared = geared
        # the C++ op a compiled graph calls (``geared_linear_routed``), set by ``use_route`` once
        # dispatch is measured and the layer's tiers are registered; None: the Python op only
        self.route_op = None

    def use_route(self) -> bool:
        """Let compiled graphs call the C++ route op where the layer registered a precision
        with it (after autotune)."""
        ops = native.geared_routes() if self.geared.route() else None
        self.route_op = None if ops is None else ops.geared_linear_routed
        return self.route_op is not None

    def create_weights(self, *args, **kwargs):  # pragma: no cover - installed after loading
        raise RuntimeError("GearedLinearMethod is installed after weights are created")

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.geared.keep_full:
            self.geared.base_method.process_weights_after_loading(layer)
            # the float weight's GEMM is bound now: time it against the packed tiers, and
            # register its handle and the rows it takes with the C++ route
            self.geared.measure_full_from()
            self.use_route()
        else:
            # No gear of this layer runs the float weight: free it.
            layer.weight = torch.nn.Parameter(
                torch.empty(0, dtype=layer.weight.dtype, device=layer.weight.device),
                requires_grad=False,
            )

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if x.dim() == 2 and not torch.compiler.is_compiling():
            g = self.geared  # eager: skip the op dispatch (~10 us per call)
            return g.fast(x) if g.fast is not None else g.forward(x)
        lead = x.shape[:-1]
        g, x2 = self.geared, x.reshape(-1, x.shape[-1])
        if self.route_op is not None:  # C++ while every row runs a registered precision
            out = self.route_op(x2, g.uniform_routed, g.index, g.tiers.shape[0])
        else:
            out = torch.ops.vllm_adaptive.geared_linear(x2, g.index, g.tiers.shape[0])
        return out.reshape(*lead, out.shape[-1])
