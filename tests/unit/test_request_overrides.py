"""Per-request overrides: syntax (JSON booleans are not numbers), contradictions, and what an
engine with a given adaptive config can honour; the vLLM replacements that apply them."""

from __future__ import annotations

import pytest
from vllm.exceptions import VLLMValidationError

from vllm_adaptive.config import parse_adaptive_config
from vllm_adaptive.engine.request_validator import ENGINE_UNKNOWN, validate_overrides

GEARBX = {"precision": {"policy": "gearbx"}}
DEPTH = {"depth": {"profile": "/p"}}


def _refused(extra: dict, engine=ENGINE_UNKNOWN) -> str:
    with pytest.raises(VLLMValidationError) as e:
        validate_overrides(extra, engine)
    return str(e.value)


def _engine(adaptive: dict):
    return parse_adaptive_config(adaptive)


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"adaptive_depth_budget": True}, "adaptive_depth_budget"),
        ({"adaptive_gear": True}, "adaptive_gear"),
        ({"adaptive_mode": False}, "adaptive_mode"),
        ({"adaptive_request_tag": True}, "adaptive_request_tag"),
    ],
)
def test_booleans_are_refused_naming_what_was_sent(extra: dict, key: str) -> None:
    msg = _refused(extra)
    sent = "true" if next(iter(extra.values())) else "false"
    assert key in msg and f"got {sent} (a boolean)" in msg
    assert "got 1" not in msg and "got True" not in msg


def test_syntax_and_contradictions() -> None:
    assert "unknown per-request adaptive key 'adaptive_foo'" in _refused({"adaptive_foo": 1})
    assert "adaptive_depth_budget" in _refused({"adaptive_depth_budget": 1.5})
    assert "contradict" in _refused({"adaptive_mode": "off", "adaptive_gear": "low"})
    assert validate_overrides({"adaptive_depth_budget": 1, "other_key": True}).depth_budget == 1


@pytest.mark.parametrize(
    ("adaptive", "extra", "reason"),
    [
        (None, {"adaptive_gear": "low"}, "without an adaptive config"),
        ({"mode": "off", **GEARBX}, {"adaptive_gear": "low"}, 'adaptive.mode is "off"'),
        (DEPTH, {"adaptive_gear": "high"}, "no adaptive.precision section"),
        (
            {"precision": {"policy": "fixed", "gear": "int8"}},
            {"adaptive_gear": "high"},
            'policy is "fixed": every gear level runs int8',
        ),
        (GEARBX, {"adaptive_depth_budget": 0.5}, "no adaptive.depth section"),
        (None, {"adaptive_depth_budget": 1.0}, "without an adaptive config"),
        (
            {"depth": {"profile": "/p", "signal": {"policy": "quicksilver"}}},
            {"adaptive_depth_budget": 0.5},
            "exit signal is quicksilver; only 1.0",
        ),
    ],
)
def test_settings_the_engine_cannot_honour_are_refused(
    adaptive: dict | None, extra: dict, reason: str
) -> None:
    engine = None if adaptive is None else _engine(adaptive)
    msg = _refused(extra, engine)
    key = next(iter(extra))
    assert msg.startswith(f"{key}=") and "cannot be honoured" in msg and reason in msg
    validate_overrides(extra)  # the same request passes where the engine is unknown


def test_settings_the_engine_honours_pass() -> None:
    quicksilver = _engine({"depth": {"profile": "/p", "signal": {"policy": "quicksilver"}}})
    assert validate_overrides({"adaptive_depth_budget": 1.0}, quicksilver).depth_budget == 1.0
    assert validate_overrides({"adaptive_depth_budget": 0.4}, _engine(DEPTH)).depth_budget == 0.4
    assert validate_overrides({"adaptive_gear": "low"}, _engine(GEARBX)).gear == "low"
    for engine in (None, _engine(GEARBX), _engine({"mode": "off"})):
        assert validate_overrides({"adaptive_mode": "off", "adaptive_request_tag": "t"}, engine)


def test_vllm_patches_keep_json_booleans_of_adaptive_keys_only() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from vllm_adaptive.engine.intrusions import apply_at_register

    applied = apply_at_register()
    assert applied == apply_at_register()  # once per process
    assert "xargs-booleans" in applied and "check-before-stream" in applied
    xargs = {"adaptive_gear": True, "adaptive_depth_budget": 0.5, "other": True, "n": [True]}
    completion = CompletionRequest.model_validate(
        {"model": "m", "prompt": "p", "vllm_xargs": xargs}
    )
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "vllm_xargs": xargs}
    )
    for request in (completion, chat):
        got = request.vllm_xargs
        assert got["adaptive_gear"] is True and got["adaptive_depth_budget"] == 0.5
        assert got["other"] == 1 and got["other"] is not True and got["n"] == [1]  # vLLM's
        params = request.to_sampling_params(8, {})
        assert params.extra_args["adaptive_gear"] is True
        with pytest.raises(VLLMValidationError, match=r"got true \(a boolean\)"):
            validate_overrides(params.extra_args)
