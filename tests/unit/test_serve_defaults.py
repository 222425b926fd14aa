"""``scripts/serve.sh`` picks what the online bench measured fastest at equal output: the
checkpoint's bf16 with the mechanisms off where the CPU has native bf16, float32 with the fixed
fp16 gear elsewhere; a user's --dtype picks the config for that dtype; ADAPTIVE_CONFIG wins."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

SERVE = Path(__file__).resolve().parents[2] / "scripts" / "serve.sh"
FP16 = {"adaptive": {"precision": {"policy": "fixed", "gear": "fp16"}}}


def _decide(*args: str, **env: str) -> tuple[str, dict]:
    full = {k: v for k, v in os.environ.items() if k not in ("ADAPTIVE_CONFIG",)}
    out = subprocess.run(
        ["bash", str(SERVE), *args],
        env={**full, "SERVE_DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.splitlines()
    fields = dict(line.split(" ", 1) for line in out)
    return fields["dtype"], json.loads(fields["config"])


@pytest.mark.parametrize(
    "flags, dtype, config",
    [
        ("fpu avx avx2 fma f16c", "float32", FP16),
        ("fpu avx2 avx512f avx512_bf16", "auto", {"adaptive": {}}),
        ("fpu avx2 amx_bf16", "auto", {"adaptive": {}}),
    ],
)
def test_machine_default(flags: str, dtype: str, config: dict) -> None:
    assert _decide(SERVE_CPU_FLAGS=flags) == (dtype, config)


def test_users_dtype_and_config_win() -> None:
    avx2 = {"SERVE_CPU_FLAGS": "avx2"}
    assert _decide("--dtype", "bfloat16", **avx2) == ("bfloat16", {"adaptive": {}})
    assert _decide("--port", "1", "--dtype=float32", SERVE_CPU_FLAGS="avx512_bf16") == (
        "float32",
        FP16,
    )
    mine = {"adaptive": {"precision": {"policy": "gearbx"}}}
    assert _decide(ADAPTIVE_CONFIG=json.dumps(mine), **avx2) == ("float32", mine)


def test_adaptive_model_picks_the_checkpoint() -> None:
    def model(**env: str) -> str:
        out = subprocess.run(
            ["bash", str(SERVE)],
            env={**os.environ, "SERVE_DRY_RUN": "1", **env},
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
        return dict(line.split(" ", 1) for line in out.splitlines())["model"]

    assert model() == "smollm2-135m-instruct"
    assert model(ADAPTIVE_MODEL="smollm2-135m-instruct-w8a8") == "smollm2-135m-instruct-w8a8"
