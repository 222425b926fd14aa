"""vLLM's EAGLE-3 draft head (``llama_eagle3.py``) with its linears on the target's fp16 gear.

Registered over the head architectures vLLM maps to ``Eagle3LlamaForCausalLM``. Without an
``adaptive`` section, or with any target precision but the fixed fp16 gear on a float32 engine,
it is vLLM's class unchanged. With that gear the head's linears (``fc`` over the three target
states, its decoder layer, its LM head over the draft vocabulary) run FBGEMM's fp16 GEMM like
the target's: a draft step reads half the bytes. Profiled through ``vllm serve`` on an AVX2
EPYC, the float32 head of SmolLM2 (39 MB) cost 5.2 ms a draft step, a quarter of the step at
k = 3 (docs/results.md). Drafts never change the output: the target verifies every token.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from vllm_adaptive.engine.vllm_api import Eagle3LlamaForCausalLM

#: the head's linear layers, by their module names' last part
DRAFT_LINEARS = ("fc", "qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
#: the prefix of the draft head's geared linears' names (``introspection.draft_gears``)
DRAFT_PREFIX = "draft."


def draft_precision(vllm_config: Any) -> str | None:
    """The precision the draft head's linears run: ``"fp16"`` when the engine's adaptive
    precision is the fixed fp16 gear on float32 activations, else None (vLLM's own)."""
    from vllm_adaptive.config import adaptive_config_from_vllm

    adaptive = adaptive_config_from_vllm(vllm_config)
    precision = adaptive.active_precision if adaptive is not None else None
    if precision is None or precision.policy != "fixed" or precision.gear != "fp16":
        return None
    if vllm_config.model_config.dtype != torch.float32:
        return None
    return "fp16"


def gear_draft_linears(model: torch.nn.Module, precision: str, max_tokens: int = 64) -> list:
    """Route each of the head's linears through one fixed-precision tier (the target's geared
    linear, with its one precision at every level)."""
    from vllm_adaptive.kernels import autotune
    from vllm_adaptive.models.geared_linear_method import GearedLinearMethod
    from vllm_adaptive.precision.linear import GearedLinear
    from vllm_adaptive.precision.tiers import LinearTiers

    geared = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if name.rsplit(".", 1)[-1] not in DRAFT_LINEARS or method is None:
            continue
        if isinstance(method, GearedLinearMethod):
            continue
        level_map = (precision, precision, precision, "full")
        tiers = LinearTiers.build(module.weight, set(level_map), "independent", None, True)
        tiers.prepare(module.weight.dtype)
        g = GearedLinear(module, DRAFT_PREFIX + name, level_map, tiers, method, controller=None)
        g.set_uniform(precision)  # no step plan: every row of every step runs it
        module.quant_method = GearedLinearMethod(g)
        g.autotune(max_tokens)
        module.quant_method.use_route()
        geared.append(g)
    autotune.table().save()
    return geared


class AdaptiveEagle3LlamaForCausalLM(Eagle3LlamaForCausalLM):
    """vLLM's EAGLE-3 Llama head; see the module docstring."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.draft_precision = draft_precision(vllm_config)
        self.geared_linears: list = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        loaded = super().load_weights(weights)
        if self.draft_precision is not None:
            self.geared_linears = gear_draft_linears(self, self.draft_precision)
        return loaded
