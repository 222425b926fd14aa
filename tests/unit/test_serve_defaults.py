"""``scripts/serve.sh`` picks what the online bench measured fastest at equal output: the
checkpoint's bf16 with the mechanisms off where the CPU has native bf16, float32 with the fixed
fp16 gear and vLLM's suffix drafter elsewhere; a user's --dtype picks the config for that dtype;
ADAPTIVE_CONFIG and a user's --speculative-config win."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

SERVE = Path(__file__).resolve().parents[2] / "scripts" / "serve.sh"
FP16 = {"adaptive": {"precision": {"policy": "fixed", "gear": "fp16"}}}
SUFFIX = {
    "method": "suffix",
    "num_speculative_tokens": 8,
    "suffix_decoding_max_cached_requests": 0,
    "num_speculative_tokens_per_batch_size": [[1, 1, 8], [2, 1024, 0]],
}


def _serve_dry(*args: str, **env: str) -> dict[str, str]:
    full = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ADAPTIVE_CONFIG", "ADAPTIVE_DRAFTS", "VLLM_PLUGINS")
    }
    out = subprocess.run(
        ["bash", str(SERVE), *args],
        env={**full, "SERVE_DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.splitlines()
    return dict(line.split(" ", 1) for line in out)


def _decide(*args: str, **env: str) -> tuple[str, dict]:
    fields = _serve_dry(*args, **env)
    return fields["dtype"], json.loads(fields["config"])


def _spec(*args: str, **env: str) -> dict | None:
    spec = _serve_dry(*args, **env)["spec"]
    return None if spec == "none" else json.loads(spec)


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


def test_suffix_drafts_with_the_float32_default_only() -> None:
    """Drafts where bench-serve measured them paying at stock's text (float32, the fp16 gear);
    not on bf16, not under a config of the user's unless asked, never over their own drafter."""
    avx2 = {"SERVE_CPU_FLAGS": "avx2"}
    assert _spec(**avx2) == SUFFIX
    assert _spec("--dtype", "float32", SERVE_CPU_FLAGS="amx_bf16") == SUFFIX
    assert _spec(SERVE_CPU_FLAGS="amx_bf16") is None
    assert _spec(VLLM_PLUGINS="", **avx2) is None  # stock vLLM through serve.sh
    mine = json.dumps({"adaptive": {"precision": {"policy": "gearbx"}}})
    assert _spec(ADAPTIVE_CONFIG=mine, **avx2) is None
    assert _spec(ADAPTIVE_CONFIG=mine, ADAPTIVE_DRAFTS="suffix", **avx2) == SUFFIX
    # without an adaptive section vLLM's own suffix proposer runs, which asserts a fixed k:
    # no per-batch-size schedule then
    plain = {k: v for k, v in SUFFIX.items() if k != "num_speculative_tokens_per_batch_size"}
    assert _spec(ADAPTIVE_CONFIG="{}", ADAPTIVE_DRAFTS="suffix", **avx2) == plain
    assert _spec(ADAPTIVE_DRAFTS="none", **avx2) is None
    assert _spec("--speculative-config", '{"method": "ngram"}', **avx2) is None


def test_bad_drafts_setting_is_refused() -> None:
    out = subprocess.run(
        ["bash", str(SERVE)],
        env={**os.environ, "SERVE_DRY_RUN": "1", "ADAPTIVE_DRAFTS": "eagle"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert 'ADAPTIVE_DRAFTS must be "suffix" or "none", got "eagle"' in out.stderr


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
