"""The prefill bench's summary (`vllm_adaptive/bench/prefill.py`) on hand-made bench results."""

from __future__ import annotations

import argparse

import pytest

from vllm_adaptive.bench.args import add_bench_arguments
from vllm_adaptive.bench.prefill import summarize_length, table_markdown


def _results() -> dict:
    fusion = {"removed_fraction": 0.04, "groups": 12}
    return {
        "baseline": {"ttft_s": {"1": 2.0}, "ppl": 10.0},
        "runs": [
            {
                "config": {"depth": {"fusion": {"profile": "/f"}}},
                "ttft_s": {"1": 1.6},
                "ppl": 10.3,
                "ppl_rel_change": 0.03,
                "greedy_agreement": 0.95,
                "free_running": {"agreement": 0.9, "tokens": 64, "prompts": 1},
                "depth": {"engine": {"fusion": fusion}},
            }
        ],
    }


def test_prefill_rates_speedup_and_removed_fraction() -> None:
    s = summarize_length(_results(), 2048)
    assert s["stock"]["prefill_tokens_per_s"] == {"1": 1024.0}
    run = s["runs"][0]
    assert run["prefill_tokens_per_s"] == {"1": 1280.0}
    assert run["ttft_speedup"]["1"] == pytest.approx(1.25)
    assert run["removed_token_layers_fraction"] == 0.04
    table = table_markdown({"lengths": {"2048": s}})
    assert "| 2048 |" in table and "x1.250" in table and "4.00%" in table and "+3.00%" in table


def test_prefill_lens_argument() -> None:
    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    base = ["--model", "m", "--corpus", "c", "--json", "o.json"]
    assert p.parse_args([*base, "--prefill-lens", "512,2048"]).prefill_lens == [512, 2048]
    assert p.parse_args(base).prefill_lens is None
    with pytest.raises(SystemExit):
        p.parse_args([*base, "--prefill-lens", "512,x"])
