"""`vllm-adaptive calibrate` end to end on the real default model (tiny token budgets): EMAD
alone, then with QuickSilver's and River-LLM's signals. (The suite's shared profile is made by
the same `calibrate()` in tests/conftest.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from vllm_adaptive.artifacts import load_profile
from vllm_adaptive.config import SignalConfig
from vllm_adaptive.depth.exit_profile import ExitProfile
from vllm_adaptive.depth.policies.build import build_exit_signal
from vllm_adaptive.depth.policies.probe import ProbeBatch


def test_calibrate_cli_end_to_end(tmp_path: Path) -> None:
    """Real model, tiny token budget: the CLI writes a loadable profile and a summary."""
    from vllm_adaptive.corpora import default_code_corpus
    from vllm_adaptive.model_zoo import prepare

    model = prepare("smollm2-135m-instruct", quiet=True)
    corpus = default_code_corpus(tmp_path / "code.txt", max_chars=200_000)
    out = tmp_path / "profile"
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "vllm_adaptive.cli", "calibrate", "--model", str(model)]
    cmd += ["--corpus", str(corpus), "--out", str(out), "--tokens", "512", "--window", "128"]
    cmd += ["--keep", "32", "--probe-every", "6", "--rank", "16", "--budget", "0.8", "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.perf_counter() - t0 < 180
    assert "greedy agreement with final layer" in proc.stdout
    prof = load_profile(out, model)
    meta = prof.meta
    assert meta["probe_layers"] == [6, 12, 18, 24]
    assert meta["entropy_unit"] == "nats" and meta["rank"] == 16
    assert meta["budget_met"] and meta["simulation"]["layers_fraction"] <= 0.8 + 1e-9
    assert prof.tensors["norm_a"].shape == (4, 576)
    assert prof.tensors["lowrank_u"].shape == (49152, 16)
    assert np.all(np.diff(meta["tau"]) <= 1e-9)


def test_calibrate_signals_cli_end_to_end(tmp_path: Path) -> None:
    """Real model, tiny token budget: `--signal quicksilver --signal river` writes both
    sections into a loadable profile, and the built signals run on real hidden states."""
    from vllm_adaptive.corpora import default_code_corpus
    from vllm_adaptive.depth.calibration.collect import load_model
    from vllm_adaptive.model_zoo import prepare

    model = prepare("smollm2-135m-instruct", quiet=True)
    corpus = default_code_corpus(tmp_path / "code.txt", max_chars=200_000)
    out = tmp_path / "profile"
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "vllm_adaptive.cli", "calibrate", "--model", str(model)]
    cmd += ["--corpus", str(corpus), "--out", str(out), "--tokens", "512", "--window", "128"]
    cmd += ["--keep", "24", "--probe-every", "3", "--rank", "8", "--budget", "0.8", "--quiet"]
    cmd += ["--signal", "quicksilver", "--signal", "river"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.perf_counter() - t0 < 240
    assert "QuickSilver (25th percentiles" in proc.stdout and "River paper tau=0.5" in proc.stdout
    prof = ExitProfile.load(out, model)
    meta = json.loads((out / "profile.json").read_text())
    assert meta["signals"] == ["emad", "quicksilver", "river"]
    assert prof.probe_layers == list(range(3, 30, 3))
    assert prof.special_token_ids and prof.quicksilver_thresholds is not None
    assert -1.0 <= prof.river_tau <= 1.0 and meta["river"]["table"]
    assert len(meta["quicksilver"]["grid"]) == 121

    hf, _, _ = load_model(model)
    ids = torch.tensor([[1] + list(range(200, 230))])
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
    p, layer = 3, prof.probe_layers[3]
    norm_a, norm_b = prof.norm_a[p], prof.norm_b[p]

    def readout(h: torch.Tensor) -> torch.Tensor:
        x = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        return x * norm_a + norm_b

    batch = ProbeBatch(layer=layer, probe=p, stream=hs[layer][0], prev_stream=hs[layer - 1][0],
                       token_ids=ids[0], readout=readout)  # fmt: skip
    cfg = SignalConfig.model_validate(
        {"policy": "quicksilver", "quicksilver": {"tau_drift": 1e6, "tau_entropy": 1e6}}
    )
    mask = build_exit_signal(cfg, prof).exit_mask(batch)
    assert mask.tolist() == [False] + [True] * 30  # token 0 is <|im_start|>: protected
    river = build_exit_signal(SignalConfig(policy="river", river={"tau": -1.0}), prof)
    assert river.exit_mask(batch).all()
