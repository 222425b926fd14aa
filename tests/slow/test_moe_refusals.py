"""Engines refuse an ``adaptive.moe`` they cannot honour, at start, naming the key: expert
tiers on a dense model, a fast tier too small for one expert, an unknown predictor and m2r2
adapters that are missing (on the mechanics fixture of ``tests/support/moefied.py``). Each case
starts (and fails) a real engine in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.moefied import build_mechanics_moefied


def _start(model: Path, adaptive: dict) -> str:
    code = (
        "from vllm import LLM\n"
        "if __name__ == '__main__':\n"
        f"    LLM(model={str(model)!r}, enforce_eager=True, max_model_len=512,\n"
        f"        additional_config={{'adaptive': {adaptive!r}}})\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ},
    )
    assert proc.returncode != 0
    return proc.stdout + proc.stderr


def _errors(out: str) -> str:
    return "\n".join(line for line in out.splitlines() if "Error" in line)[-3000:]


def test_moe_on_a_dense_model_is_refused(model_dir: Path) -> None:
    out = _start(model_dir, {"moe": {"capacity": 0.5}})
    # refused by the worker's admission check, before the model is built
    assert "adaptive.moe: the model (['LlamaForCausalLM']) is not MoEfied" in out, _errors(out)


@pytest.mark.parametrize(
    ("moe", "message"),
    [
        ({"fast_tier_bytes": 4096}, "adaptive.moe.fast_tier_bytes: the fast tier holds no expert"),
        ({"predictor": "oracle"}, "adaptive.moe.predictor: Input should be"),
        (
            {"predictor": "m2r2", "m2r2_adapters": "/nonexistent/adapters"},
            "adaptive.moe.m2r2_adapters: /nonexistent/adapters: no M2R2 expert-prediction adapters",
        ),
    ],
)
def test_fast_tier_too_small_is_refused(model_dir: Path, tmp_path: Path, moe, message) -> None:
    moefied = build_mechanics_moefied(model_dir, tmp_path / "moefied")
    out = _start(moefied, {"moe": moe})
    assert message in out, _errors(out)
