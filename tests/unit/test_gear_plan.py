"""The gear plan's search and the config it writes, on a synthetic sensitivity (the real
model's simulation runs in tests/slow/test_gear_plan_model.py)."""

from __future__ import annotations

import pytest

from vllm_adaptive.config import parse_adaptive_config
from vllm_adaptive.precision.gear_plan import GearPlan, search_plan, spans


def test_spans_merge_adjacent_layers() -> None:
    assert spans([7, 0, 2, 1]) == [(0, 3), (7, 8)]
    assert spans([]) == []


def _additive(loss: list[float]):
    calls: list[set[int]] = []

    def measure(layers: set[int]) -> float:
        calls.append(set(layers))
        return 1.0 - sum(loss[i] for i in layers)

    return measure, calls


def test_search_keeps_the_sensitive_layers_full() -> None:
    loss = [0.02, 0.001, 0.001, 0.01, 0.001, 0.03]
    measure, calls = _additive(loss)
    alone, chosen, agreement, everything, steps = search_plan(measure, len(loss), 0.995)
    assert alone == pytest.approx([1.0 - x for x in loss])
    assert sorted(chosen) == [1, 2, 4]  # the three cheap ones; adding layer 3 breaks 0.995
    assert agreement == pytest.approx(0.997) and agreement >= 0.995
    assert everything == pytest.approx(1.0 - sum(loss))
    assert steps[0]["layers"] == len(loss)
    assert set(chosen) in calls  # the chosen set itself was measured, not extrapolated


def test_search_takes_every_layer_when_the_target_allows() -> None:
    measure, _ = _additive([0.001] * 4)
    _, chosen, agreement, _, steps = search_plan(measure, 4, 0.99)
    assert sorted(chosen) == [0, 1, 2, 3] and len(steps) == 1


def test_search_takes_no_layer_when_each_alone_misses() -> None:
    measure, _ = _additive([0.1] * 4)
    _, chosen, agreement, _, _ = search_plan(measure, 4, 0.95)
    assert chosen == [] and agreement == 1.0


def test_plan_config_parses_and_maps_the_layers() -> None:
    plan = GearPlan(
        gear="w8a8",
        target_agreement=0.97,
        quantized_layers=[3, 4, 9],
        full_layers=[0, 1, 2, 5, 6, 7, 8],
        simulated_agreement=0.975,
        layer_agreement=[0.97] * 10,
        all_layers_agreement=0.93,
        tokens=100,
        seconds=1.0,
        modules=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
        smoothing={"profile": "some/dir", "alpha": 0.5},
    )
    cfg = parse_adaptive_config({"precision": plan.precision_config()}).precision
    maps = [cfg.layer_map(i, 10)[2] for i in range(10)]
    assert maps == ["full"] * 3 + ["w8a8"] * 2 + ["full"] * 4 + ["w8a8"]
    assert "modules" not in plan.precision_config()
    assert cfg.smoothing is not None and cfg.smoothing.profile == "some/dir"
