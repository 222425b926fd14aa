"""Suite-wide fixtures and the tiers.

The tier of a test is the folder it lives in, and its marker is applied here from the path:

- ``tests/unit``: no engine (``-m unit``);
- ``tests/engine``: real vLLM engines (``-m engine``), one engine per module, alive only while
  its module runs;
- ``tests/server``: real ``vllm serve`` processes (``-m server``);
- ``tests/slow``: the full suite only (``-m slow``; ``bash scripts/test.sh --all``).

One exception: a test of an engine module marked ``@pytest.mark.slow`` in place runs in the full
suite only, on its module's engine (a long check whose cheap siblings stay in the default tier).

Expensive shared inputs (the stock references, the calibrated exit profile) are built once and
kept on disk keyed by the model, versions, ISA and the code that makes them
(``tests/support/artifacts.py``), so concurrent workers (``pytest -n 2``) share them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support import artifacts
from tests.support.engines import GEMMA3_NUM_BLOCKS, run_stock, suite_engine_args

# Bound the CPU KV cache: without it vLLM reserves 92% of the NUMA node.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# LLM.apply_model sends a function to the worker; ours are importable
# (vllm_adaptive.introspection) but vLLM still requires this opt-in.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def _bind_engine_threads() -> None:
    """Under pytest-xdist, give each worker's engines their own CPU.

    vLLM's automatic binding puts every engine on the same core of a 2-core machine (it
    reserves the other for the frontend), so two workers' engines would share one core while
    the other idles.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cpus = sorted(os.sched_getaffinity(0))
    index = int(worker.removeprefix("gw") or 0)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cpus[index % len(cpus)])


_bind_engine_threads()


def _provide_kernel_ops() -> None:
    """Kernels tested without an engine call vLLM's CPU ops as an engine's would: vLLM runs the
    plugin's `register()` (which provides them) in engine processes, not in pytest's."""
    from vllm_adaptive.engine.kernel_ops import provide

    provide()  # loads nothing now; a kernel that asks gets None where vLLM is absent


_provide_kernel_ops()

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "engine", "server", "slow")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its tier, taken from its folder (before ``-m`` selects)."""
    for item in items:
        rel = Path(str(item.path)).resolve().relative_to(TESTS)
        tier = rel.parts[0] if len(rel.parts) > 1 else None
        if tier not in TIERS:
            raise pytest.UsageError(
                f"{rel}: a test module must live in one of tests/{{{','.join(TIERS)}}}/"
            )
        item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The default model, prepared from its PyPI-shipped GGUF (no hub)."""
    from vllm_adaptive.model_zoo import prepare

    return prepare("smollm2-135m-instruct", quiet=True)


@pytest.fixture(scope="session")
def gemma_dir() -> Path:
    """Gemma 3 270M, the second architecture, prepared from its chunked PyPI GGUF (no hub;
    cached after the first preparation)."""
    from vllm_adaptive.model_zoo import prepare

    return prepare("gemma3-270m", quiet=True)


def _model_key(model_dir: Path) -> dict:
    from vllm_adaptive.artifacts import model_fingerprint

    return {
        "model": model_fingerprint(model_dir),
        "tokenizer": artifacts.tokenizer_hash(model_dir),
        **artifacts.machine_key(),
    }


def _stock(model_dir: Path, dtype: str, workloads: list[str], **overrides) -> dict:
    args = suite_engine_args(dtype, **overrides)
    key = {
        **_model_key(model_dir),
        "engine_args": args,
        "workloads": workloads,
        "code": artifacts.code_hash(
            "tests/support/workloads.py", "tests/support/engine_outputs.py"
        ),
    }

    def build(d: Path) -> None:
        run_stock(model_dir, args, workloads, d / "outputs.json")

    return json.loads((artifacts.cached(f"stock-{dtype}", key, build) / "outputs.json").read_text())


@pytest.fixture(scope="session")
def stock_bf16(model_dir: Path) -> dict:
    """Stock vLLM (plugin not loaded), bf16, the suite's engine arguments: the identity
    workload and the exits-off batch."""
    return _stock(model_dir, "bfloat16", ["identity", "exits_off"])


