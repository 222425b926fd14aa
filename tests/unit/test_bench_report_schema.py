"""The JSON a bench run writes, its markdown table and plots, from synthetic engine records
shaped like engine_run's and merged by the harness's own code (no engines)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_adaptive.bench.plot import plot_pareto, plot_ratios
from vllm_adaptive.bench.report import depth_table_markdown, main
from vllm_adaptive.bench.summary import merge_rounds, summarize_all, summarize_peers
from vllm_adaptive.flops import DenseShape

SHAPE = DenseShape(num_layers=30, hidden=576, intermediate=1536, num_heads=9, num_kv_heads=3,
                   head_dim=64, vocab=49152)  # fmt: skip
WORKLOAD = {
    "prompts": [[1, 2]] * 8,
    "streams": [{"corpus": 0, "prefix": [1], "forced": [5] * 5}],
}
CORPORA = [SimpleNamespace(path="code.txt")]
STREAM = {"copy_gbs": 20.0, "triad_gbs": 12.0, "read_gbs": 16.0, "best_gbs": 20.0}
DENSE = {"weight_bytes_per_step": 5.4e8, "decoder_bytes": 4.2e8, "lm_head_bytes": 1.1e8}


def _round(scale: float, lp: float, greedy: list[int], outputs: list[list[int]]) -> dict:
    tps = {"1": 20.0 * scale, "8": 100.0 * scale}
    return {
        "engine_start_s": 30.0,
        "pids": {"worker": 11, "engine_core": 10, "frontend": 9},
        "decode_tokens_per_s": tps,
        "ttft_s": {b: 0.05 for b in tps},
        "itl_s": {b: int(b) / v for b, v in tps.items()},
        "cpu_s_per_token": {
            "worker": {b: 0.9 * int(b) / v for b, v in tps.items()},
            "engine_core": {b: 0.3 * int(b) / v for b, v in tps.items()},
        },
        "teacher_forced": {
            "logprobs": [[lp] * 4],
            "greedy": [greedy],
            "prefill_logprobs": [[lp] * 4],
        },
        "free_running_outputs": outputs,
        "dispatch": None,
        "linear_methods": {"UnquantizedLinearMethod": 120},
        "memory": {"peak_mb": 1000.0, "param_bytes": 1e8},
    }


def _engine(scales: list[float], lp: float, greedy: list[int], outputs: list[list[int]]):
    return merge_rounds([_round(s, lp, greedy, outputs) for s in scales])


def _results() -> dict[str, Any]:
    ref_out = [[1, 2, 3, 4]] * 8
    stock = _engine([1.0, 0.8, 1.0, 0.9], -2.0, [1, 2, 3, 4], ref_out)
    same = _engine([1.0, 0.8, 1.02, 0.88], -2.0, [1, 2, 3, 4], ref_out)
    peer = _engine([1.5, 1.2, 1.5, 1.3], -2.1, [1, 2, 0, 4], [[1, 9, 3, 4]] * 8)
    baseline, runs = summarize_all(
        [{}], stock, [same], WORKLOAD, SHAPE, 96.0, CORPORA, DENSE, STREAM
    )
    peers = summarize_peers(
        [(str(Path(__file__).parent / "w8a8-ckpt"), peer)], baseline, stock, WORKLOAD,
        CORPORA, STREAM, 4,
    )  # fmt: skip
    return {
        "model": "/m/smollm2",
        "settings": {
            "batch_sizes": [1, 8],
            "rounds": 4,
            "dtype": "float32",
            "enforce_eager": False,
            "free_running_tokens": 4,
        },  # fmt: skip
        "baseline": baseline,
        "runs": runs,
        "peers": peers,
        "env": {},
    }


def test_result_schema(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_adaptive.bench.summary as summary

    monkeypatch.setattr(
        summary, "checkpoint_weight_bytes", lambda d, b: {"weight_bytes_per_step": 2.2e8}
    )
    res = json.loads(json.dumps(_results()))
    base, run, peer = res["baseline"], res["runs"][0], res["peers"][0]
    for entry in (base, run, peer):
        for key in ("decode_tokens_per_s", "decode_tokens_per_s_rounds", "itl_s",
                    "worker_cpu_s_per_token", "cpu_s_per_token", "ppl", "bandwidth",
                    "linear_methods", "dispatch"):  # fmt: skip
            assert key in entry, key
        assert len(entry["decode_tokens_per_s_rounds"]) == 4
        bw = entry["bandwidth"]
        assert set(bw["share_wall"]) == set(bw["share_worker_cpu"]) == {"1", "8"}
    itl = (1 / 20.0 + 1 / 18.0) / 2  # median over rounds at 20, 16, 20, 18 tok/s
    assert base["itl_s"]["1"] == pytest.approx(itl)
    assert base["bandwidth"]["share_wall"]["1"] == pytest.approx(5.4e8 / itl / 20e9)
    assert base["bandwidth"]["share_worker_cpu"]["1"] == pytest.approx(5.4e8 / (0.9 * itl) / 20e9)
    for entry in (run, peer):
        for key in ("speedup", "speedup_spread", "speedup_rounds", "cpu_speedup",
                    "cpu_speedup_spread", "greedy_agreement", "free_running",
                    "ppl_rel_change"):  # fmt: skip
            assert key in entry, key
        assert set(entry["speedup_spread"]["1"]) >= {"median", "q1", "q3", "min", "max", "n"}
    assert run["speedup"]["1"] == pytest.approx(1.0)
    assert run["speedup_spread"]["1"]["min"] == pytest.approx(0.88 / 0.9)
    assert run["free_running"]["agreement"] == 1.0 and run["greedy_agreement"] == 1.0
    assert peer["label"] == "peer: w8a8-ckpt (stock vLLM)"
    assert peer["speedup"]["8"] == pytest.approx(1.5, rel=0.05)
    assert peer["free_running"]["agreement"] == pytest.approx(0.75)
    assert peer["free_running"]["first_divergence_mean"] == 1.0
    assert peer["greedy_agreement"] == pytest.approx(0.75)
    assert peer["bandwidth"]["source"] == "peer checkpoint"


def test_table_and_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_adaptive.bench.summary as summary

    monkeypatch.setattr(
        summary, "checkpoint_weight_bytes", lambda d, b: {"weight_bytes_per_step": 2.2e8}
    )
    res = json.loads(json.dumps(_results()))
    md = depth_table_markdown(res)
    lines = md.splitlines()
    head = [c.strip() for c in lines[0].strip("|").split(" | ")]
    assert head[:5] == ["config", "tok/s ratio b1", "tok/s ratio b8", "CPU/token ratio b1",
                        "CPU/token ratio b8"]  # fmt: skip
    assert any(h.startswith("free-running agreement") for h in head)
    assert "bandwidth share b1 (wall / CPU)" in head
    assert all(line.count(" | ") == lines[0].count(" | ") for line in lines)
    rows = {r.split(" | ")[0].strip("| "): r for r in lines[2:]}
    assert list(rows) == ["stock vLLM", "{}", "peer: w8a8-ckpt (stock vLLM)"]
    assert "1.00 [0.98-1.02]" in rows["{}"]  # median [min-max] of the per-round ratios
    assert "0.750 (1.0)" in rows["peer: w8a8-ckpt (stock vLLM)"]
    plot_pareto(res, str(tmp_path / "p.png"))
    plot_ratios(res, str(tmp_path / "r.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000
    assert (tmp_path / "r.png").stat().st_size > 10_000
    stored = tmp_path / "res.json"
    stored.write_text(json.dumps(res))
    out = tmp_path / "t.md"
    assert main([str(stored), "--table-md", str(out), "--ratio-plot", str(tmp_path / "q.png")]) == 0
    assert out.read_text() == md and (tmp_path / "q.png").exists()
