"""Adaptive model classes, one file per architecture (as in vLLM)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptiveArchitecture:
    """How one stock vLLM architecture gains an adaptive twin."""

    stock: str  # architecture name in the HF config, e.g. "LlamaForCausalLM"
    adaptive: str  # name the adaptive class is registered under
    adaptive_cls: str  # "module:Class" of the adaptive class
    dispatch_cls: str  # "module:Class" registered over `stock`


ADAPTIVE_ARCHITECTURES: tuple[AdaptiveArchitecture, ...] = (
    AdaptiveArchitecture(
        stock="LlamaForCausalLM",
        adaptive="AdaptiveLlamaForCausalLM",
        adaptive_cls="vllm_adaptive.models.llama:AdaptiveLlamaForCausalLM",
        dispatch_cls="vllm_adaptive.models.dispatch:LlamaForCausalLMDispatch",
    ),
    AdaptiveArchitecture(
        stock="Gemma3ForCausalLM",
        adaptive="AdaptiveGemma3ForCausalLM",
        adaptive_cls="vllm_adaptive.models.gemma3:AdaptiveGemma3ForCausalLM",
        dispatch_cls="vllm_adaptive.models.dispatch:Gemma3ForCausalLMDispatch",
    ),
)
