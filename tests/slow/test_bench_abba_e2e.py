"""`vllm-adaptive bench` end to end with tiny sizes: persistent engines timed in ABBA order
with the W8A8 peer row, then fresh engines per round. Checks the fields every run must carry
(spread over rounds, worker CPU per token, free-running agreement, bandwidth share, machine
record) and the identities stock vs `{}` must satisfy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TINY = [
    "--batch-sizes", "1,2", "--max-tokens", "8", "--prompt-tokens", "32", "--ppl-streams", "3",
    "--ppl-prefix", "32", "--ppl-tokens", "24", "--free-tokens", "12", "--enforce-eager",
    "--kv-cache-gib", "1", "--rounds", "2", "--stream-mib", "16",
]  # fmt: skip


def _bench(model_dir: Path, corpus: Path, out: Path, *extra: str) -> dict:
    cmd = [
        str(Path(sys.executable).parent / "vllm-adaptive"), "bench", "--model", str(model_dir),
        "--corpus", str(corpus), "--config", "{}", "--json", str(out), *TINY, *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "round 2/2 ratios against stock" in proc.stderr  # progress is shown
    return json.loads(out.read_text())


def _check_rounds(entry: dict) -> None:
    assert len(entry["decode_tokens_per_s_rounds"]) == 2
    for b in ("1", "2"):
        sp = entry["speedup_spread"][b]
        assert sp["n"] == 2 and sp["min"] <= entry["speedup"][b] <= sp["max"]
        assert len(entry["speedup_rounds"][b]) == 2
        assert entry["cpu_speedup"][b] > 0


def test_bench_persistent_abba_with_w8a8_peer(model_dir: Path, tmp_path: Path) -> None:
    from vllm_adaptive.corpora import default_code_corpus
    from vllm_adaptive.model_zoo import prepare

    peer_dir = prepare("smollm2-135m-instruct-w8a8", quiet=True)
    corpus = default_code_corpus(tmp_path / "code.txt", max_chars=400_000)
    md, ratio_png = tmp_path / "t.md", tmp_path / "ratios.png"
    res = _bench(
        model_dir, corpus, tmp_path / "b.json", "--peer", str(peer_dir),
        "--table-md", str(md), "--ratio-plot", str(ratio_png), "--plot", str(tmp_path / "p.png"),
    )  # fmt: skip
    s = res["settings"]
    assert s["engines"] == "persistent" and s["rounds"] == 2 and s["dtype"] == "float32"
    base, run, peer = res["baseline"], res["runs"][0], res["peers"][0]

    # stock: worker CPU per decode token, positive and below the wall time per token x2
    for b in ("1", "2"):
        cpu = base["worker_cpu_s_per_token"][b]
        assert 0 < cpu < 2 * base["itl_s"][b] / int(b)
    assert set(base["cpu_s_per_token"]) >= {"worker", "engine_core", "frontend"}

    # {}: the plugin with every mechanism off is stock: same tokens, free-running and forced
    _check_rounds(run)
    assert run["greedy_agreement"] == 1.0
    fr = run["free_running"]
    assert fr["agreement"] == 1.0 and fr["first_divergence_mean"] == 12 and fr["prompts"] == 2

    # the W8A8 peer runs vLLM's int8 kernel and stays a sane model
    _check_rounds(peer)
    assert any("CompressedTensorsW8A8Int8" in k for k in peer["linear_methods"])
    assert -0.05 < peer["ppl_rel_change"] < 0.3
    assert 0.5 < peer["greedy_agreement"] < 1.0
    assert 0.0 < peer["free_running"]["agreement"] <= 1.0
    assert (
        peer["bandwidth"]["weight_bytes_per_step"]
        < 0.5 * base["bandwidth"]["weight_bytes_per_step"]
    )

    for entry in (base, run, peer):
        bw = entry["bandwidth"]
        assert all(0 < v for v in bw["share_wall"].values())
    env = res["env"]
    assert env["cpu"] and env["isa"] and env["stream_bandwidth"]["best_gbs"] > 0
    assert set(env["dispatch"]) == {"stock", "{}", peer["label"]}
    assert env["load_average_start"] is not None
    table = md.read_text()
    assert "peer: smollm2-135m-instruct-w8a8" in table and "CPU/token ratio b1" in table
    assert ratio_png.stat().st_size > 10_000


def test_bench_fresh_engines(model_dir: Path, tmp_path: Path) -> None:
    from vllm_adaptive.corpora import default_code_corpus

    corpus = default_code_corpus(tmp_path / "code.txt", max_chars=400_000)
    res = _bench(model_dir, corpus, tmp_path / "b.json", "--engines", "fresh")
    assert res["settings"]["engines"] == "fresh" and res["peers"] == []
    run = res["runs"][0]
    _check_rounds(run)
    assert run["greedy_agreement"] == 1.0 and run["free_running"]["agreement"] == 1.0
    # memory is read in every round of a fresh engine
    assert len(res["baseline"]["memory"]["peak_mb_rounds"]) == 2
