"""Adaptive-depth pieces alone: the schedule, the per-slot record, peeling's token index,
budget -> thresholds, and the persistent-batch mirror."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_adaptive.batch_mirror import SlotMirror
from vllm_adaptive.depth.attention_port import token_index
from vllm_adaptive.depth.exit_profile import ExitProfile
from vllm_adaptive.depth.record import SlotDepthRecord
from vllm_adaptive.depth.schedule import DepthSchedule

READOUT = (2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)


def test_floor_tapers_linearly_and_snaps_up_to_a_readout_layer() -> None:
    s = DepthSchedule(READOUT, floor_tokens=16, floor_min=10)
    floors = [s.floor(t) for t in range(0, 20)]
    assert floors[0] == 30 and floors[16] == 10 and floors[19] == 10
    assert all(a >= b for a, b in zip(floors, floors[1:], strict=False))  # non-increasing
    assert all(f in READOUT for f in floors)
    # t=1: ceil(30 - 20/16) = 29 -> snapped up to 30
    assert s.floor(1) == 30
    assert DepthSchedule(READOUT).floor(5) == 0  # no floor
    assert DepthSchedule(READOUT, floor_tokens=4).floor(4) == 2  # default: shallowest probe


def test_cap_is_previous_depth_except_at_refresh() -> None:
    s = DepthSchedule(READOUT, refresh_every=8, refresh_raise=3)
    assert s.cap(7, 12) == 12
    assert s.cap(8, 12) == 16  # 12 + 3 = 15 -> snapped up to 16
    assert s.cap(16, 30) == 30
    assert s.cap(8, 29) == 30
    assert DepthSchedule(READOUT).cap(8, 12) == 12  # refresh off


def test_record_maps_positions_through_the_block_table() -> None:
    rec = SlotDepthRecord(num_slots=8 * 4, block_size=4)
    row = torch.tensor([5, 2, 7], dtype=torch.int32)  # positions 0-3 in block 5, 4-7 in 2 ...
    slots = rec.slots(row, torch.arange(10))
    assert slots.tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29]
    rec.write(slots, 30)
    rec.write(slots[6:7], 12)
    assert rec.context_min(row, 6) == 30  # positions 0..5
    assert rec.context_min(row, 7) == 12
    assert rec.context_min(row, 0) is None
    assert rec.read(torch.tensor([0])).item() == 0  # never written


def test_token_index_selects_the_tokens_of_given_requests() -> None:
    qsl = torch.tensor([0, 1, 4, 5, 9])  # requests with 1, 3, 1, 4 tokens
    assert token_index(qsl, torch.tensor([1, 3])).tolist() == [1, 2, 3, 5, 6, 7, 8]
    assert token_index(qsl, torch.tensor([0, 2])).tolist() == [0, 4]
    assert token_index(qsl, torch.tensor([], dtype=torch.long)).tolist() == []


def _profile() -> ExitProfile:
    q = np.linspace(0, 1, 5)
    table = np.stack([np.full(3, -1.0 + 2 * x) for x in q])  # thresholds rise with q
    cost = np.array([0.95, 0.8, 0.6, 0.45, 0.3])  # cost falls with q
    z = torch.zeros(3, 4)
    return ExitProfile(
        probe_layers=[4, 8, 12],
        num_layers=16,
        temperature=1.0,
        budget=0.6,
        budget_kind="layers",
        norm_a=z,
        norm_b=z,
        lowrank_u=torch.zeros(10, 2),
        lowrank_v=torch.zeros(4, 2),
        proxy="lowrank",
        feature_knots=[],
        topk=32,
        proxy_floor=np.zeros(3),
        thresholds=table[2],
        table_thresholds=table,
        table_cost=cost,
    )


def test_budget_picks_the_most_conservative_row_within_it() -> None:
    p = _profile()
    assert np.all(np.isneginf(p.thresholds_for(1.0)))  # 1.0: no exits at all
    assert p.thresholds_for(0.95)[0] == pytest.approx(-1.0)
    assert p.thresholds_for(0.7)[0] == pytest.approx(0.0)  # first row with cost <= 0.7
    assert p.thresholds_for(0.6)[0] == pytest.approx(0.0)
    assert p.thresholds_for(0.1)[0] == pytest.approx(1.0)  # unreachable: the cheapest row
    lows = [p.thresholds_for(b)[0] for b in (0.9, 0.7, 0.5, 0.3)]
    assert lows == sorted(lows)  # a smaller budget never lowers thresholds


def test_the_profiles_own_budget_gets_the_thresholds_it_was_calibrated_to() -> None:
    """A profile calibrated to an agreement target stores the target's thresholds; its cost is
    not monotone in q, so the table's first row within that cost may be a more aggressive one.
    The profile's own budget gets its own thresholds; other budgets the table's rows."""
    import dataclasses

    own = np.array([-0.75, -0.75, -0.75])  # between the table's rows 0 (-1) and 1 (-0.5)
    p = dataclasses.replace(_profile(), budget=0.9, thresholds=own)
    assert p.thresholds_for(0.9).tolist() == own.tolist()
    assert p.thresholds_for(0.9 + 1e-3)[0] == pytest.approx(-0.5)  # the table, as before
    assert p.thresholds_for(0.8)[0] == pytest.approx(-0.5)
    assert _profile().thresholds_for(0.6).tolist() == _profile().thresholds.tolist()


def test_slot_mirror_follows_adds_removes_moves_and_swaps() -> None:
    finished: list[str] = []
    mirror: SlotMirror[str] = SlotMirror(lambda params, p, o: params, finished.append)
    Move = SimpleNamespace
    swap, move = SimpleNamespace(name="SWAP"), SimpleNamespace(name="UNIDIRECTIONAL")
    mirror.apply(
        Move(added=[(0, "a", [], []), (1, "b", [], []), (2, "c", [], [])], removed=[], moved=[])
    )
    assert mirror.rows(3) == ["a", "b", "c"]
    mirror.apply(Move(added=[], removed=[1], moved=[(2, 1, move)]))
    assert finished == ["b"] and mirror.rows(2) == ["a", "c"]
    mirror.apply(Move(added=[], removed=[], moved=[(0, 1, swap)]))
    assert mirror.rows(2) == ["c", "a"]
    mirror.apply(Move(added=[(0, "d", [], [])], removed=[], moved=[]))
    assert finished == ["b", "c"] and mirror.rows(2) == ["d", "a"]
    assert mirror.rows(3) is None  # a step that does not match the mirror


def test_feature_proxy_matches_the_calibration_map() -> None:
    """The runtime's feature proxy equals calibration's: feature score -> isotonic map."""
    from vllm_adaptive.depth.isotonic import IsotonicMap
    from vllm_adaptive.depth.policies.emad import EmadExitSignal
    from vllm_adaptive.depth.proxies import feature_score

    g = torch.Generator().manual_seed(0)
    u, v = torch.randn(500, 8, generator=g), torch.randn(16, 8, generator=g)
    normed = torch.randn(64, 16, generator=g)
    score = feature_score((normed @ v) @ u.T, 1.0, 32).numpy()
    target = np.sqrt(np.abs(score)) + 0.1 * np.random.default_rng(0).normal(size=score.shape)
    m = IsotonicMap.fit(score, target)
    knots = [(torch.from_numpy(m.x.copy()), torch.from_numpy(m.y.copy()))]
    sig = EmadExitSignal(u, v, 1.0, "feature", knots)
    got = sig.proxy_entropy(normed, 0).double().numpy()
    np.testing.assert_allclose(got, m(score), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="knots"):
        EmadExitSignal(u, v, 1.0, "feature", None)


def test_min_entropy_screen_gives_the_full_entropy_verdicts() -> None:
    """The low-rank signal's min-entropy screen decides exactly as the full entropy does, for
    thresholds at, just above and just below each row's entropy, peaked rows included."""
    from vllm_adaptive.depth.policies.emad import EmadExitSignal

    g = torch.Generator().manual_seed(0)
    u, v = torch.randn(4000, 8, generator=g), torch.randn(16, 8, generator=g)
    scale = torch.logspace(-2, 1.5, 48).unsqueeze(1)  # flat to near one-hot proxy softmaxes
    normed = torch.randn(48, 16, generator=g) * scale
    sig = EmadExitSignal(u, v, 1.0)
    entropy = sig.proxy_entropy(normed, 0)
    assert float(entropy.min()) < 0.05 < 3.0 < float(entropy.max())  # the range is covered
    for shift in (-1e-3, 0.0, 1e-3, 0.5, -0.5):
        th = entropy + shift
        want = entropy <= th
        assert torch.equal(sig.exits(normed, th, 0), want), shift
    assert not sig.exits(normed, torch.full((48,), -float("inf")), 0).any()  # budget 1.0
