"""The adaptive config: what `--additional-config '{"adaptive": {...}}'` may hold.

The schema is strict on purpose: unknown keys, wrong types and out-of-range
values are errors that name the key, raised when the engine starts. Each
mechanism that later joins the project adds one sub-model here; `mode: "off"`
(the default) runs the adaptive model class with every mechanism disabled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

#: Key of the adaptive section inside vLLM's `additional_config`.
ADDITIONAL_CONFIG_KEY = "adaptive"


class AdaptiveConfigError(ValueError):
    """A bad adaptive config; the message names the offending key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class AdaptiveConfig(_Strict):
    """Engine-wide adaptive settings (one per vLLM engine)."""

    mode: Literal["off"] = "off"
    """Which adaptive mechanisms run. "off": the adaptive model class runs with
    every mechanism disabled and produces exactly stock vLLM's output."""

    @property
    def any_mechanism_enabled(self) -> bool:
        return self.mode != "off"


def format_validation_error(err: ValidationError, root: str) -> str:
    """One line per problem, each naming the full key path (e.g. `adaptive.mode`)."""
    lines = []
    for e in err.errors():
        path = ".".join([root, *(str(p) for p in e["loc"])])
        if e["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key")
        else:
            lines.append(f"{path}: {e['msg']} (got {e.get('input')!r})")
    return "; ".join(lines)


def parse_adaptive_config(value: Any, root: str = ADDITIONAL_CONFIG_KEY) -> AdaptiveConfig:
    """Validate an adaptive config given as a mapping or a JSON string."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise AdaptiveConfigError(f"{root}: not valid JSON: {e}") from e
    if not isinstance(value, Mapping):
        raise AdaptiveConfigError(f"{root}: expected a JSON object, got {type(value).__name__}")
    try:
        return AdaptiveConfig.model_validate(dict(value))
    except ValidationError as e:
        raise AdaptiveConfigError(
            f"invalid adaptive config: {format_validation_error(e, root)}"
        ) from None


def load_config_arg(text: str) -> dict[str, Any]:
    """A CLI config argument: a JSON object, or the path of a file holding one."""
    stripped = text.strip()
    if not stripped.startswith("{") and Path(text).is_file():
        stripped = Path(text).read_text()
    try:
        value = json.loads(stripped)
    except json.JSONDecodeError as e:
        raise AdaptiveConfigError(
            f"config {text!r}: neither a JSON object nor a readable file ({e})"
        ) from e
    if not isinstance(value, dict):
        raise AdaptiveConfigError(f"config {text!r}: expected a JSON object")
    parse_adaptive_config(value)  # validate early, before any engine starts
    return value


def adaptive_config_from_vllm(vllm_config: Any) -> AdaptiveConfig | None:
    """The engine's adaptive config, or None when adaptivity was not requested.

    `None` means stock vLLM: the plugin stays out of the way entirely.
    """
    additional = getattr(vllm_config, "additional_config", None)
    if not isinstance(additional, Mapping) or ADDITIONAL_CONFIG_KEY not in additional:
        return None
    return parse_adaptive_config(additional[ADDITIONAL_CONFIG_KEY])


def additional_config_for(adaptive: Mapping[str, Any]) -> dict[str, Any]:
    """The `additional_config` value that turns adaptivity on with `adaptive`."""
    return {ADDITIONAL_CONFIG_KEY: dict(adaptive)}
