"""The kernel benches and the step-cost command run through `vllm-adaptive` on tiny inputs
(what they time is not checked here, only that they check, write and print)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_adaptive import cli


def test_bench_packed_tiny(tmp_path, capsys):
    out = tmp_path / "packed.json"
    rc = cli.main(
        ["kernels", "bench-packed", "--shapes", "64x32", "--tokens", "1", "--dtypes", "fp32"]
        + ["--formats", "int8-row,int4-g32", "--min-time", "0.001", "--min-reps", "1"]
        + ["--max-reps", "2", "--json", str(out)]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert {r["format"] for r in data["results"]} >= {"int8-row", "int4-g32"}
    assert "| 64x32 | 1 |" in capsys.readouterr().out


def test_bench_attention_cpu_tiny(tmp_path, capsys):
    out = tmp_path / "attention.json"
    rc = cli.main(
        ["kernels", "bench-attention", "--device", "cpu", "--shapes", "2x1x64"]
        + ["--contexts", "64", "--batches", "1", "--repeats", "1", "--out", str(out)]
    )
    assert rc == 0
    cells = json.loads(out.read_text())["cells"]
    assert len(cells) == 1 and cells[0]["ok"]


def test_bench_triton_interpreter_tiny(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "triton.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    args = ["kernels", "bench-triton", "--device", "cpu", "--shapes", "64x32", "--tokens", "1"]
    args += ["--formats", "int8-row", "--warmup", "1", "--rep", "1", "--no-dequant"]
    args += ["--dtype", "fp32", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_adaptive.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text())["failures"] == 0


def test_step_cost_table_and_json(tmp_path, monkeypatch, capsys):
    from vllm_adaptive.bench import step_cost

    steps = {"1": 0.010, "2": 0.011, "3": 0.012, "4": 0.013, "5": 0.015}
    monkeypatch.setattr(step_cost, "measure", lambda *a, **k: dict(steps))
    out = tmp_path / "step.json"
    rc = cli.main(["step-cost", "--model", "m", "--max-tokens-per-step", "5", "--json", str(out)])
    assert rc == 0
    assert json.loads(out.read_text())["itl_s"] == {"bfloat16, eager": steps}
    text = capsys.readouterr().out
    assert "best case k=2" in text and "best case k=4" in text
    assert step_cost.best_case(steps, 2) == pytest.approx(3 / 1.2)
    assert step_cost.predicted(steps, 4, 2.5, 0.0) == pytest.approx(2.5 / 1.5)


def test_unknown_options_still_refused():
    with pytest.raises(SystemExit):
        cli.main(["models", "list", "--bogus"])
