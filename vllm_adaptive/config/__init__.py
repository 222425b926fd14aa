"""The adaptive config: what `--additional-config '{"adaptive": {...}}'` may hold.

The schema is strict on purpose: unknown keys, wrong types and out-of-range
values are errors that name the key, raised when the engine starts. Each
mechanism has its section in a module of this package (``precision``, ``depth``,
``speculative``, ``moe``); `mode: "off"` runs the adaptive model class with every
mechanism disabled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError, model_validator

from vllm_adaptive.config.base import (  # noqa: F401 - the package's names
    ADDITIONAL_CONFIG_KEY,
    LAYER_MODULES,
    MANAGED_MODULES,
    AdaptiveConfigError,
    GearMap,
    _Strict,
)
from vllm_adaptive.config.depth import (  # noqa: F401 - the package's names
    ArlaSignalConfig,
    DepthConfig,
    ExitRiverConfig,
    FloorConfig,
    FusionConfig,
    KvStrategy,
    QuickSilverSignalConfig,
    RefreshConfig,
    RiverSignalConfig,
    SignalConfig,
    SignalName,
)
from vllm_adaptive.config.moe import (  # noqa: F401 - the package's names
    MoeConfig,
)
from vllm_adaptive.config.precision import (  # noqa: F401 - the package's names
    VOCAB_REF,
    GearbxSettings,
    LayerGroup,
    PrecisionConfig,
    QuickSilverSettings,
    SmoothingConfig,
)
from vllm_adaptive.config.speculative import (  # noqa: F401 - the package's names
    SELF_SPECULATIVE_PROPOSER,
    DraftHeadConfig,
    HybridConfig,
    PromptLookupConfig,
    SpeculativeConfig,
)


class AdaptiveConfig(_Strict):
    """Engine-wide adaptive settings (one per vLLM engine)."""

    mode: Literal["on", "off"] = "on"
    """"off": every configured mechanism is disabled and the adaptive model class produces
    exactly stock vLLM's output (a kill switch that keeps the rest of the config)."""
    precision: PrecisionConfig | None = None
    depth: DepthConfig | None = None
    speculative: SpeculativeConfig | None = None
    hybrid: HybridConfig | None = None
    draft_head: DraftHeadConfig | None = None
    moe: MoeConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> AdaptiveConfig:
        if self.hybrid is not None and self.speculative is not None:
            raise ValueError(
                '"hybrid" mixes lookup drafts into vLLM\'s own EAGLE drafter; "speculative" is '
                'the plugin\'s self-drafting proposer (it has its own "prompt_lookup"): use one'
            )
        if self.moe is not None and (
            self.precision is not None or self.depth is not None or self.speculative is not None
        ):
            raise ValueError(
                '"moe" cannot be combined with "precision", "depth" or "speculative" yet: '
                "those mechanisms manage the dense Llama MLP, which a MoEfied model replaces"
            )
        if (
            self.precision is not None
            and self.depth is not None
            and (self.precision.policy != "fixed" or self.precision.effective_routing != "step")
        ):
            raise ValueError(
                '"depth" combines only with a "fixed" precision (one gear for the whole step): '
                "entropy-routed gear plans are made per token for the whole step, and "
                "depth-peeling shrinks the batch inside the step"
            )
        if self.speculative is not None and (
            self.depth is not None
            or (self.precision is not None and self.precision.policy != "fixed")
        ):
            raise ValueError(
                '"speculative" cannot be combined with "depth" or with an entropy-routed '
                '"precision" policy: verification scores several tokens per request per step (the '
                'draft already runs low precision or few layers: see "speculative.draft"; a '
                'target at one fixed precision, e.g. {"policy": "fixed", "gear": "fp16"}, works)'
            )
        return self

    @property
    def any_mechanism_enabled(self) -> bool:
        return self.mode == "on" and (
            self.precision is not None
            or self.depth is not None
            or self.speculative is not None
            or self.moe is not None
        )

    @property
    def active_precision(self) -> PrecisionConfig | None:
        return self.precision if self.mode == "on" else None

    @property
    def active_depth(self) -> DepthConfig | None:
        return self.depth if self.mode == "on" else None

    @property
    def active_speculative(self) -> SpeculativeConfig | None:
        return self.speculative if self.mode == "on" else None

    @property
    def active_hybrid(self) -> HybridConfig | None:
        return self.hybrid if self.mode == "on" else None

    @property
    def active_draft_head(self) -> DraftHeadConfig | None:
        return self.draft_head if self.mode == "on" else None

    @property
    def active_moe(self) -> MoeConfig | None:
        return self.moe if self.mode == "on" else None


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
