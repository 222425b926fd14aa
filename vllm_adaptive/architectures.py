"""The architectures that have an adaptive twin, the plugin's own architectures, and the classes
that implement them.

Read by the model-registry entry of :mod:`vllm_adaptive.engine.intrusions` (what to register),
by the dispatchers in ``models/dispatch.py`` and by the admission check that refuses an adaptive
config for any other architecture. Kept apart from ``models/`` (which imports every mechanism)
so the registry and the checks can read it without importing the model classes.
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


@dataclass(frozen=True)
class OwnArchitecture:
    """An architecture only the plugin implements (no stock vLLM class to dispatch from): its
    checkpoints name it in ``architectures`` and need the plugin to load at all. Registered as
    is; its class runs its reference form without an ``adaptive`` section."""

    name: str  # architecture name in the HF config and in vLLM's registry
    cls: str  # "module:Class"
    sections: tuple[str, ...]  # the adaptive config sections it supports


OWN_ARCHITECTURES: tuple[OwnArchitecture, ...] = (
    OwnArchitecture(
        name="MoefiedLlamaForCausalLM",
        cls="vllm_adaptive.models.moefied_llama:MoefiedLlamaForCausalLM",
        sections=("moe",),
    ),
)


#: EAGLE-3 draft-head architectures vLLM builds as ``Eagle3LlamaForCausalLM``: registered over
#: it with a subclass that runs the head's linears on the target's fixed fp16 gear (and is
#: vLLM's class otherwise: ``models/llama_eagle3.py``)
DRAFT_HEAD_ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
DRAFT_HEAD_CLS = "vllm_adaptive.models.llama_eagle3:AdaptiveEagle3LlamaForCausalLM"


def registry_entries() -> list[tuple[str, str]]:
    """(architecture name, "module:Class") for every ModelRegistry entry the plugin makes."""
    entries = []
    for arch in ADAPTIVE_ARCHITECTURES:
        entries += [(arch.adaptive, arch.adaptive_cls), (arch.stock, arch.dispatch_cls)]
    entries += [(arch.name, arch.cls) for arch in OWN_ARCHITECTURES]
    entries += [(name, DRAFT_HEAD_CLS) for name in DRAFT_HEAD_ARCHITECTURES]
    return entries


def supported_architectures() -> set[str]:
    """Every architecture name an adaptive config may be used with."""
    names = {a.stock for a in ADAPTIVE_ARCHITECTURES} | {a.adaptive for a in ADAPTIVE_ARCHITECTURES}
    return names | {a.name for a in OWN_ARCHITECTURES}
