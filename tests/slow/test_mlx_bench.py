"""Full-suite only: `vllm-adaptive bench --backend mlx` end to end on a tiny workload, and the
MLX model's logits against transformers (the RoPE config fix) at a longer context."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install '.[mlx]')")


def test_bench_backend_mlx_end_to_end(model_dir: Path, tmp_path: Path) -> None:
    from vllm_adaptive.corpora import default_code_corpus

    corpus = default_code_corpus(tmp_path / "code.txt", max_chars=200_000)
    out = tmp_path / "bench.json"
    cmd = [
        str(Path(sys.executable).parent / "vllm-adaptive"),
        "bench",
        "--backend",
        "mlx",
        "--model",
        str(model_dir),
        "--corpus",
        str(corpus),
        "--config",
        "{}",
        "--config",
        '{"precision": {"policy": "fixed", "gear": "int8"}}',
        "--dtype",
        "float32",
        "--prompts",
        "1",
        "--prompt-tokens",
        "16",
        "--max-tokens",
        "8",
        "--ppl-streams",
        "1",
        "--ppl-prefix",
        "8",
        "--ppl-tokens",
        "16",
        "--json",
        str(out),
        "--table-md",
        str(tmp_path / "table.md"),
    ]
    subprocess.run(cmd, check=True, timeout=1200)
    res = json.loads(out.read_text())
    assert res["backend"] == "mlx" and res["env"]["cpu"]["flags"]
    off, int8 = res["runs"]
    assert off["identical_free_running"] and off["greedy_agreement"] == 1.0
    assert off["ppl"] == pytest.approx(res["baseline"]["ppl"], rel=1e-9)
    assert int8["gears"]["teacher_forced_by_corpus"]["code.txt"]["fractions"]["high"] == 1.0
    assert "stock mlx-lm" in (tmp_path / "table.md").read_text()


def test_mlx_logits_match_transformers(model_dir: Path) -> None:
    """mlx-lm reads top-level rope_theta only; SmolLM2's config nests it (transformers 5)."""
    import mlx_lm

    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from vllm_adaptive.metal_backend.loading import load_mlx

    model, tok = load_mlx(model_dir, "float32")
    ids = tok.encode(Path(argparse.__file__).read_text()[:8000])[:256]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    ours = np.array(model(mx.array(ids)[None])[0])
    raw, _ = mlx_lm.load(str(model_dir))  # the checkpoint's config as written
    raw.set_dtype(mx.float32)
    theirs = np.array(raw(mx.array(ids)[None])[0])
    assert np.abs(ours - ref).max() < 1e-3
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    assert (theirs.argmax(-1) == ref.argmax(-1)).mean() < 0.95
