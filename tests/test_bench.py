"""The measurement harness: its pieces alone, then `vllm-adaptive bench` end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from vllm_adaptive.bench.corpus import default_code_corpus, read_corpus, token_windows
from vllm_adaptive.bench.teacher_forcing import FORCE_KEY, TeacherForcingLogitsProcessor
from vllm_adaptive.flops import DenseShape


def _params(forced=None) -> SamplingParams:
    return SamplingParams(max_tokens=2, extra_args={FORCE_KEY: forced} if forced else None)


def test_forcing_processor_tracks_rows_and_steps() -> None:
    proc = TeacherForcingLogitsProcessor(None, torch.device("cpu"), False)
    out_a, out_b = [], [7]
    proc.update_state(
        BatchUpdate(
            3,
            removed=[],
            added=[
                (0, _params([5, 6]), [1], out_a),
                (1, _params(), [1], []),
                (2, _params([3, 4]), [1], out_b),
            ],
            moved=[],
        )
    )
    logits = torch.zeros(3, 10)
    out = proc.apply(logits.clone())
    assert out[0].argmax() == 5 and torch.isinf(out[0]).sum() == 9  # step 0 of [5, 6]
    assert torch.equal(out[1], torch.zeros(10))  # unforced request untouched
    assert out[2].argmax() == 4  # one token already out: step 1 of [3, 4]
    proc.update_state(
        BatchUpdate(3, removed=[1], added=[], moved=[(2, 0, MoveDirectionality.SWAP)])
    )
    out = proc.apply(torch.zeros(3, 10))
    assert out[0].argmax() == 4 and out[2].argmax() == 5


def test_forcing_processor_validates() -> None:
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError):
        TeacherForcingLogitsProcessor.validate_params(SamplingParams(extra_args={FORCE_KEY: "x"}))
    with pytest.raises(VLLMValidationError, match="exceeds"):
        TeacherForcingLogitsProcessor.validate_params(
            SamplingParams(max_tokens=5, extra_args={FORCE_KEY: [1, 2]})
        )


def test_corpus_split_is_disjoint_and_windows_spread(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("".join(f"line {i}\n" for i in range(1000)))
    c = read_corpus(f)
    assert c.calibration_text + c.eval_text == c.text
    assert len(c.eval_text) == pytest.approx(0.1 * len(c.text), abs=2)
    wins = token_windows(list(range(100)), 10, 3)
    assert [w[0] for w in wins] == [0, 30, 60] and all(len(w) == 10 for w in wins)
    with pytest.raises(ValueError, match="too short"):
        token_windows(list(range(20)), 10, 3)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_corpus(bad)


def test_flops_model_counts_smollm2() -> None:
    shape = DenseShape.from_hf_config(
        {
            "num_hidden_layers": 30,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "vocab_size": 49152,
        }
    )
    # 2 x (q 576*576 + kv 2*576*192 + o 576*576 + mlp 3*576*1536) per layer
    per_layer = 2 * (576 * 576 + 2 * 576 * 192 + 576 * 576 + 3 * 576 * 1536)
    assert shape.layer_linear_flops() == per_layer
    full = shape.flops_per_token(context_len=100)
    assert full == 30 * (per_layer + 4 * 9 * 64 * 100) + 2 * 576 * 49152
    assert shape.flops_per_token(100, mean_layers=15) < full


@pytest.mark.engine
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
