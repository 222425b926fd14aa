"""Per-request adaptive overrides, carried in `SamplingParams.extra_args`.

Keys are flat, `adaptive_<field>`, because the OpenAI server's `vllm_xargs`
only carries strings, numbers and lists:

    client.completions.create(..., extra_body={"vllm_xargs": {"adaptive_mode": "off"}})
    SamplingParams(extra_args={"adaptive_mode": "off"})

Validation runs at request admission through vLLM's logits-processor
`validate_params` hook, so a bad value becomes HTTP 400 (a
`VLLMValidationError`) instead of an engine crash or a silent default. The
validator itself never changes logits. The keys and their rules live in
:mod:`vllm_adaptive.overrides` (no vLLM there: the MLX server uses them too).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from vllm_adaptive.overrides import (
    EXTRA_ARGS_PREFIX,
    RequestOverrideError,
    RequestOverrides,
    check_overrides,
    parse_overrides,
)

__all__ = ["EXTRA_ARGS_PREFIX", "RequestOverrides", "parse_request_overrides"]

logger = logging.getLogger("vllm.adaptive.requests")


def parse_request_overrides(extra_args: Mapping[str, Any] | None) -> RequestOverrides:
    """Collect and validate the `adaptive_*` keys; other keys belong to others."""
    try:
        return parse_overrides(extra_args)
    except RequestOverrideError as e:
        raise VLLMValidationError(str(e), parameter=e.parameter, value=e.value) from None


def check_architecture_supported(vllm_config: Any) -> None:
    """Refuse an adaptive config for an architecture without an adaptive class."""
    from vllm_adaptive.config import adaptive_config_from_vllm
    from vllm_adaptive.models import ADAPTIVE_ARCHITECTURES

    if vllm_config is None or adaptive_config_from_vllm(vllm_config) is None:
        return
    archs = list(getattr(vllm_config.model_config, "architectures", None) or [])
    supported = {a.stock for a in ADAPTIVE_ARCHITECTURES} | {
        a.adaptive for a in ADAPTIVE_ARCHITECTURES
    }
    if not supported.intersection(archs):
        from vllm_adaptive.config import AdaptiveConfigError

        raise AdaptiveConfigError(
            f"adaptive: no adaptive model class for architecture {archs}; "
            f"supported: {sorted(a.stock for a in ADAPTIVE_ARCHITECTURES)}"
        )


class AdaptiveRequestValidator(LogitsProcessor):
    """Admission-time validation of per-request overrides; a no-op on logits."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        overrides = parse_request_overrides(sampling_params.extra_args)
        try:
            check_overrides(overrides)
        except RequestOverrideError as e:
            raise VLLMValidationError(str(e), parameter=e.parameter, value=e.value) from None

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
                    # validate_params gets no engine config, so this cannot be a 400; say it.
                    logger.warning(
                        "vllm-adaptive: %s=%r ignored: this engine has no adaptive.%s section",
                        key,
                        extra[key],
                        section,
                    )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
