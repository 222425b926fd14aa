"""Every runtime replacement of a vLLM function, in one place (applied by ``plugin.register``).

vLLM offers no hook for what these do; each is written against vLLM 0.32 and applied only when
the installed vLLM's version starts with one of :data:`SUPPORTED_VLLM`. On another version
nothing is replaced, a warning says so, and the plugin falls back to what vLLM's own hooks
give (bad overrides still refused at admission, but inside the stream when streaming; JSON
booleans coerced to numbers; settings the engine cannot honour logged as ignored).

1. ``InputProcessor._build_logits_processors_params_validator`` (every engine front: ``LLM``,
   ``AsyncLLM``): the per-request validator it returns also checks the adaptive overrides
   against *this engine's* adaptive config (``vllm_config.additional_config``), so a setting
   the engine cannot honour (``adaptive_gear`` without gears, a depth budget on a non-EMAD
   signal) is a ``VLLMValidationError`` (HTTP 400) naming why. vLLM's logits-processor hook
   (``validate_params``) is a classmethod that never sees the engine's config.
2. ``AsyncLLM.generate``: runs that check when the request is submitted, before the first
   ``await``. vLLM validates a request's parameters inside the async generator, which the
   OpenAI server first iterates inside a streaming response, after sending HTTP 200: a bad
   override then became an error event in a 200 stream plus a logged traceback. Raised here, it
   propagates out of ``create_completion`` / ``create_chat_completion`` like vLLM's own
   sampling-parameter errors and is answered 400.
3. The OpenAI request models' ``vllm_xargs`` field (completions, chat, responses, Anthropic
   messages): pydantic's lax union ``str | int | float`` turns a JSON ``true`` into ``1`` before
   anything else sees it, so ``{"adaptive_depth_budget": true}`` passed as a budget of 1. The
   field gets a wrap validator that puts back the JSON boolean of ``adaptive_*`` keys (other
   keys are left as vLLM makes them), so the validator refuses it naming what was sent.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("vllm.adaptive.patches")

#: vLLM versions these replacements were written and checked against.
SUPPORTED_VLLM = ("0.32.",)
#: Request models whose ``vllm_xargs`` keep JSON booleans of ``adaptive_*`` keys.
XARGS_MODELS = (
    ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
    ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
    ("vllm.entrypoints.openai.responses.protocol", "ResponsesRequest"),
    ("vllm.entrypoints.anthropic.protocol", "AnthropicMessagesRequest"),
)
_MARK = "__vllm_adaptive_patched__"
_applied: list[str] = []


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def apply_vllm_patches() -> list[str]:
    """Apply every replacement once per process; returns what this process has patched."""
    if _applied:
        return list(_applied)
    version = vllm_version()
    if not version.startswith(SUPPORTED_VLLM):
        logger.warning(
            "vllm-adaptive: vLLM %s is not one the plugin's request checks were written for "
            "(%s); left vLLM unpatched: bad per-request adaptive values in streaming requests "
            "are errors inside the stream, and settings an engine cannot honour are logged as "
            "ignored instead of refused",
            version,
            ", ".join(v + "x" for v in SUPPORTED_VLLM),
        )
        _applied.append("none")
        return list(_applied)
    for name, patch in (
        ("InputProcessor._build_logits_processors_params_validator", _patch_input_processor),
        ("AsyncLLM.generate", _patch_async_generate),
        ("vllm_xargs JSON booleans", _patch_xargs_models),
    ):
        try:
            done = patch()
        except Exception:  # a patch must never stop vLLM from starting
            logger.exception("vllm-adaptive: could not patch %s", name)
            continue
        if done:
            _applied.append(name)
    logger.debug("vllm-adaptive: patched vLLM %s: %s", version, _applied)
    return list(_applied)


def _mark(fn: Callable) -> Callable:
    setattr(fn, _MARK, True)
    return fn


def _patched(fn: Any) -> bool:
    return bool(getattr(fn, _MARK, False))


# -- 1. engine-aware admission check ----------------------------------------------------------


def _patch_input_processor() -> bool:
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._build_logits_processors_params_validator
    if _patched(original):
        return False

    @functools.wraps(original)
    def build(self):
        from vllm_adaptive.request_overrides import engine_request_check

        base = original(self)
        check = engine_request_check(self.vllm_config)
        self._vllm_adaptive_check = check

        def validate(params) -> None:
            base(params)
            check(params)

        return validate

    InputProcessor._build_logits_processors_params_validator = _mark(build)
    return True


# -- 2. the check before the stream starts ----------------------------------------------------


def _patch_async_generate() -> bool:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    original = AsyncLLM.generate
    if _patched(original):
        return False

    @functools.wraps(original)
    def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        # A plain function returning vLLM's async generator: the check raises at the call,
        # which the OpenAI serving code makes before it returns a StreamingResponse.
        check = getattr(getattr(self, "input_processor", None), "_vllm_adaptive_check", None)
        if check is not None and isinstance(sampling_params, SamplingParams):
            check(sampling_params)
        return original(self, prompt, sampling_params, request_id, *args, **kwargs)

    AsyncLLM.generate = _mark(generate)
    return True


# -- 3. JSON booleans in vllm_xargs -------------------------------------------------------------


def keep_adaptive_booleans(value: Any, handler: Callable[[Any], Any]) -> Any:
    """Wrap validator of ``vllm_xargs``: vLLM's validation, then the ``adaptive_*`` keys that
    were JSON booleans get their boolean back (to be refused by name, not read as 0 / 1)."""
    from vllm_adaptive.request_overrides import EXTRA_ARGS_PREFIX

    out = handler(value)
    if isinstance(value, dict) and isinstance(out, dict):
        for key, raw in value.items():
            if isinstance(key, str) and key.startswith(EXTRA_ARGS_PREFIX) and isinstance(raw, bool):
                out[key] = raw
    return out


def _patch_xargs_models() -> bool:
    import importlib
    from typing import Annotated

    from pydantic import WrapValidator
    from pydantic.fields import FieldInfo

    done = 0
    for module_name, cls_name in XARGS_MODELS:
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError):
            logger.debug("vllm-adaptive: no %s.%s in this vLLM", module_name, cls_name)
            continue
        fields = cls.model_fields
        field = fields.get("vllm_xargs")
        if field is None or getattr(cls, _MARK, False):
            continue
        annotation = Annotated[field.annotation, WrapValidator(keep_adaptive_booleans)]
        fields["vllm_xargs"] = FieldInfo.merge_field_infos(field, annotation=annotation)
        cls.model_rebuild(force=True)
        setattr(cls, _MARK, True)
        done += 1
    return done > 0
