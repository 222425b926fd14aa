"""`vllm-adaptive bench --spec` end to end: stock, vLLM's ngram drafter and the hybrid W8A8
self-draft alive together and timed in ABBA rounds, every engine a real vLLM engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from vllm_adaptive.corpora import default_code_corpus


def test_spec_bench_end_to_end(model_dir: Path, tmp_path: Path) -> None:
    corpus = default_code_corpus(tmp_path / "code.txt", max_chars=400_000)
    out, plot = tmp_path / "spec.json", tmp_path / "spec.png"
    hybrid = {"draft": {"draft": "lowbit", "precision": "w8a8", "prompt_lookup": {}}, "k": 3}
    cmd = [
        str(Path(sys.executable).parent / "vllm-adaptive"),
        "bench",
        "--model",
        str(model_dir),
        "--corpus",
        str(corpus),
        "--spec",
        json.dumps({"method": "ngram", "k": 4}),
        "--spec",
        json.dumps(hybrid),
        "--json",
        str(out),
        "--plot",
        str(plot),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--batch-sizes",
        "1,2",
        "--max-tokens",
        "16",
        "--prompt-tokens",
        "32",
        "--kv-cache-gib",
        "1",
        "--rounds",
        "2",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert plot.stat().st_size > 10_000
    assert res["env"]["cpu"] and "cpu_flags" in res["env"]  # the machine is on record
    corpus_result = res["corpora"]["code.txt"]
    assert set(corpus_result["stock_decode_tokens_per_s"]) == {"1", "2"}
    assert len(corpus_result["stock_decode_tokens_per_s_rounds"]) == 2
    ngram, self_draft = corpus_result["runs"]
    assert self_draft["label"] == "prompt lookup, else lowbit w8a8 k=3"
    for run in (ngram, self_draft):
        assert run["identical_to_stock"] == 1.0  # float32 speculation is lossless
        for b in ("1", "2"):
            sp = run["speedup_spread"][b]
            assert sp["n"] == 2 and sp["min"] <= run["speedup"][b] <= sp["max"]
    assert 0.3 < self_draft["acceptance_rate"] <= 1.0  # the W8A8 draft is usually right
