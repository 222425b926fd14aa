"""The ``adaptive.moe`` section and the MoEfied architecture's place in the registry."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_adaptive.config import AdaptiveConfigError, parse_adaptive_config


def test_defaults_and_valid_sections() -> None:
    moe = parse_adaptive_config({"moe": {}}).moe
    assert (moe.predictor, moe.lookahead, moe.capacity, moe.fast_tier_bytes) == (
        "none",
        1,
        None,
        None,
    )
    cfg = parse_adaptive_config({"moe": {"predictor": "pregate", "lookahead": 3, "capacity": 0.25}})
    assert cfg.active_moe is cfg.moe and cfg.any_mechanism_enabled
    assert parse_adaptive_config({"moe": {"capacity": 1}}).moe.capacity == 1.0
    assert moe.eviction == "cyclic"  # the default (docs/moe-runtime.md, "Eviction policy")
    assert parse_adaptive_config({"moe": {"eviction": "lru"}}).moe.eviction == "lru"
    m2r2 = parse_adaptive_config({"moe": {"predictor": "m2r2", "m2r2_adapters": "/a"}}).moe
    assert (m2r2.predictor, m2r2.m2r2_adapters) == ("m2r2", "/a")
    assert parse_adaptive_config({"moe": {"fast_tier_bytes": 10**8}}).moe.fast_tier_bytes == 10**8
    off = parse_adaptive_config({"mode": "off", "moe": {}})
    assert off.active_moe is None and not off.any_mechanism_enabled


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"capacity": 0}, "adaptive.moe.capacity: Input should be greater than 0"),
        ({"capacity": 1.5}, "adaptive.moe.capacity: Input should be less than or equal to 1"),
        ({"capacity": True}, "adaptive.moe.capacity"),
        ({"capacity": "0.5"}, "adaptive.moe.capacity"),
        ({"fast_tier_bytes": 0}, "adaptive.moe.fast_tier_bytes"),
        ({"fast_tier_bytes": 1.5}, "adaptive.moe.fast_tier_bytes"),
        ({"capacity": 0.5, "fast_tier_bytes": 10}, "not both"),
        ({"predictor": "m2r2"}, 'predictor "m2r2" needs "m2r2_adapters"'),
        ({"predictor": "oracle"}, "adaptive.moe.predictor"),
        ({"predictor": "pregate", "m2r2_adapters": "/x"}, 'only for predictor "m2r2"'),
        ({"predictor": "pregate", "lookahead": 0}, "adaptive.moe.lookahead"),
        ({"lookahead": 2}, 'predictor "none" prefetches nothing'),
        ({"bogus": 1}, "adaptive.moe.bogus: unknown key"),
        ({"eviction": "fifo"}, "adaptive.moe.eviction"),
    ],
)
def test_bad_sections_name_the_key(section, message) -> None:
    with pytest.raises(AdaptiveConfigError, match=message.replace("(", r"\(")):
        parse_adaptive_config({"moe": section})


def test_moe_does_not_combine_with_the_dense_mechanisms() -> None:
    with pytest.raises(AdaptiveConfigError, match='"moe" cannot be combined'):
        parse_adaptive_config({"moe": {}, "speculative": {"draft": "early"}})


def _vllm_config(archs, additional):
    return SimpleNamespace(
        model_config=SimpleNamespace(architectures=archs), additional_config=additional
    )


def test_moe_section_refused_for_a_model_that_is_not_moefied() -> None:
    from vllm_adaptive.engine.request_validator import check_architecture_supported

    check_architecture_supported(_vllm_config(["MoefiedLlamaForCausalLM"], {"adaptive": {}}))
    check_architecture_supported(
        _vllm_config(["MoefiedLlamaForCausalLM"], {"adaptive": {"moe": {"capacity": 0.5}}})
    )
    check_architecture_supported(_vllm_config(["LlamaForCausalLM"], {"adaptive": {}}))
    for arch in ("LlamaForCausalLM", "Gemma3ForCausalLM"):
        with pytest.raises(AdaptiveConfigError, match=r"adaptive\.moe: .* is not MoEfied"):
            check_architecture_supported(_vllm_config([arch], {"adaptive": {"moe": {}}}))


def test_registry_entries_include_the_own_architecture() -> None:
    from vllm_adaptive.architectures import (
        OWN_ARCHITECTURES,
        registry_entries,
        supported_architectures,
    )

    entries = dict(registry_entries())
    assert entries["MoefiedLlamaForCausalLM"] == (
        "vllm_adaptive.models.moefied_llama:MoefiedLlamaForCausalLM"
    )
    assert entries["LlamaForCausalLM"].endswith(":LlamaForCausalLMDispatch")
    assert entries["AdaptiveLlamaForCausalLM"].endswith(":AdaptiveLlamaForCausalLM")
    assert {a.name for a in OWN_ARCHITECTURES} <= supported_architectures()


def test_eagle3_head_architectures_get_the_geared_subclass() -> None:
    """vLLM's EAGLE-3 head class is registered over with a subclass that gears the head's
    linears only where the engine runs the fixed fp16 gear on float32 activations."""
    from types import SimpleNamespace

    import torch

    from vllm_adaptive.architectures import DRAFT_HEAD_ARCHITECTURES, registry_entries
    from vllm_adaptive.models.llama_eagle3 import draft_precision

    entries = dict(registry_entries())
    for name in DRAFT_HEAD_ARCHITECTURES:
        assert entries[name] == "vllm_adaptive.models.llama_eagle3:AdaptiveEagle3LlamaForCausalLM"

    def cfg(adaptive, dtype=torch.float32):
        extra = {} if adaptive is None else {"adaptive": adaptive}
        return SimpleNamespace(additional_config=extra, model_config=SimpleNamespace(dtype=dtype))

    fp16 = {"precision": {"policy": "fixed", "gear": "fp16"}}
    assert draft_precision(cfg(fp16)) == "fp16"
    assert draft_precision(cfg(fp16, torch.bfloat16)) is None
    assert draft_precision(cfg(None)) is None  # stock: vLLM's head untouched
    assert draft_precision(cfg({})) is None  # adaptivity off
    assert draft_precision(cfg({"precision": {"policy": "fixed", "gear": "w8a8"}})) is None
    assert draft_precision(cfg({"precision": {"policy": "gearbx"}})) is None
