"""The KV strategy classes alone (no engine): one class per config value, and what each does to
a step's plan, on a small depth record."""

from __future__ import annotations

import logging
import typing

import numpy as np
import pytest
import torch

from vllm_adaptive.config import KvStrategy as KvStrategyName
from vllm_adaptive.config import parse_adaptive_config
from vllm_adaptive.depth.kv_strategies import (
    STRATEGIES,
    KvStrategy,
    PlanDraft,
    build_kv_strategy,
    kv_strategy_class,
)
from vllm_adaptive.depth.record import SlotDepthRecord
from vllm_adaptive.depth.schedule import DepthSchedule

L = 8


class _Counters:
    capped_prefills = 0
    masked_steps = 0


class _Runtime:
    """The runtime attributes the plan hooks read."""

    def __init__(self) -> None:
        self.num_layers = L
        self.record = SlotDepthRecord(num_slots=16, block_size=4)
        self.schedule = DepthSchedule(readout_layers=(2, 4, 6, L))
        self.counters = _Counters()
        self.refreshed: list = []

    def warn_once(self, key: str, msg: str, *args) -> None:
        logging.getLogger("test").warning(msg, *args)

    def _refresh(self, model, block_row, p, cap):
        self.refreshed.append((p, cap))
        return cap


def _draft(rows: int = 1) -> PlanDraft:
    return PlanDraft(cap=np.full(rows, L, dtype=np.int64), all_visible_below=L, resume=[])


def test_one_class_per_config_value() -> None:
    assert set(STRATEGIES) == set(typing.get_args(KvStrategyName))
    for name in STRATEGIES:
        kv = _build(name)
        assert isinstance(kv, KvStrategy) and kv.name == name
    with pytest.raises(ValueError, match="unknown kv_strategy 'skip'"):
        kv_strategy_class("skip")


def test_flags_match_the_strategies() -> None:
    every = {n for n, c in STRATEGIES.items() if c.fills_every_layer}
    assert every == {"propagate", "river"}
    assert {n for n, c in STRATEGIES.items() if c.stores_exit_states} == {"recompute"}
    assert {n for n, c in STRATEGIES.items() if c.needs_masked_attention} == {"mask"}
    no_accel = {n for n, c in STRATEGIES.items() if not c.supports_accelerated_stream}
    assert no_accel == {"river"}


def test_river_entry_layer_is_checked_at_engine_start() -> None:
    cfg = parse_adaptive_config(
        {"depth": {"profile": "/p", "kv_strategy": "river", "river": {"entry_layer": L}}}
    ).depth
    assert "leaves no layer for the river" in kv_strategy_class("river").check_engine(cfg, L)
    assert kv_strategy_class("river").check_engine(cfg, L + 1) is None


def _build(name: str) -> KvStrategy:
    cfg = parse_adaptive_config({"depth": {"profile": "/p", "kv_strategy": name}}).depth
    return build_kv_strategy(cfg)


def _decode_with_previous_depth(name: str, prev: int) -> tuple[_Runtime, PlanDraft]:
    rt = _Runtime()
    block_row = torch.tensor([2, 0, 1, 3])
    rt.record.write(rt.record.slots(block_row, torch.arange(5)), L)
    rt.record.write(rt.record.slots(block_row, torch.tensor([5])), prev)
    draft = _draft()
    kv = _build(name)
    kv.plan_decode(rt, None, draft, 0, block_row, 6, 3)
    return rt, draft


def test_decode_plans() -> None:
    _, d = _decode_with_previous_depth("monotone", 4)
    assert d.cap[0] == 4 and d.all_visible_below == L and not d.resume
    _, d = _decode_with_previous_depth("mask", 4)
    assert d.cap[0] == L and d.all_visible_below == 4 and not d.resume
    _, d = _decode_with_previous_depth("recompute", 4)
    assert d.cap[0] == L and d.all_visible_below == L
    assert d.resume == [(0, 5, 1, 4)]  # position 5: block_row[1] = 0, offset 1 -> slot 1
    for name in ("propagate", "river"):
        _, d = _decode_with_previous_depth(name, 4)
        assert d.cap[0] == L and d.all_visible_below == L and not d.resume


def test_prefill_plans() -> None:
    for name in STRATEGIES:
        rt, d = _Runtime(), _draft()
        _build(name).plan_prefill(rt, d, 0, 3)
        if name == "mask":
            assert d.cap[0] == L and d.all_visible_below == 3
        else:
            assert d.cap[0] == 3 and rt.counters.capped_prefills == 1
