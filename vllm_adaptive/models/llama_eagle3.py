"""vLLM's EAGLE-3 draft head (``llama_eagle3.py``) with its linears on one of the plugin's gears.

Registered over the head architectures vLLM maps to ``Eagle3LlamaForCausalLM``. A draft never
changes the output (the target verifies every token), so the head may run lossy weights: a
head pass reads its weights like a target step does. Profiled through ``vllm serve``, the
float32 head of SmolLM2 (39 MB) cost 5.2 ms a draft step on an AVX2 EPYC, and the bf16 head's
GEMMs 2.3 of a 28 ms speculative step on an AVX512-BF16 EPYC (docs/results.md).

Which gear (:func:`draft_precision`): ``adaptive.draft_head.gear`` where set, else the target's
fixed gear where the head supports it (``fp16`` on a float32 engine, ``int8``), else none:
vLLM's class unchanged, as without an ``adaptive`` section.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from vllm_adaptive.config import PrecisionConfig
from vllm_adaptive.engine.vllm_api import Eagle3LlamaForCausalLM

logger = logging.getLogger("vllm.adaptive.speculative")

#: the head's linear layers, by their module names' last part
DRAFT_LINEARS = ("fc", "qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
#: the prefix of the draft head's geared linears' names (``introspection.draft_gears``)
DRAFT_PREFIX = "draft."
#: the int8 gear's group of K: the target's default ``group_size``
INT8_GROUP = PrecisionConfig.model_fields["group_size"].default


#: the gears a draft head runs, and the engine dtypes each takes
HEAD_GEARS = {"fp16": ("float32",), "int8": ("float32", "bfloat16")}


def draft_precision(vllm_config: Any) -> str | None:
    """The gear the draft head's linears run (see the module docstring), None for vLLM's own."""
    from vllm_adaptive.config import adaptive_config_from_vllm

    adaptive = adaptive_config_from_vllm(vllm_config)
    if adaptive is None:
        return None
    if adaptive.active_draft_head is not None:
        gear = adaptive.active_draft_head.gear
        return None if gear == "full" else gear
    precision = adaptive.active_precision
    if precision is None or precision.policy != "fixed" or precision.gear not in HEAD_GEARS:
        return None
    if head_gear_problem(precision.gear, vllm_config.model_config.dtype) is not None:
        return None
    return precision.gear


def head_gear_problem(gear: str, dtype: torch.dtype) -> str | None:
    """Why a draft head cannot run ``gear`` on an engine of ``dtype`` (None when it can)."""
    if gear == "full":
        return None
    name = str(dtype).removeprefix("torch.")
    if name not in HEAD_GEARS[gear]:
        return (
            f"adaptive.draft_head.gear {gear!r} runs on {' or '.join(HEAD_GEARS[gear])} "
            f"engines, not {name}"
        )
    if gear == "int8":
        from vllm_adaptive.kernels import native

        if native.int8_linear_ops() is None:
            return (
                'adaptive.draft_head.gear "int8" needs the plugin\'s int8 kernel, which is not '
                "built for this CPU (vllm-adaptive kernels build)"
            )
    return None


def draft_head_problem(adaptive: Any, vllm_config: Any) -> str | None:
    """Why an engine cannot carry ``adaptive.draft_head`` (None when it can)."""
    settings = adaptive.active_draft_head
    if settings is None:
        return None
    method = getattr(vllm_config.speculative_config, "method", None)
    if method not in ("eagle", "eagle3"):
        return (
            "adaptive.draft_head sets the precision of vLLM's EAGLE / EAGLE-3 head: "
            f'speculative_config must name one ({{"method": "eagle3", "model": HEAD, ...}}), '
            f"got {method!r}"
        )
    return head_gear_problem(settings.gear, vllm_config.model_config.dtype)


def gear_draft_linears(model: torch.nn.Module, precision: str, max_tokens: int = 64) -> list:
    """Route each of the head's linears through one fixed-precision tier (the target's geared
    linear, with its one precision at every level; int8 in the target's groups of 32)."""
    from vllm_adaptive.kernels import autotune
    from vllm_adaptive.models.geared_linear_method import GearedLinearMethod
    from vllm_adaptive.models.precision import int8_group_size
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
        tiers = LinearTiers.build(
            module.weight,
            set(level_map),
            "independent",
            None,
            True,
            int8_group_size=int8_group_size(INT8_GROUP, module.weight.device),
        )
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
            logger.info(
                "vllm-adaptive: the EAGLE draft head's %d linears run the %s gear",
                len(self.geared_linears),
                self.draft_precision,
            )
        return loaded
