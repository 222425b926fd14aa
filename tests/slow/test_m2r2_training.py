"""`vllm-adaptive train m2r2` on the real default model: a short run, its curves and
checkpoints, the loss going down, and an interrupted run resumed to the same weights.

The training runs use one torch thread: on this 2-core machine, next to other CPU work, two
OpenMP threads spin against each other and run ~10x slower.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vllm_adaptive.m2r2.adapters import M2R2Adapters

# -- training --------------------------------------------------------------------------------
STEPS, HALF = 24, 12
TRAIN_ARGS = {
    "steps": STEPS,
    "batch": 2,
    "seq_len": 64,
    "lr": 1e-2,
    "save_every": HALF,
    "val_every": HALF,
    "val_windows": 4,
    "labels": "model",
    "threads": 1,
    "device": "cpu",
    "seed": 0,
}


@pytest.fixture(scope="module")
def small_corpora(tmp_path_factory) -> list[Path]:
    """Two small text files (Python stdlib source), so tokenising takes no time."""
    from vllm_adaptive.corpora import default_code_corpus

    d = tmp_path_factory.mktemp("m2r2-corpora")
    text = default_code_corpus(d / "all.txt", max_chars=400_000).read_text()
    a, b = d / "a.txt", d / "b.txt"
    a.write_text(text[:250_000])
    b.write_text(text[250_000:])
    return [a, b]


def _cli(model_dir, corpora, out, **kw) -> list[str]:
    args = [sys.executable, "-m", "vllm_adaptive.cli", "train", "m2r2", "--model", str(model_dir)]
    for c in corpora:
        args += ["--corpus", str(c)]
    args += ["--out", str(out), "--mode", "spec", "--k", "4", "--rank", "8", "--no-progress"]
    for key, value in kw.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


@pytest.fixture(scope="module")
def cli_run(model_dir, small_corpora, tmp_path_factory):
    out = tmp_path_factory.mktemp("m2r2-run")
    t0 = time.time()
    proc = subprocess.run(
        _cli(model_dir, small_corpora, out, **TRAIN_ARGS),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, time.time() - t0, proc


def _records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_cli_training_smoke(cli_run, model_dir):
    out, seconds, proc = cli_run
    assert seconds < 120, f"{STEPS} steps took {seconds:.0f}s"
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    for name in ("adapter.json", "adapter.safetensors", "metrics.jsonl", "curves.png"):
        assert (out / name).is_file(), name
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for step in (HALF, STEPS):
        ck = out / f"checkpoint-{step}"
        assert {p.name for p in ck.iterdir()} == {
            "adapter.json",
            "adapter.safetensors",
            "trainer_state.pt",
        }
    recs = _records(out)
    assert [r["step"] for r in recs if r["kind"] == "train"] == list(range(1, STEPS + 1))
    val = [r for r in recs if r["kind"] == "val"]
    assert [r["step"] for r in val] == [0, HALF, STEPS]
    # step 0: zero adapters are exactly the early exit
    assert val[0]["agree"] == val[0]["baseline_agree"]
    assert abs(val[0]["ce_model"] - val[0]["baseline_ce_model"]) < 1e-3
    adapters, meta = M2R2Adapters.load(out, model_dir=model_dir)
    assert meta["step"] == STEPS and meta["k"] == 4 and meta["mode"] == "spec"
    assert meta["training_args"]["labels"] == "model"
    assert meta["validation"]["step"] == STEPS


def test_training_decreases_loss(cli_run):
    """Measured on the same held-out windows (no batch noise) and on the training curve."""
    recs = _records(cli_run[0])
    val = [r for r in recs if r["kind"] == "val"]
    assert val[-1]["loss"] < 0.85 * val[0]["loss"], [v["loss"] for v in val]
    assert val[-1]["ce_model"] < val[0]["ce_model"] - 1.0
    train = [r["loss"] for r in recs if r["kind"] == "train"]
    assert sum(train[-6:]) / 6 < 0.9 * sum(train[:6]) / 6, train


def test_resume_continues_exactly(cli_run, model_dir, small_corpora, tmp_path):
    """Interrupted after checkpoint-12, resumed: same weights as the uninterrupted run."""
    out = tmp_path / "resumed"
    first = subprocess.run(
        _cli(model_dir, small_corpora, out, **TRAIN_ARGS, stop_after=HALF),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert (out / f"checkpoint-{HALF}").is_dir() and not (out / "adapter.json").exists()
    second = subprocess.run(
        [*_cli(model_dir, small_corpora, out, **TRAIN_ARGS), "--resume"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"at step {HALF}" in second.stderr
    recs = _records(out)
    assert [r["step"] for r in recs if r["kind"] == "train"] == list(range(1, STEPS + 1))
    resumed, meta = M2R2Adapters.load(out)
    straight, _ = M2R2Adapters.load(cli_run[0])
    assert meta["step"] == STEPS
    for (name, a), (_, b) in zip(
        resumed.state_dict().items(), straight.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    # a resume with other arguments is refused
    bad = subprocess.run(
        [*_cli(model_dir, small_corpora, out, **{**TRAIN_ARGS, "lr": 1e-3}), "--resume"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bad.returncode == 2 and "other arguments" in bad.stderr
