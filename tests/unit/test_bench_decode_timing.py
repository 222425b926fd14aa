"""Decode time is the full run minus the prefill-only run: a repeat where that difference is
implausibly small (a slow prefill reading) is dropped, never clamped to a huge tokens/s."""

from __future__ import annotations

import pytest

from vllm_adaptive.bench import engine_run


def _fake(monkeypatch, readings: list[float]) -> None:
    it = iter(readings)
    monkeypatch.setattr(engine_run, "timed_generate", lambda *a, **k: (next(it), {}, None))


def test_implausible_repeat_is_dropped(monkeypatch) -> None:
    # repeat 1: prefill 1.0 / full 1.05 / prefill again 1.2 -> decode 0.05 s: dropped
    # repeat 2: prefill 0.5 / full 3.5 / prefill again 0.6 -> decode 3.0 s
    _fake(monkeypatch, [1.0, 1.05, 1.2, 0.5, 3.5, 0.6])
    got = engine_run.measure_batch(None, [[1]] * 4, 4, 11, 2)
    assert got["decode_tokens_per_s"] == pytest.approx(4 * 10 / 3.0)
    assert got["implausible_repeats"] == 1


def test_all_implausible_is_an_error(monkeypatch) -> None:
    _fake(monkeypatch, [1.0, 1.05, 1.2])
    with pytest.raises(RuntimeError, match="too noisy"):
        engine_run.measure_batch(None, [[1]] * 4, 4, 11, 1)


def test_long_prompt_with_agreeing_prefill_readings_is_kept(monkeypatch) -> None:
    # a 2048-token prompt: prefill 6.1 / full 7.6 / prefill again 6.2 -> decode 1.5 s, 20% of
    # the run, but the two prefill readings agree, so it is a reading, not a hiccup
    _fake(monkeypatch, [6.1, 7.6, 6.2])
    got = engine_run.measure_batch(None, [[1]], 1, 16, 1)
    assert got["decode_tokens_per_s"] == pytest.approx(15 / 1.5)
    assert "implausible_repeats" not in got
