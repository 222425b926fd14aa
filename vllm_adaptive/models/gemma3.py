"""Adaptive Gemma 3: vLLM's Gemma 3 text model with the mechanisms that hold on its layout.

Gemma 3 differs from Llama in ways the mechanisms can see: the embedding is scaled by
sqrt(hidden); every norm is ``(1 + w) * RMSNorm(x)``; each block has four norms (input,
post-attention, pre- and post-feed-forward) and queries and keys have their own norms; five
sliding-window layers (window 512) alternate with one global layer, so vLLM keeps two KV cache
groups with their own block tables; the LM head is tied to a 262,144-token embedding.

What runs here, through vLLM's own Gemma 3 modules (inherited, not copied):

- every mechanism off (``{"adaptive": {}}``): vLLM's forward, token-identical to stock;
- precision gears: they swap the quant method of the four managed linears
  :func:`gemma3_layer_parts` names for the model interface (``models/interface.py``), which
  also hands out the extra norms, the query/key norms and each layer's sliding window;
- adaptive depth with the strategies that need only depth-peeling (``monotone``), vLLM's own
  blocks run whole (``models/depth_loop.py``) and vLLM's hybrid KV cache manager off (one KV
  cache group, so one block table and one slot per token for every layer; the sliding-window
  layers keep their window in the attention op);
- the "early" self-draft, with the hybrid KV cache manager off as well and only sliding-window
  layers in the draft: the draft step gives every layer the attention metadata and settings of
  layer 0.

Everything else is refused when the engine starts (:func:`check_gemma3_supported`), with the
key and the reason: the KV strategies and signals that re-run Llama's block from its parts
(Gemma's layers have no block recipe) or mask slots in the plugin's attention backend (which
has no sliding window), and the low-bit and M2R2 drafts.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

from torch import nn

from vllm_adaptive.config import AdaptiveConfig, AdaptiveConfigError, adaptive_config_from_vllm
from vllm_adaptive.depth.kv_strategies import kv_strategy_class
from vllm_adaptive.engine.vllm_api import (
    CompilationMode,
    Gemma3ForCausalLM,
    Gemma3Model,
    VllmConfig,
    ignore_torch_compile,
)
from vllm_adaptive.models.base import AdaptiveCausalLM, stack_parts
from vllm_adaptive.models.depth_loop import (
    DepthLayerLoop,
    attach_depth_runtime,
    install_depth_attention,
)
from vllm_adaptive.models.interface import LayerParts, ModelParts
from vllm_adaptive.models.llama import check_engine_compatible, llama_layer_parts

#: the KV strategies that need only depth-peeling over vLLM's own blocks (and, for mask, the
#: masked backend, which applies each layer's window)
GEMMA3_KV_STRATEGIES = ("monotone", "mask")
_HYBRID_KV = (
    "vLLM's hybrid KV cache splits Gemma 3's layers into groups of one attention type, each "
    "with its own block table (on Gemma 3 270M layer 0 shares its group only with layers 6 and "
    "12), so {what}; start the engine with disable_hybrid_kv_cache_manager=True "
    "(--disable-hybrid-kv-cache-manager): one group, one block table"
)


def first_global_layer(layer_types: Sequence[str]) -> int:
    """Index of the first layer whose attention type differs from layer 0's."""
    for i, kind in enumerate(layer_types):
        if kind != layer_types[0]:
            return i
    return len(layer_types)


def check_gemma3_supported(
    adaptive: AdaptiveConfig, layer_types: Sequence[str], hybrid_kv_cache: bool
) -> None:
    """Refuse, naming the key and why, every mechanism that does not hold on Gemma 3.

    ``hybrid_kv_cache``: vLLM's hybrid KV cache manager is on (its default on CPU), so the
    layers are split into KV cache groups of their own attention type.
    """
    depth = adaptive.active_depth
    if depth is not None:
        _check_gemma3_depth(depth, hybrid_kv_cache)
    spec = adaptive.active_speculative
    if spec is None:
        return
    if spec.draft == "lowbit":
        raise AdaptiveConfigError(
            'adaptive.speculative.draft: "lowbit" runs packed copies of Llama\'s decoder block; '
            "Gemma 3's block has four norms and query/key norms, so its draft would be another "
            'model (use "early")'
        )
    if spec.draft == "m2r2":
        raise AdaptiveConfigError(
            'adaptive.speculative.draft: "m2r2" adapters are trained and run on Llama\'s block '
            '(the accelerated stream re-implements it); on Gemma 3 use "early"'
        )
    if hybrid_kv_cache:
        raise AdaptiveConfigError(
            "adaptive.speculative: the draft step gives every layer the attention metadata of "
            "layer 0's KV cache group, and "
            + _HYBRID_KV.format(what="draft layers would read and write other layers' cache")
        )
    limit = first_global_layer(layer_types)
    layers = spec.layers or 4
    if layers > limit:
        raise AdaptiveConfigError(
            f"adaptive.speculative.layers: {layers} draft layers reach layer {limit}, Gemma 3's "
            f"first {layer_types[limit]} layer; the draft step gives every layer the attention "
            f"settings of layer 0 ({layer_types[0]}), so an early draft on Gemma 3 may use at "
            f"most {limit} layers"
        )


