"""`vllm-adaptive moe bench`: how repeats are combined, tabulated and plotted (no engine; the
bench itself runs engines and is not a test, docs/moe-runtime.md)."""

from __future__ import annotations

import pytest

from vllm_adaptive.bench.moe import combine_runs, combine_stats
from vllm_adaptive.bench.moe_report import plot_bench, table


def _run(tps: float, tokens=((1, 2), (3, 4))) -> dict:
    gen = sum(len(t) for t in tokens)
    return {
        "seconds": gen / tps,
        "generated_tokens": gen,
        "tokens_per_s": tps,
        "load_average_1min": tps / 10,
        "tokens": [list(t) for t in tokens],
    }


def _stats(hits: int, misses: int, correct: int) -> dict:
    return {
        "slots": 60,
        "loader_cpus": [1],
        "hits": hits,
        "misses": misses,
        "late": 1,
        "loads": misses,
        "prefetches": 5,
        "prefetch_skipped": 0,
        "prefetch_promoted": 1,
        "prefetch_cancelled": 0,
        "evictions": misses,
        "stall_seconds": 0.5,
        "load_seconds": 1.0,
        "bytes_read": 100 * misses,
        "violations": 0,
        "tokens": 4,
        "steps": 2,
        "forward_seconds": 2.0,
        "hit_rate": hits / (hits + misses),
        "prediction": {"1": {"predicted": 10, "needed": 8, "correct": correct}},
    }


def test_repeats_combine_into_median_min_max_and_summed_counters() -> None:
    r = combine_runs([_run(5.0), _run(2.0), _run(4.0)])
    assert r["repeats"] == 3 and r["tokens_per_s"] == 4.0
    assert r["tokens_per_s_spread"] == {"median": 4.0, "min": 2.0, "max": 5.0, "runs": [5, 2, 4]}
    assert r["generated_tokens"] == 12 and r["seconds"] == pytest.approx(4 / 5 + 4 / 2 + 4 / 4)
    assert r["repeats_identical"] and r["load_average_1min"] == 0.5
    assert not combine_runs([_run(5.0), _run(5.0, ((1, 2), (3, 5)))])["repeats_identical"]

    s = combine_stats([_stats(3, 1, 8), _stats(1, 3, 4)])
    assert (s["hits"], s["misses"], s["stall_seconds"], s["slots"]) == (4, 4, 1.0, 60)
    assert s["hit_rate"] == 0.5
    assert s["prediction"]["1"] == {
        "predicted": 20,
        "needed": 16,
        "correct": 12,
        "recall": 0.75,
        "precision": 0.6,
    }


def test_table_and_plot_show_the_spread(tmp_path) -> None:
    from vllm_adaptive.bench.moe import _summary

    cell = combine_runs([_run(5.0), _run(2.0), _run(4.0)])
    stats = combine_stats([_stats(3, 1, 8)] * 3)
    resident = combine_runs([_run(8.0), _run(10.0), _run(9.0)])
    rows = []
    for corpus in ("prose", "code"):
        for capacity in (0.25, 1.0):
            rows.append(
                {
                    "corpus": corpus,
                    "capacity": capacity,
                    "predictor": "pregate",
                    "lookahead": 2,
                    "batch": 1,
                    "tokens_per_s": cell["tokens_per_s"],
                    "tokens_per_s_spread": cell["tokens_per_s_spread"],
                    "speed_vs_resident": cell["tokens_per_s"] / resident["tokens_per_s"],
                    "seconds": cell["seconds"],
                    "generated_tokens": cell["generated_tokens"],
                    "tokens_identical_to_resident": True,
                    **_summary(stats, cell),
                }
            )
    result = {
        "top_k": 8,
        "eviction": "cyclic",
        "repeats": 3,
        "workload": {"corpora": ["prose.txt", "code.txt"]},
        "env": {"cpu": "test"},
        "resident": {"prose/b1": resident, "code/b1": resident},
        "tiered": rows,
    }
    text = table(result)
    assert text.startswith("| corpus, batch |")
    assert "| prose, 1 | 25% | pregate d=2 | 4.00 [2.00-5.00] (0.44x) |" in text
    assert "prose/b1: 9.00 [8.00-10.00] tok/s" in text
    plot_bench(result, tmp_path / "moe.png")
    assert (tmp_path / "moe.png").stat().st_size > 10_000
