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
- the "early" self-draft, with vLLM's hybrid KV cache manager off (one KV cache group) and
  only sliding-window layers in the draft: the draft step gives every layer the attention
  metadata and settings of layer 0.

Everything else is refused when the engine starts (:func:`check_gemma3_supported`), with the
key and the reason: the depth runtime and the low-bit and M2R2 drafts re-run Llama's block from
its parts (Gemma's layers have no block recipe), assume its plain final RMSNorm and a single
KV cache group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from torch import nn

from vllm_adaptive.config import AdaptiveConfig, AdaptiveConfigError, adaptive_config_from_vllm
from vllm_adaptive.depth.kv_strategies import kv_strategy_class
from vllm_adaptive.engine.vllm_api import Gemma3ForCausalLM, VllmConfig
from vllm_adaptive.models.base import AdaptiveCausalLM, stack_parts
from vllm_adaptive.models.interface import LayerParts, ModelParts
from vllm_adaptive.models.llama import check_engine_compatible, llama_layer_parts

_DEPTH_REASON = (
    "adaptive.depth: the depth runtime supports Llama's layer layout only; Gemma 3 "
    "interleaves sliding-window and global attention layers, which vLLM keeps in separate KV "
    "cache groups with their own block tables (depth-peeling slices one), its final norm is "
    "(1 + w) * RMSNorm (the calibrated readouts assume a plain RMSNorm weight), and the "
    "{strategy!r} KV strategy {needs}"
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
        needs = kv_strategy_class(depth.kv_strategy).model_needs
        raise AdaptiveConfigError(_DEPTH_REASON.format(strategy=depth.kv_strategy, needs=needs))
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
            "layer 0's KV cache group, and vLLM's hybrid KV cache splits Gemma 3's layers into "
            "groups of one attention type (on Gemma 3 270M layer 0 shares its group only with "
            "layers 6 and 12), so draft layers would read and write other layers' cache; start "
            "the engine with disable_hybrid_kv_cache_manager=True "
            "(--disable-hybrid-kv-cache-manager): one group, one block table"
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
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._init_adaptive(vllm_config, adaptive)  # depth stays None: refused above

    def _build_parts(self) -> ModelParts:
        return stack_parts(
            self, gemma3_layer_parts, embedding_scale=float(self.config.hidden_size) ** 0.5
        )
