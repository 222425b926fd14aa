"""River-LLM's Exit River (sec. 4.1-4.2): 4-bit copies of the backbone's deep layers that share
its KV cache.

A decode token that exits after block ``l`` does not stop: it runs blocks ``l+1 .. L`` through
weight-only int4 copies of their linears (the precision issue's packed weights and kernels) and
the backbone's own norms, rotary embedding and attention module, so its K/V land in the same
paged-cache slots the backbone would have written, and the final norm and LM head see it as any
other token. Every slot therefore has K/V at every layer (the depth record says L); what the
token saved is the full-precision weights of the layers it ran in the river.

One step runs each layer once for the whole batch: rows still in the backbone use the float
linears, river rows the int4 ones, and attention (one call, the step's own metadata) is shared.
No row leaves the batch, so no attention metadata is sliced.

Quantizer: group-wise min/max asymmetric (``symmetric=False``, the Q4_1 grid the default model's
weights were distributed on, so the river is nearly lossless there) or symmetric absmax, which
is not on that grid. HQQ's optimised zero points are not implemented.

Backbone offloading (sec. 4.2): the backbone's float linears of the river's layers are written
to a file and memory-mapped; their resident copies (vLLM's prepacked oneDNN weights on CPU) are
dropped, so they cost memory only when a token does not exit and the pages are read back.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vllm_adaptive.config import LAYER_MODULES
from vllm_adaptive.kernels.packed import PackedWeight
from vllm_adaptive.kernels.weight_op import weight_linear_op
from vllm_adaptive.kernels.weights import Weight, autotune_weight, linear, quantize_weight
from vllm_adaptive.precision.tiers import packed_resident_bytes

if TYPE_CHECKING:
    from vllm_adaptive.models.interface import LayerParts

logger = logging.getLogger("vllm.adaptive.depth")

#: the block's linears the river keeps reduced copies of (every managed linear of a layer)
LINEARS = LAYER_MODULES


@dataclass
class RiverLayer:
    index: int  # 0-based backbone layer index
    packed: dict[str, Weight]  # "qkv_proj" ... -> reduced-precision copy


class ExitRiver:
    def __init__(
        self,
        layers: Sequence[LayerParts],
        entry_layer: int,
        group_size: int,
        symmetric: bool,
        precision: str = "int4",
    ) -> None:
        """Quantize the linears of blocks ``entry_layer+1 .. L`` (0-based ``entry_layer ..
        L-1``); run after the weights are loaded. ``group_size`` and ``symmetric`` apply to
        int4; int8 is per-row symmetric (the packed kernel's layout), w8a8 per-row symmetric
        weights with per-token activations, fp16 the weight rounded."""
        require_recipes(layers[entry_layer:], "the Exit River (and the low-bit draft)")
        self.entry_layer = entry_layer
        self.precision = precision
        self.group_size = group_size if precision == "int4" else None
        self.symmetric = symmetric or precision != "int4"
        self.layers: dict[int, RiverLayer] = {}
        for i in range(entry_layer, len(layers)):
            packed = {}
            for name in LINEARS:
                w = layers[i].linear(name).weight.detach()
                packed[name] = quantize_weight(w, precision, self.group_size, self.symmetric)
                autotune_weight(packed[name])
            self.layers[i] = RiverLayer(i, packed)
        self.offloaded: dict[str, int] = {}
        self.offload_file: str | None = None
        self._offload_dir: tempfile.TemporaryDirectory | None = None

    @property
    def quantizer(self) -> str:
        if self.precision == "int8":
            return "int8 per-row sym absmax"
        if self.precision == "w8a8":
            return "w8a8 per-row sym, per-token activations"
        if self.precision == "w8a16":
            return "w8a16 per-row sym, two-plane per-token activations"
        if self.precision == "fp16":
            return "fp16"
        kind = "sym absmax" if self.symmetric else "asym min/max"
        return f"int4 g{self.group_size} {kind}"

    def resident_bytes(self) -> int:
        return sum(
            packed_resident_bytes(p) if isinstance(p, PackedWeight) else p.resident_bytes()
            for r in self.layers.values()
            for p in r.packed.values()
        )

    # -- one layer, backbone rows and river rows together ----------------------------------------
    def _mixed(self, layer: LayerParts, name: str, x: torch.Tensor, river: torch.Tensor, backbone):
        """The linear ``name`` for every row: float weights for ``backbone`` rows, int4 for
        ``river`` rows (index tensors into ``x``)."""
        lin = layer.linear(name)
        packed = self.layers[layer.index].packed[name]
        # every row in the river (backbone None): no gather
        xr = x if backbone is None else x.index_select(0, river)
        yr = linear(packed, xr)
        if lin.bias is not None:
            yr = yr + lin.bias
        if backbone is None:
            return yr
        out = x.new_empty(x.shape[0], yr.shape[1])
        out.index_copy_(0, river, yr)
        if backbone.numel():
            yb, _ = lin(x.index_select(0, backbone))
            out.index_copy_(0, backbone, yb)
        return out

    def forward_layer(
        self,
        layer: LayerParts,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        river: torch.Tensor,
        backbone: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's block with the linears split by row; ``backbone`` None: every row is a
        river row."""
        linears = {
            name: (lambda x, n=name: self._mixed(layer, n, x, river, backbone)) for name in LINEARS
        }
        return layer.recipe.run_with(layer, linears, positions, hidden, residual)

    def river_ops(
        self, layers: Sequence[LayerParts]
    ) -> list[dict[str, Callable[[torch.Tensor], torch.Tensor]]]:
        """Per river layer, each linear as a call of one opaque op on its reduced copy (bias
        added): what a compiled all-river pass (the low-bit self-draft) runs."""
        ops = []
        for i, river in sorted(self.layers.items()):
            per_layer = {}
            for name, weight in river.packed.items():
                op = weight_linear_op(weight)
                bias = layers[i].linear(name).bias
                per_layer[name] = op if bias is None else (lambda x, f=op, b=bias: f(x) + b)
            ops.append(per_layer)
        return ops

    # -- backbone offloading ------------------------------------------------------------------
    def map_backbone(self, layers: Sequence[LayerParts], directory: str | None = None) -> None:
        """At load time (float weights still there): write the backbone's float linears of the
        river's layers to a file and keep a memory-mapped view of each on its linear."""
        tensors = {
            f"{i}.{name}": layers[i].linear(name).weight.detach().clone()
            for i in self.layers
            for name in LINEARS
        }
        if directory is None:
            self._offload_dir = tempfile.TemporaryDirectory(prefix="vllm-adaptive-offload-")
            directory = self._offload_dir.name
        path = os.path.join(directory, f"backbone-{os.getpid()}.pt")
        torch.save(tensors, path)
        moved = sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
        mapped = torch.load(path, mmap=True, weights_only=True)
        for i in self.layers:
            for name in LINEARS:
                layers[i].linear(name)._adaptive_mapped = mapped[f"{i}.{name}"]
        self.offloaded = {"offloaded_backbone_bytes": moved}
        self.offload_file = path

    def offload_backbone(self, layers: Sequence[LayerParts]) -> None:
        """After vLLM's weight processing: drop the resident copies (prepacked CPU GEMM
        handles, float weights) and run those linears on the mapped weights."""
        done = 0
        for i in self.layers:
            for name in LINEARS:
                lin = layers[i].linear(name)
                mapped = getattr(lin, "_adaptive_mapped", None)
                if mapped is not None:
                    _map_linear(lin, mapped)
                    del lin._adaptive_mapped
                    done += 1
        if done:
            logger.info(
                "vllm-adaptive river: %.1f MB of backbone weights (blocks %d-%d) offloaded to %s",
                self.offloaded["offloaded_backbone_bytes"] / 1e6,
                min(self.layers) + 1,
                max(self.layers) + 1,
                self.offload_file,
            )


def require_recipes(layers: Sequence[LayerParts], what: str) -> None:
    """Refuse, naming ``what``, layers whose model file gives no block recipe (the block is
    re-run from its parts, so another layout would compute another function)."""
    for layer in layers:
        layer.require_recipe(what)


def _map_linear(lin: Any, weight: torch.Tensor) -> None:
    """Point a vLLM linear at a mapped float weight, dropping its prepacked copy."""
    lin.weight = torch.nn.Parameter(weight, requires_grad=False)
    if hasattr(lin, "cpu_linear"):
        lin.cpu_linear = lambda x, _w, bias, m=weight: F.linear(x, m, bias)
