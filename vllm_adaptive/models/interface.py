"""The one model interface the adaptive mechanisms use (issue 16, item 1).

In the spirit of vLLM's ``SupportsEagle3``: an adaptive model class says it supports the
mechanisms (:class:`SupportsAdaptive`) and hands out its parts (:class:`ModelParts`): the
embedding, the decoder layers, the final norm and the LM head, and per layer
(:class:`LayerParts`) its managed linears, attention, norms and rotary embedding. The depth
runtime, the self-drafts and the precision gears read these parts and never a module attribute
of a particular architecture, so a new architecture is one file in ``models/`` that fills them
in (``llama.py``, ``gemma3.py``, ``moefied_llama.py``).

What a part may be called with is vLLM's own contract for that module (norms take ``(x)`` or
``(x, residual)``, linears return ``(y, bias)``, the rotary embedding ``(positions, q, k)``);
the interface only says where the module is. Parts an architecture lacks are ``None``. A
mechanism that runs a block with something changed (other linears, adapter deltas, only its K/V)
asks the layer's :attr:`LayerParts.recipe`, which the architecture's model file defines once
(``llama.py``: :class:`~vllm_adaptive.models.llama.LlamaBlockRecipe`); a layer without one
cannot run those mechanisms.

Imported by mechanisms only under ``TYPE_CHECKING`` (``models/`` imports the mechanisms), so
it holds no behaviour a mechanism must import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import torch
from torch import nn

from vllm_adaptive.config import LAYER_MODULES

#: The managed linears of a layer by vLLM's fused module name, the names
#: ``adaptive.precision.modules`` uses (its ``lm_head`` is :attr:`ModelParts.head`).
LINEAR_NAMES: tuple[str, ...] = LAYER_MODULES


class BlockDeltas(Protocol):
    """Additive corrections inside a block (M2R2's adapters): to the queries from the block's
    normed input, to the attention output projection, to the MLP output."""

    def q(self, x: torch.Tensor) -> torch.Tensor: ...

    def o(self, attn_out: torch.Tensor) -> torch.Tensor: ...

    def mlp(self, y: torch.Tensor) -> torch.Tensor: ...


class BlockRecipe(Protocol):
    """An architecture's decoder block computed from a layer's parts, with what the mechanisms
    change in it; defined once per architecture, in its model file."""

    name: str

    def run_with(
        self,
        layer: LayerParts,
        linears: Mapping[str, Callable[[torch.Tensor], torch.Tensor]],
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block with its managed linears replaced by ``linears`` (name -> ``x -> y``)."""
        ...

    def run_accelerated(
        self, layer: LayerParts, deltas: BlockDeltas, positions: torch.Tensor, p: torch.Tensor
    ) -> torch.Tensor:
        """The block on an unfused residual stream ``p`` with ``deltas`` added."""
        ...

    def kv_from_state(
        self, layer: LayerParts, state: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V this layer would write for residual stream ``state`` at ``positions``."""
        ...


@dataclass(frozen=True)
class LayerParts:
    """One decoder layer as the mechanisms see it."""

    index: int  # 0-based layer index in the whole model
    block: nn.Module  # the layer: block(positions, hidden, residual) -> (hidden, residual)
    attention: nn.Module  # its self-attention (projections, rotary, attention layer)
    attn: nn.Module  # vLLM's attention layer: KV cache, layer_name, backend
    rotary: nn.Module  # rotary(positions, q, k) -> (q, k)
    q_size: int  # width of this worker's queries (heads * head_dim)
    kv_size: int  # width of its keys and of its values
    input_norm: nn.Module
    post_attention_norm: nn.Module
    #: managed linears by :data:`LINEAR_NAMES` name (a MoE layer has only the attention ones)
    linears: Mapping[str, nn.Module]
    mlp: nn.Module  # the feed-forward module: mlp(x) -> y
    act_fn: Callable[[torch.Tensor], torch.Tensor] | None = None  # gate_up -> down input
    pre_feedforward_norm: nn.Module | None = None  # Gemma 3: norm of the MLP input
    post_feedforward_norm: nn.Module | None = None  # Gemma 3: norm of the MLP output
    q_norm: nn.Module | None = None  # Gemma 3: per-head norm of queries
    k_norm: nn.Module | None = None  # Gemma 3: per-head norm of keys
    sliding_window: int | None = None  # tokens a query sees; None: global attention
    experts: nn.Module | None = None  # MoEfied: the routed experts that replace the MLP
    #: ``block`` compiled for any token count (``models/compiled_blocks.py``); None: eager
    compiled: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    #: the block from these parts with something changed; None: this layer cannot (see
    #: :class:`BlockRecipe`)
    recipe: BlockRecipe | None = None

    def run_block(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole layer for these tokens: the compiled block where the engine compiles."""
        fn = self.compiled if self.compiled is not None else self.block
        return fn(positions, hidden, residual)

    def require_recipe(self, what: str) -> BlockRecipe:
        """The layer's recipe, or an error naming ``what`` needs one."""
        if self.recipe is None:
            raise ValueError(
                f"{what} runs the decoder block from its parts; layer {self.index} has no block "
                "recipe in its model file (extra norms, query/key norms, sliding window or "
                "experts)"
            )
        return self.recipe

    def linear(self, name: str) -> nn.Module:
        """The managed linear ``name``; a clear error where this layer has none."""
        lin = self.linears.get(name)
        if lin is None:
            raise KeyError(
                f"layer {self.index} has no managed linear {name!r} (it has {sorted(self.linears)})"
            )
        return lin

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of the fused ``qkv_proj`` output."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v


@dataclass(frozen=True)
class ModelParts:
    """A loaded model as the mechanisms see it (this pipeline stage's layers)."""

    #: token ids -> the first residual stream (the embedding times ``embedding_scale``)
    embed: Callable[[torch.Tensor], torch.Tensor]
    embedding: nn.Module  # the token embedding table
    layers: tuple[LayerParts, ...]  # this stage's decoder layers, ascending
    final_norm: nn.Module  # final_norm(hidden, residual) -> (normed, residual)
    head: nn.Module  # the LM head (tied to ``embedding`` on tied models)
    num_layers: int  # decoder layers of the whole model
    hidden_size: int
    vocab_size: int
    embedding_scale: float | None = None  # Gemma 3: sqrt(hidden); None: unscaled
    info: dict[str, Any] = field(default_factory=dict)  # architecture notes for logs
    #: every layer's block and the final norm in one compiled graph
    #: (``models/compiled_blocks.py``); None: eager
    compiled_stack: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    #: ``(start, end, graph)``: layers ``start .. end - 1`` in one compiled graph, consecutive
    #: spans covering the stack, cut where the depth runtime decides (its probe layers); empty
    #: where nothing asked for them or the engine runs eagerly
    spans: tuple[tuple[int, int, Callable[..., tuple[torch.Tensor, torch.Tensor]]], ...] = ()

    def run_stack(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer and the final norm for these tokens: ``(output, residual stream)``, one
        compiled graph where the engine compiles (the norm inside it, as in vLLM's graph)."""
        if self.compiled_stack is not None:
            return self.compiled_stack(positions, hidden, residual)
        for layer in self.layers:
            hidden, residual = layer.run_block(positions, hidden, residual)
        return self.final_norm(hidden, residual)

    @property
    def layer_names(self) -> list[str]:
        """vLLM's attention layer names (the keys of the forward context's metadata)."""
        return [layer.attn.layer_name for layer in self.layers]

    def managed_linears(self, names: tuple[str, ...]) -> list[tuple[int, str, nn.Module]]:
        """``(layer index, fused name, linear)`` of the named managed linears of every layer, in
        layer order; the fused name is ``layers.{i}.{name}`` (smoothing profiles key by it)."""
        return [
            (layer.index, f"layers.{layer.index}.{name}", layer.linears[name])
            for layer in self.layers
            for name in names
            if name in layer.linears
        ]


@runtime_checkable
class SupportsAdaptive(Protocol):
    """A model class the adaptive mechanisms run on."""

    supports_adaptive: ClassVar[Literal[True]] = True

    def adaptive_parts(self) -> ModelParts:
        """The model's parts (built once, after construction; the same modules stay in place
        when weights load, gears swap quant methods or the river maps weights)."""
        ...


def supports_adaptive(model: object) -> bool:
    return isinstance(model, SupportsAdaptive)


def model_parts(model: object) -> ModelParts:
    """``model.adaptive_parts()``, or an error naming the class that lacks the interface."""
    if not supports_adaptive(model):
        raise TypeError(
            f"{type(model).__name__} does not implement vllm_adaptive.models.interface."
            "SupportsAdaptive (adaptive_parts); the adaptive mechanisms run only on models "
            "that do"
        )
    return model.adaptive_parts()  # type: ignore[attr-defined]