@pytest.fixture(scope="session")
def stock_f32_identity(model_dir: Path) -> dict:
    """Stock vLLM (plugin not loaded), float32, the suite's engine arguments: the identity
    workload (the compiled depth engine's reference)."""
    return _stock(model_dir, "float32", ["identity"])


@pytest.fixture(scope="session")
def stock_f32(model_dir: Path) -> dict:
    """Stock vLLM (plugin not loaded), float32, the suite's engine arguments: the speculation
    workloads and the ARLA batch."""
    return _stock(model_dir, "float32", ["spec_mixed", "spec_cache", "spec_stat", "arla_batch"])


@pytest.fixture(scope="session")
def stock_gemma_bf16(gemma_dir: Path) -> dict:
    """Stock vLLM (plugin not loaded) on Gemma 3, bf16, the suite's engine arguments: the
    identity workload."""
    return _stock(gemma_dir, "bfloat16", ["identity"], num_gpu_blocks_override=GEMMA3_NUM_BLOCKS)


def _emad_test_profile(model_dir: Path, name: str, model_key: dict, **options) -> Path:
    """A small real EMAD calibration (probes every 2 layers, rank 16, budget 0.6) on 300k
    characters of the code corpus, cached under ``name`` by ``model_key``, the options and the
    calibration code."""
    import platform

    from vllm_adaptive.corpora import default_code_corpus
    from vllm_adaptive.depth.calibration.collect import CollectConfig
    from vllm_adaptive.depth.calibration.emad import CalibrationOptions, calibrate

    opts = CalibrationOptions(
        budget=0.6,
        rank=16,
        **options,
        collect=CollectConfig(window=128, tokens=1024, keep=64, probe_every=2),
    )
    key = {
        **model_key,
        "python": platform.python_version(),  # the code corpus is its standard library
        "options": repr(opts),
        "code": artifacts.code_hash("vllm_adaptive/depth", "vllm_adaptive/corpora.py"),
    }

    def build(d: Path) -> None:
        corpus = default_code_corpus(d / "code.txt", max_chars=300_000)
        calibrate(model_dir, [corpus], d / "profile", opts, progress=False)

    return artifacts.cached(name, key, build) / "profile"


@pytest.fixture(scope="session")
def gemma_depth_profile(gemma_dir: Path) -> Path:
    """Gemma 3 270M's test profile, the proxy over 8192 tokens (Gemma's vocabulary is 262,144);
    the Gemma depth and mask engines share it."""
    from vllm_adaptive.artifacts import model_fingerprint

    model_key = {"model": model_fingerprint(gemma_dir), **artifacts.machine_key()}
    return _emad_test_profile(gemma_dir, "gemma-depth-profile", model_key, proxy_vocab=8192)


@pytest.fixture(scope="session")
def depth_profile(model_dir: Path) -> Path:
    """The default model's test profile (about a minute), shared by the depth engines and
    servers."""
    return _emad_test_profile(model_dir, "depth-profile", _model_key(model_dir))


@pytest.fixture(scope="session")
def smoothing_profile(model_dir: Path) -> Path:
    """A small real SmoothQuant calibration of the default model (activation maxima over 2048
    tokens of code), for the w8a8 precision. Cached by model fingerprint and code."""
    import platform

    from vllm_adaptive.corpora import default_code_corpus
    from vllm_adaptive.precision.smoothing import calibrate_smoothing

    key = {
        **_model_key(model_dir),
        "python": platform.python_version(),
        "tokens": 2048,
        "code": artifacts.code_hash(
            "vllm_adaptive/precision/smoothing.py", "vllm_adaptive/corpora.py"
        ),
    }

    def build(d: Path) -> None:
        corpus = default_code_corpus(d / "code.txt", max_chars=300_000)
        calibrate_smoothing(model_dir, [corpus], d / "profile", tokens=2048, progress=False)

    return artifacts.cached("smoothing-profile", key, build) / "profile"
