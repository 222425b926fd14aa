"""Free-running greedy agreement arithmetic (vllm_adaptive/bench/free_running.py)."""

from __future__ import annotations

import pytest

from vllm_adaptive.bench.free_running import first_divergence, free_running_agreement


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3], 3) == 3
    assert first_divergence([1, 2, 3], [1, 9, 3], 3) == 1
    assert first_divergence([5], [1], 1) == 0
    assert first_divergence([1, 2], [1, 2, 3], 3) == 2  # a missing token counts as different
    assert first_divergence([1, 2, 3, 4], [1, 2, 3, 9], 3) == 3  # only the first n count


def test_free_running_agreement_position_by_position() -> None:
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    run = [[1, 2, 3, 4], [5, 0, 7, 8], [0, 9, 9, 9]]
    fr = free_running_agreement(run, ref, n=4)
    assert fr["agreement"] == pytest.approx(10 / 12)  # 4 + 3 + 3 positions equal
    assert fr["first_divergence"] == [4, 1, 0]
    assert fr["first_divergence_mean"] == pytest.approx(5 / 3)
    assert fr["identical_prompts"] == pytest.approx(1 / 3)
    assert fr["first_token_changed"] == pytest.approx(1 / 3)
    assert (fr["tokens"], fr["prompts"]) == (4, 3)
    same = free_running_agreement(ref, ref, n=2)
    assert same["agreement"] == 1.0 and same["first_divergence_mean"] == 2.0


def test_free_running_agreement_rejects_mismatched_inputs() -> None:
    with pytest.raises(ValueError):
        free_running_agreement([[1]], [[1], [2]])
    with pytest.raises(ValueError):
        free_running_agreement([], [])
