"""Pick the stock or the adaptive model class from the engine's config.

vLLM resolves a model class from the checkpoint's architecture name before it
knows anything about our config, so the plugin registers a dispatcher over the
stock name. At construction the dispatcher reads `additional_config`:

- no "adaptive" key: it builds and returns vLLM's own class, untouched, so the
  engine is exactly stock vLLM;
- an "adaptive" key: it validates the config (a bad one fails engine start with
  a message naming the key) and returns the adaptive twin.

The dispatcher subclasses the stock class, so every class-level property vLLM
inspects (interfaces, weight mappers, LoRA/PP support) is the stock one.
Subclasses made by vLLM itself (e.g. pooling adapters built on the class) are
constructed normally.
"""

from __future__ import annotations

import importlib
from typing import Any

from vllm_adaptive.architectures import ADAPTIVE_ARCHITECTURES
from vllm_adaptive.config import AdaptiveConfigError, adaptive_config_from_vllm
from vllm_adaptive.engine.vllm_api import Gemma3ForCausalLM, LlamaForCausalLM, init_logger

logger = init_logger("vllm.adaptive.dispatch")  # under "vllm" so vLLM's log config shows it


def _load(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _dispatch(dispatcher: type, stock: type, adaptive_path: str, cls: type, args, kwargs) -> Any:
    vllm_config = kwargs.get("vllm_config")
    adaptive = adaptive_config_from_vllm(vllm_config)
    if cls is not dispatcher:
        # A vLLM-made subclass (pooling/conversion adapters): build it normally.
        if adaptive is not None:
            raise AdaptiveConfigError(
                f"adaptive: {cls.__name__} is a converted (non-generative) model; "
                "adaptive modes support text generation only"
            )
        return object.__new__(cls)
    if adaptive is None:
        return stock(*args, **kwargs)
    if adaptive.moe is not None:
        raise AdaptiveConfigError(
            f"adaptive.moe: {stock.__name__} is not a MoEfied model; expert tiers need a "
            "MoefiedLlamaForCausalLM checkpoint (docs/moe.md)"
        )
    model_cls = _load(adaptive_path)
    logger.info("vllm-adaptive: using %s with %s", model_cls.__name__, adaptive.model_dump())
    return model_cls(*args, **kwargs)


_ADAPTIVE_CLS = {arch.stock: arch.adaptive_cls for arch in ADAPTIVE_ARCHITECTURES}


class LlamaForCausalLMDispatch(LlamaForCausalLM):
    """Registered over "LlamaForCausalLM"; see the module docstring."""

    def __new__(cls, *args: Any, **kwargs: Any):
        adaptive_cls = _ADAPTIVE_CLS["LlamaForCausalLM"]
        return _dispatch(
            LlamaForCausalLMDispatch, LlamaForCausalLM, adaptive_cls, cls, args, kwargs
        )


class Gemma3ForCausalLMDispatch(Gemma3ForCausalLM):
    """Registered over "Gemma3ForCausalLM"; see the module docstring."""

    def __new__(cls, *args: Any, **kwargs: Any):
        adaptive_cls = _ADAPTIVE_CLS["Gemma3ForCausalLM"]
        return _dispatch(
            Gemma3ForCausalLMDispatch, Gemma3ForCausalLM, adaptive_cls, cls, args, kwargs
        )
