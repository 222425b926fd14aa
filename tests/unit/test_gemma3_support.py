"""Which adaptive mechanisms Gemma 3 accepts, and the messages of those it refuses (the engine
test checks that the same refusals stop a real engine at start)."""

from __future__ import annotations

import pytest

from vllm_adaptive.config import AdaptiveConfigError, parse_adaptive_config
from vllm_adaptive.models.gemma3 import check_gemma3_supported, first_global_layer

# Gemma 3 270M: five sliding-window layers, then one global, three times
LAYER_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 3


def _check(adaptive: dict, hybrid_kv_cache: bool = False) -> None:
    check_gemma3_supported(parse_adaptive_config(adaptive), LAYER_TYPES, hybrid_kv_cache)


def test_first_global_layer() -> None:
    assert first_global_layer(LAYER_TYPES) == 5
    assert first_global_layer(["full_attention"] * 4) == 4


@pytest.mark.parametrize(
    "adaptive",
    [
        {},
        {"mode": "off", "depth": {"profile": "/nonexistent"}},  # kill switch: nothing runs
        {"precision": {"policy": "fixed", "gear": "int8"}},
        {"precision": {"policy": "gearbx"}},
        {"speculative": {"draft": "early"}},
        {"speculative": {"draft": "early", "layers": 5}},
    ],
)
def test_accepted(adaptive: dict) -> None:
    _check(adaptive)
    if "speculative" not in adaptive:
        _check(adaptive, hybrid_kv_cache=True)


def test_early_draft_needs_one_kv_cache_group() -> None:
    with pytest.raises(AdaptiveConfigError, match="disable_hybrid_kv_cache_manager=True") as e:
        _check({"speculative": {"draft": "early"}}, hybrid_kv_cache=True)
    assert str(e.value).startswith("adaptive.speculative: the draft step gives every layer")


@pytest.mark.parametrize(
    "depth",
    [
        {"profile": "/p"},  # monotone, EMAD
        {"profile": "/p", "kv_strategy": "monotone", "budget": 0.8},
        {"profile": "/p", "signal": {"policy": "quicksilver"}},
        {"profile": "/p", "kv_strategy": "mask"},  # the masked backend applies local windows
    ],
)
def test_depth_with_depth_peeling_strategies_accepted(depth: dict) -> None:
    _check({"depth": depth})


def test_depth_needs_one_kv_cache_group() -> None:
    with pytest.raises(AdaptiveConfigError, match="disable_hybrid_kv_cache_manager=True") as e:
        _check({"depth": {"profile": "/p"}}, hybrid_kv_cache=True)
    assert str(e.value).startswith("adaptive.depth: the runtime peels rows on layer 0's")


@pytest.mark.parametrize("strategy", ["propagate", "recompute", "river"])
def test_depth_refused_with_strategies_beyond_peeling(strategy: str) -> None:
    with pytest.raises(AdaptiveConfigError) as e:
        _check({"depth": {"profile": "/p", "kv_strategy": strategy}})
    msg = str(e.value)
    assert msg.startswith(f"adaptive.depth.kv_strategy: {strategy!r} ")
    assert "use one of ['monotone', 'mask']" in msg


@pytest.mark.parametrize(
    ("depth", "needle"),
    [
        ({"signal": {"policy": "arla", "arla": {"adapter": "/a"}}}, 'signal: policy "arla"'),
        ({"refresh": {"every": 8, "raise_layers": 4}}, "adaptive.depth.refresh: refreshing"),
    ],
)
def test_depth_mechanisms_needing_a_block_recipe_refused(depth: dict, needle: str) -> None:
    with pytest.raises(AdaptiveConfigError, match=needle):
        _check({"depth": {"profile": "/p", **depth}})


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"draft": "lowbit"}, 'adaptive.speculative.draft: "lowbit" runs packed copies'),
        ({"draft": "m2r2", "adapter": "/a"}, 'adaptive.speculative.draft: "m2r2" adapters'),
        ({"draft": "early", "layers": 6}, "adaptive.speculative.layers: 6 draft layers reach "),
    ],
)
def test_drafts_refused(spec: dict, needle: str) -> None:
    with pytest.raises(AdaptiveConfigError, match=needle):
        _check({"speculative": spec})
