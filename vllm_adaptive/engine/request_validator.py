"""Per-request adaptive overrides, carried in `SamplingParams.extra_args`.

Keys are flat, `adaptive_<field>`, because the OpenAI server's `vllm_xargs`
only carries strings, numbers and lists:

    client.completions.create(..., extra_body={"vllm_xargs": {"adaptive_mode": "off"}})
    SamplingParams(extra_args={"adaptive_mode": "off"})

Three checks, each a `VLLMValidationError` (HTTP 400 on the OpenAI server) naming the key and
what was sent:

1. syntax: known keys, strict types (a JSON boolean is not a number), ranges;
2. contradictions within the request (`adaptive_mode: "off"` with a gear or a budget);
3. what this engine can honour (`adaptive_gear` needs gears, a depth budget below 1.0 needs
   EMAD's signal): needs the engine's adaptive config, see :func:`engine_request_check`.

vLLM's logits-processor hook `validate_params` (the validator class below) runs 1 and 2 at
admission in every engine. It gets no engine config, so 3 and the timing (before a streaming
response starts) come from the replacements in :mod:`vllm_adaptive.engine.intrusions`. The
validator itself never changes logits. The keys and their syntax rules live in
:mod:`vllm_adaptive.overrides` (no vLLM there: the MLX server uses them too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from vllm_adaptive.overrides import (
    EXTRA_ARGS_PREFIX,
    RequestOverrideError,
    RequestOverrides,
    check_honoured,
    check_overrides,
    parse_overrides,
    unsupported_reason,
)

__all__ = [
    "EXTRA_ARGS_PREFIX",
    "RequestOverrides",
    "parse_request_overrides",
    "unsupported_reason",
    "validate_overrides",
]

logger = logging.getLogger("vllm.adaptive.requests")

#: ``engine`` argument of :func:`validate_overrides` when the engine's config is not known.
ENGINE_UNKNOWN: Any = object()


def parse_request_overrides(extra_args: Mapping[str, Any] | None) -> RequestOverrides:
    """Collect and validate the `adaptive_*` keys; other keys belong to others."""
    try:
        return parse_overrides(extra_args)
    except RequestOverrideError as e:
        raise VLLMValidationError(str(e), parameter=e.parameter, value=e.value) from None


def validate_overrides(
    extra_args: Mapping[str, Any] | None, engine: Any = ENGINE_UNKNOWN, vllm_drafts: bool = False
) -> RequestOverrides:
    """All three checks (see the module docstring); ``engine``: the engine's
    ``AdaptiveConfig`` (None: no adaptive config), or ENGINE_UNKNOWN to skip the third;
    ``vllm_drafts``: the engine verifies drafts of one of vLLM's own proposers."""
    overrides = parse_request_overrides(extra_args)
    try:
        check_overrides(overrides)
    except RequestOverrideError as e:
        raise VLLMValidationError(str(e), parameter=e.parameter, value=e.value) from None
    if engine is not ENGINE_UNKNOWN:
        try:
            check_honoured(overrides, engine, extra_args, vllm_drafts)
        except RequestOverrideError as e:
            raise VLLMValidationError(str(e), parameter=e.parameter, value=e.value) from None
    return overrides


def engine_request_check(vllm_config: Any) -> Callable[[Any], None]:
    """The per-request check of one engine, knowing its adaptive config (see
    :mod:`vllm_adaptive.engine.intrusions`, which calls it where vLLM holds the engine's config).

    vLLM builds it in the front end before it starts any engine process, so a bad adaptive
    config (or one for an architecture without an adaptive class) raises
    :class:`~vllm_adaptive.config.AdaptiveConfigError` here, in seconds, instead of after the
    engine has loaded the model."""
    from vllm_adaptive.config import adaptive_config_from_vllm

    adaptive = adaptive_config_from_vllm(vllm_config)
    check_architecture_supported(vllm_config)
    spec = getattr(vllm_config, "speculative_config", None)
    # the plugin's own proposer (custom_class) follows requests itself
    vllm_drafts = spec is not None and getattr(spec, "method", None) != "custom_class"

    def check(params: Any) -> None:
        if isinstance(params, SamplingParams):
            validate_overrides(params.extra_args, adaptive, vllm_drafts)

    return check


def check_architecture_supported(vllm_config: Any) -> None:
    """Refuse an adaptive config for an architecture without an adaptive class."""
    from vllm_adaptive.architectures import (
        ADAPTIVE_ARCHITECTURES,
        OWN_ARCHITECTURES,
        supported_architectures,
    )
    from vllm_adaptive.config import AdaptiveConfigError, adaptive_config_from_vllm

    if vllm_config is None:
        return
    adaptive = adaptive_config_from_vllm(vllm_config)
    if adaptive is None:
        return
    archs = list(getattr(vllm_config.model_config, "architectures", None) or [])
    if not supported_architectures().intersection(archs):
        raise AdaptiveConfigError(
            f"adaptive: no adaptive model class for architecture {archs}; "
            f"supported: {sorted(a.stock for a in ADAPTIVE_ARCHITECTURES)} and "
            f"{sorted(a.name for a in OWN_ARCHITECTURES)}"
        )
    moe_archs = {a.name for a in OWN_ARCHITECTURES if "moe" in a.sections}
    if adaptive.moe is not None and not moe_archs.intersection(archs):
        raise AdaptiveConfigError(
            f"adaptive.moe: the model ({archs}) is not MoEfied; expert tiers need one of "
            f"{sorted(moe_archs)} (docs/moe.md)"
        )


class AdaptiveRequestValidator(LogitsProcessor):
    """Admission-time validation of per-request overrides; a no-op on logits."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        validate_overrides(sampling_params.extra_args)

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        # Built in every engine's worker at start: the one place that sees the
        # config for every architecture, so an adaptive section on a model we
        # have no adaptive class for fails here instead of being ignored.
        check_architecture_supported(vllm_config)

    def is_argmax_invariant(self) -> bool:
        return True  # never applied to greedy batches; a no-op otherwise

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        # The one hook vLLM calls before every forward with the persistent batch's changes:
        # controllers mirror them to keep per-request state per batch slot.
        from vllm_adaptive.batch_mirror import listener, notify

        notify(batch_update)
        if not batch_update:
            return
        for key, section in (("adaptive_gear", "precision"), ("adaptive_depth_budget", "depth")):
            if listener(section) is not None:
                continue
            for _, params, _, _ in batch_update.added:
                extra = (params.extra_args or {}) if params is not None else {}
                if key in extra:
                    # Refused at admission by the engine-aware check (intrusions); reached
                    # only where vLLM could not be patched: say what is ignored.
                    logger.warning(
                        "vllm-adaptive: %s=%r ignored: this engine has no adaptive.%s section",
                        key,
                        extra[key],
                        section,
                    )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
