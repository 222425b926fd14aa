"""Per-request adaptive keys (``adaptive_*``) and their validation, with no vLLM or torch.

One schema for every serving path: the vLLM plugin reads them from ``SamplingParams.extra_args``
(``vllm_adaptive/engine/request_validator.py`` turns errors into vLLM's HTTP 400), the MLX
server from the request body (``vllm_adaptive/metal_backend/server.py``). Keys are flat,
``adaptive_<field>``, because vLLM's ``vllm_xargs`` only carries strings, numbers and lists.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

#: Prefix of every per-request adaptive key.
EXTRA_ARGS_PREFIX = "adaptive_"


def shown(value: Any) -> str:
    """A value as the client sent it: JSON booleans as ``true`` / ``false``, not Python's."""
    if isinstance(value, bool):
        return f"{json.dumps(value)} (a boolean)"
    return repr(value)


class RequestOverrideError(ValueError):
    """A bad per-request adaptive key; ``parameter`` names it (e.g. ``adaptive_gear``)."""

    def __init__(self, message: str, parameter: str, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value


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


def parse_overrides(extra_args: Mapping[str, Any] | None) -> RequestOverrides:
    """Collect and validate the ``adaptive_*`` keys (other keys belong to others); a bad key
    raises `RequestOverrideError` naming it."""
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
                f"(got {shown(first.get('input'))})"
            )
        raise RequestOverrideError(msg, key, first.get("input")) from None


def check_overrides(overrides: RequestOverrides) -> None:
    """Refuse keys that contradict each other (``adaptive_mode: off`` with a gear or budget)."""
    for name in ("gear", "depth_budget"):
        value = getattr(overrides, name)
        if overrides.mode == "off" and value is not None:
            raise RequestOverrideError(
                f"adaptive_mode='off' and adaptive_{name} contradict each other; give one",
                f"adaptive_{name}",
                value,
            )


def _no_section(adaptive: Any, section: str, what: str) -> str:
    if adaptive is None:
        return (
            f"this engine runs without an adaptive config, so it has no {what} (start it with "
            f'--additional-config \'{{"adaptive": {{"{section}": ...}}}}\')'
        )
    if adaptive.mode == "off":
        return f'this engine\'s adaptive.mode is "off", so it has no {what}'
    running = ", ".join(s for s in ("precision", "depth", "speculative") if getattr(adaptive, s))
    return (
        f"this engine has no adaptive.{section} section, so no {what} "
        f"(it runs: {running or 'no adaptive mechanism'})"
    )


def unsupported_reason(
    overrides: RequestOverrides, adaptive: Any, vllm_drafts: bool = False
) -> tuple[str, str] | None:
    """``(key, why)`` of the first override an engine with this adaptive config (an
    ``AdaptiveConfig``, or None for none) cannot honour; None when it honours them all.
    ``vllm_drafts``: the engine verifies drafts of one of vLLM's proposers, under which vLLM
    runs no logits processors, the hook through which the plugin follows each request."""
    precision = adaptive.active_precision if adaptive is not None else None
    if vllm_drafts and precision is not None:
        why = (
            "this engine verifies vLLM's speculative drafts, and vLLM then runs no logits "
            "processors, the hook through which the plugin follows each request: every request "
            "runs the engine's gears"
        )
        if overrides.gear is not None:
            return "adaptive_gear", why
        if overrides.mode == "off":
            return "adaptive_mode", why
        if overrides.request_tag is not None:
            return "adaptive_request_tag", why + " and leaves no record"
    if overrides.gear is not None:
        precision = adaptive.active_precision if adaptive is not None else None
        if precision is None:
            return "adaptive_gear", _no_section(adaptive, "precision", "precision gears")
        if precision.policy == "fixed":
            return "adaptive_gear", (
                f'this engine\'s precision policy is "fixed": every gear level runs '
                f'{precision.gear} (adaptive_mode "off" runs full precision)'
            )
    if overrides.depth_budget is not None:
        depth = adaptive.active_depth if adaptive is not None else None
        if depth is None:
            return "adaptive_depth_budget", _no_section(adaptive, "depth", "adaptive depth")
        signals = tuple(depth.signal.policy)
        if overrides.depth_budget < 1.0 and "emad" not in signals:
            return "adaptive_depth_budget", (
                "a budget sets EMAD's exit thresholds and this engine's exit signal is "
                f"{'+'.join(signals)}; only 1.0 (no exits) applies"
            )
    return None


def check_honoured(
    overrides: RequestOverrides,
    adaptive: Any,
    sent: Mapping[str, Any] | None,
    vllm_drafts: bool = False,
) -> None:
    """Refuse what an engine with this adaptive config cannot honour, naming why and what was
    ``sent`` (the raw keys); the vLLM path and the MLX server both call it."""
    reason = unsupported_reason(overrides, adaptive, vllm_drafts)
    if reason is not None:
        key, why = reason
        value = (sent or {}).get(key)
        raise RequestOverrideError(f"{key}={shown(value)} cannot be honoured: {why}", key, value)
