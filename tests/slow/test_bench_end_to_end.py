"""`vllm-adaptive bench` end to end: stock and two configs, every engine a real vLLM engine."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from vllm_adaptive.corpora import default_code_corpus, read_corpus


def test_bench_end_to_end(model_dir: Path, tmp_path: Path) -> None:
    """`vllm-adaptive bench` with config {}: every field, identity figures."""
    corpus = default_code_corpus(tmp_path / "code.txt", max_chars=400_000)
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    cmd = [
        str(Path(sys.executable).parent / "vllm-adaptive"),
        "bench",
        "--model",
        str(model_dir),
        "--corpus",
        str(corpus),
        "--config",
        "{}",
        "--config",
        json.dumps({"precision": {"policy": "quicksilver"}}),
        "--gear-trace",
        str(tmp_path / "gears.png"),
        "--json",
        str(out),
        "--plot",
        str(plot),
        "--batch-sizes",
        "1,2",
        "--max-tokens",
        "8",
        "--prompt-tokens",
        "32",
        "--ppl-streams",
        "3",
        "--ppl-prefix",
        "32",
        "--ppl-tokens",
        "24",
        "--enforce-eager",
        "--dtype",  # the bench defaults to float32; this test's identities are bf16 ones
        "bfloat16",
        "--kv-cache-gib",
        "1",
        "--rounds",
        "2",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert plot.stat().st_size > 10_000

    base = res["baseline"]
    for key in ("decode_tokens_per_s", "ttft_s", "itl_s", "ppl", "flops_per_token"):
        assert key in base
    assert set(base["decode_tokens_per_s"]) == {"1", "2"}
    assert all(v > 0 for v in base["decode_tokens_per_s"].values())
    assert 1.0 < base["ppl"] < 1000.0
    # decode-path forcing and one prefill pass score the same tokens: they must agree
    assert math.isclose(base["ppl"], base["ppl_prefill"], rel_tol=0.03)

    run, geared = res["runs"]
    assert run["config"] == {}
    assert "gears" not in run
    for key in (
        "decode_tokens_per_s",
        "ttft_s",
        "itl_s",
        "ppl",
        "flops_per_token",
        "speedup",
        "ppl_rel_change",
        "greedy_agreement",
        "flops_ratio",
    ):
        assert key in run
    assert run["greedy_agreement"] == 1.0
    assert run["ppl"] == base["ppl"] and run["ppl_rel_change"] == 0.0
    assert run["flops_ratio"] == 1.0
    assert all(s > 0 for s in run["speedup"].values())
    # two rounds, each engine measured twice; the reported figure is their median
    for entry in (base, run):
        rounds = entry["decode_tokens_per_s_rounds"]
        assert len(rounds) == 2
        for b in ("1", "2"):
            lo, hi = sorted(r[b] for r in rounds)
            assert lo <= entry["decode_tokens_per_s"][b] <= hi

    # QuickSilver tiers: gear distribution, traces, resident bytes, the GEARBX ideal anchor
    g = geared["gears"]
    assert g["policy"]["policy"] == "quicksilver" and g["routing"] == "token"
    dist = g["teacher_forced_by_corpus"]["code.txt"]
    assert dist["tokens"] == 3 * 24 and math.isclose(sum(dist["fractions"].values()), 1.0)
    assert 1.0 <= dist["ideal_speedup"] < 1.0 / (1.0 - g["managed_fraction"])
    trace = g["traces"]["code.txt"]
    assert len(trace["entropy_bits"]) == len(trace["gears"]) == 24
    assert g["resident_bytes"]["matryoshka_int8_storage"] > 0
    assert geared["ppl"] > 1.0 and 0.0 <= geared["greedy_agreement"] <= 1.0
    assert (tmp_path / "gears.png").stat().st_size > 10_000

    env = res["env"]
    assert env["vllm"] and env["torch"] and env["cores"] >= 1
    assert env["corpora"][0]["sha256"] == read_corpus(corpus).sha256
