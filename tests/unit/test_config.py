"""The adaptive config schema, per-request overrides and plugin registration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

from vllm_adaptive.config import (
    AdaptiveConfig,
    AdaptiveConfigError,
    adaptive_config_from_vllm,
    load_config_arg,
    parse_adaptive_config,
)
from vllm_adaptive.engine.request_validator import AdaptiveRequestValidator, parse_request_overrides


def test_empty_config_means_everything_off() -> None:
    cfg = parse_adaptive_config({})
    assert cfg == AdaptiveConfig() and cfg.precision is None
    assert not cfg.any_mechanism_enabled
    # mode "off" is a kill switch: configured mechanisms stay disabled
    off = parse_adaptive_config({"mode": "off", "precision": {"policy": "gearbx"}})
    assert not off.any_mechanism_enabled and off.active_precision is None


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ({"bogus": 1}, "adaptive.bogus: unknown key"),
        ({"mode": "fast"}, "adaptive.mode: Input should be 'on' or 'off'"),
        ({"mode": 3}, "adaptive.mode"),
        ([1, 2], "adaptive: expected a JSON object"),
        ("{not json", "adaptive: not valid JSON"),
    ],
)
def test_bad_config_names_the_key(value, needle: str) -> None:
    with pytest.raises(AdaptiveConfigError) as err:
        parse_adaptive_config(value)
    assert needle in str(err.value)


def test_config_arg_from_string_and_file(tmp_path: Path) -> None:
    assert load_config_arg("{}") == {}
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"mode": "off"}))
    assert load_config_arg(str(f)) == {"mode": "off"}
    with pytest.raises(AdaptiveConfigError, match="adaptive.nope"):
        load_config_arg('{"nope": true}')
    with pytest.raises(AdaptiveConfigError, match="neither a JSON object nor a readable file"):
        load_config_arg(str(tmp_path / "missing.json"))


def test_adaptive_config_absent_means_stock() -> None:
    class Cfg:
        additional_config: dict = {}

    assert adaptive_config_from_vllm(Cfg()) is None
    Cfg.additional_config = {"adaptive": {}}
    assert adaptive_config_from_vllm(Cfg()) == AdaptiveConfig()


def test_request_overrides() -> None:
    assert parse_request_overrides(None).mode is None
    assert parse_request_overrides({"adaptive_mode": "off", "other_plugin_key": 5}).mode == "off"
    with pytest.raises(VLLMValidationError) as err:
        parse_request_overrides({"adaptive_mode": "turbo"})
    assert err.value.parameter == "adaptive_mode"
    with pytest.raises(VLLMValidationError) as err:
        parse_request_overrides({"adaptive_bogus": 1})
    assert err.value.parameter == "adaptive_bogus" and "unknown" in str(err.value)


def test_validator_hook_rejects_bad_params() -> None:
    AdaptiveRequestValidator.validate_params(SamplingParams(extra_args={"adaptive_mode": "off"}))
    with pytest.raises(VLLMValidationError):
        AdaptiveRequestValidator.validate_params(SamplingParams(extra_args={"adaptive_mode": 1}))


def test_register_is_idempotent() -> None:
    from vllm import ModelRegistry

    from vllm_adaptive.engine.plugin import register

    register()
    first = {k: ModelRegistry.models[k] for k in ("LlamaForCausalLM", "AdaptiveLlamaForCausalLM")}
    register()
    for k, v in first.items():
        assert ModelRegistry.models[k] is v  # second call changed nothing
    assert first["LlamaForCausalLM"].class_name == "LlamaForCausalLMDispatch"
    assert first["AdaptiveLlamaForCausalLM"].class_name == "AdaptiveLlamaForCausalLM"


def test_entry_points_declared() -> None:
    from importlib.metadata import entry_points

    general = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert general.get("vllm_adaptive") == "vllm_adaptive.engine.plugin:register"
    # vLLM loads every logits-processor entry point whatever VLLM_PLUGINS says: the validator
    # is added by the general plugin instead (intrusion "request-validator"), so that
    # VLLM_PLUGINS="" is stock vLLM.
    procs = {e.value for e in entry_points(group="vllm.logits_processors")}
    assert not [v for v in procs if v.startswith("vllm_adaptive")], procs


def test_unsupported_architecture_refused() -> None:
    from types import SimpleNamespace

    from vllm_adaptive.engine.request_validator import check_architecture_supported

    def cfg(archs, additional):
        return SimpleNamespace(
            model_config=SimpleNamespace(architectures=archs), additional_config=additional
        )

    check_architecture_supported(cfg(["Qwen2ForCausalLM"], {}))  # adaptivity off: fine
    check_architecture_supported(cfg(["LlamaForCausalLM"], {"adaptive": {}}))
    check_architecture_supported(cfg(["Gemma3ForCausalLM"], {"adaptive": {}}))
    with pytest.raises(AdaptiveConfigError, match="no adaptive model class.*Qwen2ForCausalLM"):
        check_architecture_supported(cfg(["Qwen2ForCausalLM"], {"adaptive": {}}))


def test_token_fusion_needs_the_mask_strategy() -> None:
    depth = {"profile": "/p", "kv_strategy": "mask", "fusion": {"profile": "/f"}}
    assert parse_adaptive_config({"depth": depth}).depth.fusion.profile == "/f"
    for other in ("monotone", "propagate", "recompute", "river"):
        with pytest.raises(AdaptiveConfigError, match='needs kv_strategy "mask"'):
            parse_adaptive_config({"depth": {**depth, "kv_strategy": other}})
    with pytest.raises(AdaptiveConfigError, match='needs kv_strategy "mask"'):
        parse_adaptive_config({"depth": {**depth, "kv_strategy": "monotone"}})
    with pytest.raises(AdaptiveConfigError, match="fusion.profile"):
        parse_adaptive_config({"depth": {**depth, "fusion": {}}})


def test_per_request_gears_under_vllm_drafts_are_refused() -> None:
    """Under speculative decoding vLLM runs no logits processors, the hook through which the
    plugin follows each request: a precision engine with one of vLLM's drafters refuses the
    per-request keys it could not honour (HTTP 400 through the server), naming why."""
    from types import SimpleNamespace

    from vllm_adaptive.engine.request_validator import engine_request_check

    def engine(spec):
        return SimpleNamespace(
            additional_config={"adaptive": {"precision": {"policy": "gearbx"}}},
            speculative_config=spec,
            model_config=SimpleNamespace(architectures=["LlamaForCausalLM"]),
        )

    drafts = engine_request_check(engine(SimpleNamespace(method="suffix")))
    for key, value in (
        ("adaptive_gear", "low"),
        ("adaptive_mode", "off"),
        ("adaptive_request_tag", "t"),
    ):
        with pytest.raises(VLLMValidationError, match="speculative drafts") as err:
            drafts(SamplingParams(extra_args={key: value}))
        assert err.value.parameter == key
    drafts(SamplingParams(extra_args={"other_plugin_key": 1}))
    plain = engine_request_check(engine(None))
    plain(SamplingParams(extra_args={"adaptive_gear": "low", "adaptive_request_tag": "t"}))