def _check_gemma3_depth(depth, hybrid_kv_cache: bool) -> None:
    """Refuse the depth settings that need more of the model than depth-peeling over vLLM's
    own blocks, naming the key."""
    if depth.kv_strategy not in GEMMA3_KV_STRATEGIES:
        needs = kv_strategy_class(depth.kv_strategy).model_needs
        raise AdaptiveConfigError(
            f"adaptive.depth.kv_strategy: {depth.kv_strategy!r} {needs}; on Gemma 3 (no block "
            f"recipe for its four-norm block, sliding-window layers) use one of "
            f"{list(GEMMA3_KV_STRATEGIES)}"
        )
    if "arla" in depth.signal.policy:
        raise AdaptiveConfigError(
            'adaptive.depth.signal: policy "arla" runs M2R2\'s accelerated stream through '
            "Llama's block recipe, which Gemma 3's block is not (use emad or quicksilver)"
        )
    if depth.refresh is not None:
        raise AdaptiveConfigError(
            "adaptive.depth.refresh: refreshing recomputes K/V from exit states through the "
            "block recipe, which Gemma 3's layers do not have"
        )
    if hybrid_kv_cache:
        raise AdaptiveConfigError(
            "adaptive.depth: the runtime peels rows on layer 0's attention metadata and records "
            "one depth per KV slot, and "
            + _HYBRID_KV.format(what="its slots would not be the other group's")
        )


def gemma3_layer_parts(index: int, layer: nn.Module) -> LayerParts:
    """The parts of vLLM's ``Gemma3DecoderLayer``: Llama's (vLLM names them alike) plus the
    feed-forward norms, the query/key norms and the layer's own sliding window. No block
    recipe: Gemma's block is not Llama's, and none is written for it yet."""
    attn = layer.self_attn
    return replace(
        llama_layer_parts(index, layer),
        pre_feedforward_norm=layer.pre_feedforward_layernorm,
        post_feedforward_norm=layer.post_feedforward_layernorm,
        q_norm=attn.q_norm,
        k_norm=attn.k_norm,
        recipe=None,
    )


@ignore_torch_compile
class EagerAdaptiveGemma3Model(DepthLayerLoop, Gemma3Model):
    """The decoder for adaptive depth on Gemma 3: the depth runtime owns the layer loop, so
    vLLM does not compile the forward as one graph; the runtime compiles the blocks itself
    (``models/compiled_blocks.py``) unless the engine runs eagerly."""


@contextmanager
def _builds_model_as(cls: type[nn.Module]) -> Iterator[None]:
    """vLLM's ``Gemma3ForCausalLM`` builds its decoder by the module's global name
    ``Gemma3Model`` (it has no ``_init_model`` hook as Llama has): that name is ``cls`` while
    the stock constructor runs, and vLLM's own class again after it."""
    module = sys.modules[Gemma3ForCausalLM.__module__]
    stock = module.Gemma3Model
    module.Gemma3Model = cls
    try:
        yield
    finally:
        module.Gemma3Model = stock


class AdaptiveGemma3ForCausalLM(AdaptiveCausalLM, Gemma3ForCausalLM):
    """Registered as "AdaptiveGemma3ForCausalLM"; chosen by the dispatcher when
    `additional_config` has an "adaptive" section."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        adaptive = adaptive_config_from_vllm(vllm_config) or AdaptiveConfig()
        check_engine_compatible(vllm_config, adaptive)
        check_gemma3_supported(
            adaptive,
            vllm_config.model_config.hf_config.layer_types,
            hybrid_kv_cache=not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        )
        depth = adaptive.active_depth
        self._compile_blocks = depth is not None and (
            vllm_config.compilation_config.mode != CompilationMode.NONE
        )
        if depth is None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        else:
            install_depth_attention(depth)
            with _builds_model_as(EagerAdaptiveGemma3Model):
                super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._init_adaptive(vllm_config, adaptive)
        if depth is not None:
            self.depth = attach_depth_runtime(self, self.adaptive_parts(), vllm_config, depth)

    def _build_parts(self) -> ModelParts:
        parts = stack_parts(
            self, gemma3_layer_parts, embedding_scale=float(self.config.hidden_size) ** 0.5
        )
        if getattr(self, "_compile_blocks", False):
            from vllm_adaptive.models.compiled_blocks import with_compiled_blocks

            parts = with_compiled_blocks(parts)
        return parts
