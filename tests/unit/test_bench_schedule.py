"""ABBA order, per-round ratios and their spread (vllm_adaptive/bench/schedule.py, harness)."""

from __future__ import annotations

import pytest

from vllm_adaptive.bench.schedule import abba_order, abba_schedule, ratios_per_round, spread
from vllm_adaptive.bench.summary import merge_rounds, speed_ratios


def test_abba_order_alternates_and_balances_positions() -> None:
    assert abba_schedule(2, 4) == [[0, 1], [1, 0], [0, 1], [1, 0]]
    assert abba_order(3, 0) == [0, 1, 2] and abba_order(3, 1) == [2, 1, 0]
    # over an even number of rounds every engine sits at every position equally often, so a
    # drift that is linear in time adds the same to every engine's mean position
    sched = abba_schedule(4, 6)
    mean_pos = [sum(order.index(e) for order in sched) / len(sched) for e in range(4)]
    assert mean_pos == [1.5] * 4


def test_spread_median_quartiles_range() -> None:
    s = spread([1.10, 0.90, 1.00, 1.30])
    assert s["median"] == pytest.approx(1.05)
    assert (s["min"], s["max"], s["n"]) == (0.90, 1.30, 4)
    assert s["q1"] == pytest.approx(0.975) and s["q3"] == pytest.approx(1.15)  # numpy 'linear'
    one = spread([2.0])
    assert one["median"] == one["min"] == one["max"] == one["q1"] == 2.0
    with pytest.raises(ValueError):
        spread([])


def test_ratios_per_round_pairs_rounds() -> None:
    assert ratios_per_round([2.0, 3.0], [1.0, 2.0]) == [2.0, 1.5]
    with pytest.raises(ValueError, match="rounds differ"):
        ratios_per_round([1.0], [1.0, 2.0])


def _round(tps: dict[str, float], worker_cpu: dict[str, float]) -> dict:
    return {
        "engine_start_s": 1.0,
        "decode_tokens_per_s": tps,
        "ttft_s": {b: 0.1 for b in tps},
        "itl_s": {b: int(b) / v for b, v in tps.items()},
        "cpu_s_per_token": {"worker": worker_cpu, "engine_core": dict(worker_cpu)},
    }


def test_speed_ratios_are_medians_of_per_round_ratios() -> None:
    # stock slows down by half in round 2 (a noisy neighbour); the config measured beside it
    # slows down the same: per-round ratios are 1.0 and 1.0, while the ratio of the medians
    # would mix the rounds
    stock = merge_rounds(
        [
            _round({"1": 20.0, "8": 100.0}, {"1": 0.040, "8": 0.010}),
            _round({"1": 10.0, "8": 50.0}, {"1": 0.042, "8": 0.011}),
            _round({"1": 20.0, "8": 100.0}, {"1": 0.040, "8": 0.010}),
        ]
    )
    run = merge_rounds(
        [
            _round({"1": 20.0, "8": 110.0}, {"1": 0.020, "8": 0.010}),
            _round({"1": 10.0, "8": 55.0}, {"1": 0.021, "8": 0.011}),
            _round({"1": 19.0, "8": 110.0}, {"1": 0.020, "8": 0.010}),
        ]
    )
    assert stock["decode_tokens_per_s"] == {"1": 20.0, "8": 100.0}  # median over rounds
    assert stock["decode_tokens_per_s_rounds"][1] == {"1": 10.0, "8": 50.0}
    assert stock["cpu_s_per_token"]["worker"] == {"1": 0.040, "8": 0.010}
    r = speed_ratios(run, stock)
    assert r["speedup"]["1"] == pytest.approx(1.0)
    assert r["speedup_rounds"]["1"] == pytest.approx([1.0, 1.0, 0.95])
    assert r["speedup_spread"]["1"]["min"] == pytest.approx(0.95)
    assert r["speedup"]["8"] == pytest.approx(1.1)
    # CPU ratio: stock's CPU per token over the run's (> 1 = the run needs less)
    assert r["cpu_speedup"]["1"] == pytest.approx(2.0)
    assert r["cpu_speedup_spread"]["8"]["max"] == pytest.approx(1.0)


def test_speed_ratios_without_cpu_or_pairing() -> None:
    stock = merge_rounds([{"decode_tokens_per_s": {"1": 20.0}, "ttft_s": {"1": 0.1},
                           "itl_s": {"1": 0.05}}])  # fmt: skip
    run = merge_rounds([{"decode_tokens_per_s": {"1": 30.0}, "ttft_s": {"1": 0.1},
                         "itl_s": {"1": 0.03}}] * 2)  # fmt: skip
    r = speed_ratios(run, stock)  # rounds cannot be paired: ratio of the medians
    assert r["speedup"]["1"] == pytest.approx(1.5) and r["speedup_spread"]["1"]["n"] == 1
    assert r["cpu_speedup"]["1"] is None
