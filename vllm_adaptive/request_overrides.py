"""Per-request adaptive overrides, carried in `SamplingParams.extra_args`.

Keys are flat, `adaptive_<field>`, because the OpenAI server's `vllm_xargs`
only carries strings, numbers and lists:

    client.completions.create(..., extra_body={"vllm_xargs": {"adaptive_mode": "off"}})
    SamplingParams(extra_args={"adaptive_mode": "off"})

Validation runs at request admission through vLLM's logits-processor
`validate_params` hook, so a bad value becomes HTTP 400 (a
`VLLMValidationError`) instead of an engine crash or a silent default. The
validator itself never changes logits.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

logger = logging.getLogger("vllm.adaptive.requests")

#: Prefix of every per-request adaptive key in `extra_args`.
EXTRA_ARGS_PREFIX = "adaptive_"


class RequestOverrides(BaseModel):
    """What one request may change about the engine's adaptive behaviour."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    mode: Literal["off"] | None = None
    """"off": run this request with every adaptive mechanism disabled (full precision, full
    depth; on a self-speculative engine the request gets no drafts)."""
    gear: Literal["low", "mid", "high"] | None = None
    """Pin this request's precision gear level (engines with ``adaptive.precision``)."""
    depth_budget: float | None = Field(None, gt=0.0, le=1.0)
    """This request's adaptive-depth budget (engines with ``adaptive.depth``); 1.0: no exits."""
    request_tag: str | None = Field(None, min_length=1, max_length=200)
    """Name under which the request's telemetry (gear counts, traces) is recorded."""


def parse_request_overrides(extra_args: Mapping[str, Any] | None) -> RequestOverrides:
    """Collect and validate the `adaptive_*` keys; other keys belong to others."""
    fields = {
        key[len(EXTRA_ARGS_PREFIX) :]: value
        for key, value in (extra_args or {}).items()
        if isinstance(key, str) and key.startswith(EXTRA_ARGS_PREFIX)
    }
    try:
        return RequestOverrides.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        key = EXTRA_ARGS_PREFIX + ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden":
            known = ", ".join(EXTRA_ARGS_PREFIX + f for f in RequestOverrides.model_fields)
            msg = f"unknown per-request adaptive key {key!r} (known: {known})"
        else:
            msg = (
                f"invalid per-request adaptive value for {key!r}: {first['msg']} "
                f"(got {first.get('input')!r})"
            )
        raise VLLMValidationError(msg, parameter=key, value=first.get("input")) from None


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
        for name in ("gear", "depth_budget"):
            value = getattr(overrides, name)
            if overrides.mode == "off" and value is not None:
                raise VLLMValidationError(
                    f"adaptive_mode='off' and adaptive_{name} contradict each other; give one",
                    parameter=f"adaptive_{name}",
                    value=value,
                )

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
