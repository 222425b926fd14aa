"""KV strategies as objects with explicit inputs and outputs: each hook is called here on a
hand-made `KvState` (a depth record, counters, a schedule and a stand-in for the engine's
attention), with no depth runtime and no engine, and what it writes is read back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_adaptive.depth.counters import EngineCounters
from vllm_adaptive.depth.kv_strategies import (
    MaskStrategy,
    MonotoneStrategy,
    PlanDraft,
    PropagateStrategy,
    RecomputeStrategy,
    RiverStrategy,
)
from vllm_adaptive.depth.kv_strategies.base import KvState, KvStrategy
from vllm_adaptive.depth.record import SlotDepthRecord
from vllm_adaptive.depth.schedule import DepthSchedule
from vllm_adaptive.depth.step import StepPlan

L = 8
BLOCK = 4


class NoAttention:
    """The engine's attention where a hook must not need it: any call is a test failure."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the hook asked the engine's attention for {name!r}")


def _state(refresh_every: int | None = None, warnings: list | None = None) -> KvState:
    record = SlotDepthRecord(4 * BLOCK, BLOCK)
    schedule = DepthSchedule(
        readout_layers=(2, 4, 6, 8), refresh_every=refresh_every, refresh_raise=4
    )
    log = warnings if warnings is not None else []
    return KvState(
        num_layers=L,
        record=record,
        store=None,
        counters=EngineCounters(),
        attention=NoAttention(),
        schedule=schedule,
        warn_once=lambda key, msg: log.append(key),
    )


def _draft(rows: int = 1) -> PlanDraft:
    return PlanDraft(cap=np.full(rows, L, dtype=np.int64), all_visible_below=L, resume=[])


def _plan(all_visible_below: int) -> StepPlan:
    one = torch.ones(1, dtype=torch.long)
    return StepPlan(
        cap=one * L,
        floor=one * 0,
        may_exit=torch.ones(1, dtype=torch.bool),
        thresholds=torch.zeros(1, 4),
        decode=np.ones(1, dtype=bool),
        samples=np.ones(1, dtype=bool),
        states=None,
        all_visible_below=all_visible_below,
        resume=[],
    )


BLOCK_ROW = torch.tensor([2, 0, 1, 3])  # a request's block-table row: positions 0-3 in block 2


def _write(state: KvState, position: int, depth: int) -> None:
    state.record.write(state.record.slots(BLOCK_ROW, torch.tensor([position])), depth)


def test_monotone_caps_a_decode_token_at_the_previous_ones_depth() -> None:
    state, draft = _state(), _draft()
    _write(state, 4, 6)  # the token before position 5 ran 6 layers
    MonotoneStrategy().plan_decode(state, None, draft, 0, BLOCK_ROW, 5, t=3)
    assert draft.cap.tolist() == [6]
    _write(state, 4, L)  # control: a full-depth previous token leaves the cap at L
    draft = _draft()
    MonotoneStrategy().plan_decode(state, None, draft, 0, BLOCK_ROW, 5, t=3)
    assert draft.cap.tolist() == [L]


def test_monotone_refresh_keeps_the_cap_without_exit_states() -> None:
    state, draft = _state(refresh_every=2), _draft()
    _write(state, 4, 4)
    # t = 2 is a refresh: the cap would rise to 8, but no exit states are stored to backfill
    # from (store None), so the old cap stands and nothing is written
    MonotoneStrategy().plan_decode(state, None, draft, 0, BLOCK_ROW, 5, t=2)
    assert draft.cap.tolist() == [4] and state.counters.backfilled_kv == 0


def test_monotone_warns_on_an_unrecorded_previous_slot() -> None:
    warnings: list = []
    state, draft = _state(warnings=warnings), _draft()
    MonotoneStrategy().plan_decode(state, None, draft, 0, BLOCK_ROW, 5, t=3)
    assert warnings == ["prev0"] and draft.cap.tolist() == [L]


def test_default_prefill_caps_at_the_shallowest_context_and_counts_it() -> None:
    state, draft = _state(), _draft(2)
    KvStrategy().plan_prefill(state, draft, 1, low=4)
    KvStrategy().plan_prefill(state, draft, 0, low=None)  # no context: no cap
    assert draft.cap.tolist() == [L, 4] and state.counters.capped_prefills == 1


def test_mask_leaves_prefills_uncapped_and_publishes_the_visible_layers() -> None:
    state, draft = _state(), _draft(2)
    _write(state, 0, 3)
    _write(state, 1, L)
    MaskStrategy().plan_prefill(state, draft, 0, low=3)
    MaskStrategy().plan_decode(state, None, draft, 1, BLOCK_ROW, 2, t=1)
    assert draft.cap.tolist() == [L, L] and draft.all_visible_below == 3
    mask = MaskStrategy().step_mask(state, _plan(draft.all_visible_below))
    assert mask is not None and mask.all_visible_below == 3 and mask.record is state.record.depth
    assert state.counters.masked_steps == 1
    assert MaskStrategy().step_mask(state, _plan(L)) is None  # every slot visible: no mask
    assert state.counters.masked_steps == 1


def test_recompute_plans_to_resume_a_shallow_previous_token() -> None:
    state, draft = _state(), _draft()
    _write(state, 4, 2)
    RecomputeStrategy().plan_decode(state, None, draft, 0, BLOCK_ROW, 5, t=3)
    slot = int(state.record.slots(BLOCK_ROW, torch.tensor([4])))
    assert draft.resume == [(0, 4, slot, 2)]
    _write(state, 4, L)  # control: a full-depth previous token needs no resume
    draft = _draft()
    RecomputeStrategy().plan_decode(state, None, draft, 0, BLOCK_ROW, 5, t=3)
    assert draft.resume == []


def test_propagate_writes_nothing_for_a_token_that_ran_every_layer() -> None:
    state = _state()
    stream = torch.zeros(1, 16)
    PropagateStrategy().exited(state, None, stream, torch.tensor([0]), torch.tensor([0]), L)
    assert state.counters.propagated_kv == 0


@pytest.mark.parametrize("cls", [MonotoneStrategy, MaskStrategy, PropagateStrategy])
def test_peeling_strategies_leave_the_layer_loop_to_the_runtime(cls) -> None:
    strategy = cls()
    assert not strategy.owns_layer_loop
    with pytest.raises(NotImplementedError, match="depth-peeling"):
        strategy.run_layers(_state(), None, None, None, None, None, None, None)


def test_the_river_owns_its_layer_loop() -> None:
    assert RiverStrategy.owns_layer_loop and RiverStrategy.fills_every_layer
