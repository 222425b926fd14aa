"""The kv_strategy / river config: what is refused at engine start, naming the key (no engine)."""

from __future__ import annotations

import pytest

from vllm_adaptive.config import AdaptiveConfigError, parse_adaptive_config


def _depth(**kw) -> dict:
    return {"depth": {"profile": "/p", **kw}}


@pytest.mark.parametrize("strategy", ["monotone", "mask", "propagate", "recompute", "river"])
def test_every_strategy_parses_with_every_signal(strategy: str) -> None:
    for policy in ("emad", "quicksilver", "river", ["river", "emad"]):
        cfg = parse_adaptive_config(_depth(kv_strategy=strategy, signal={"policy": policy}))
        assert cfg.depth.kv_strategy == strategy


def test_default_strategy_is_monotone_and_river_defaults_apply() -> None:
    assert parse_adaptive_config(_depth()).depth.kv_strategy == "monotone"
    river = parse_adaptive_config(_depth(kv_strategy="river")).depth.river_settings
    assert (river.entry_layer, river.group_size, river.symmetric) == (1, 32, False)
    assert river.offload_backbone is False


def test_refresh_only_with_monotone() -> None:
    refresh = {"every": 8, "raise_layers": 2}
    parse_adaptive_config(_depth(refresh=refresh))
    for strategy in ("mask", "propagate", "recompute", "river"):
        with pytest.raises(AdaptiveConfigError, match="refresh"):
            parse_adaptive_config(_depth(kv_strategy=strategy, refresh=refresh))


def test_river_settings_need_the_river_strategy() -> None:
    with pytest.raises(AdaptiveConfigError, match="river"):
        parse_adaptive_config(_depth(kv_strategy="mask", river={"entry_layer": 4}))


@pytest.mark.parametrize(
    "bad, key",
    [
        ({"kv_strategy": "skip"}, "kv_strategy"),
        ({"kv_strategy": "river", "river": {"entry_layer": 0}}, "entry_layer"),
        ({"kv_strategy": "river", "river": {"group_size": 4}}, "group_size"),
        ({"kv_strategy": "river", "river": {"offload": True}}, "offload"),
    ],
)
def test_bad_values_name_their_key(bad: dict, key: str) -> None:
    with pytest.raises(AdaptiveConfigError, match=key):
        parse_adaptive_config(_depth(**bad))


def test_depth_combines_only_with_a_fixed_precision() -> None:
    """One gear for the whole step survives depth-peeling's shrinking batch; per-token plans
    do not, so entropy-routed policies (and token routing) are refused with depth."""
    fixed = {"policy": "fixed", "gear": "fp16", "modules": ["lm_head"]}
    cfg = parse_adaptive_config({**_depth(kv_strategy="river"), "precision": fixed})
    assert cfg.precision.gear == "fp16" and cfg.depth.kv_strategy == "river"
    for precision in (
        {"policy": "gearbx"},
        {"policy": "quicksilver"},
        {**fixed, "routing": "token"},
    ):
        with pytest.raises(AdaptiveConfigError, match='"depth" combines only with a "fixed"'):
            parse_adaptive_config({**_depth(), "precision": precision})
