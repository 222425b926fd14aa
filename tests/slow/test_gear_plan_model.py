"""`vllm-adaptive calibrate --gear-plan w8a8` end to end on the real default model (a tiny
token budget): per-layer sensitivities from the simulated gear, a plan that meets its target
in the same simulation, a config the engine parses, and the plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from vllm_adaptive.config import parse_adaptive_config


def test_gear_plan_cli_end_to_end(tmp_path: Path) -> None:
    from vllm_adaptive.corpora import default_code_corpus
    from vllm_adaptive.model_zoo import prepare

    model = prepare("smollm2-135m-instruct", quiet=True)
    corpus = default_code_corpus(tmp_path / "code.txt", max_chars=200_000)
    out = tmp_path / "plan"
    cmd = [sys.executable, "-m", "vllm_adaptive.cli", "calibrate", "--gear-plan", "w8a8"]
    cmd += ["--model", str(model), "--corpus", str(corpus), "--out", str(out)]
    cmd += ["--tokens", "512", "--window", "128", "--target-agreement", "0.98"]
    cmd += ["--plot", str(tmp_path / "plan.png"), "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["tokens"] == 512 and len(plan["layer_agreement"]) == 30
    assert all(0.0 <= a <= 1.0 for a in plan["layer_agreement"])
    # the simulated gear changes the model (negative control: not an identity swap) ...
    assert plan["all_layers_agreement"] < 1.0
    # ... and the plan meets its target in the same simulation, with every layer accounted for
    assert plan["simulated_agreement"] >= 0.98
    assert sorted(plan["quantized_layers"] + plan["full_layers"]) == list(range(30))
    config = json.loads((out / "adaptive-config.json").read_text())
    precision = parse_adaptive_config(config["adaptive"]).precision
    geared = [i for i in range(30) if precision.layer_map(i, 30)[2] == "w8a8"]
    assert geared == plan["quantized_layers"]
    assert (tmp_path / "plan.png").stat().st_size > 10_000
