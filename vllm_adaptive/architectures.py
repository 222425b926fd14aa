"""The architectures that have an adaptive twin, and the classes that implement it.

Read by the model-registry entry of :mod:`vllm_adaptive.vllm_patches` (what to register), by the
dispatchers in ``models/dispatch.py`` and by the admission check that refuses an adaptive config
for any other architecture. Kept apart from ``models/`` (which imports every mechanism) so the
registry and the checks can read it without importing the model classes.
"""

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
