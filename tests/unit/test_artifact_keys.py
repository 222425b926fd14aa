"""The test suite's artifact cache key (``tests/support/artifacts.py``, ``conftest._model_key``)
changes with everything a cached stock output depends on: the tokenizer's files and the
versions of the code that reads them, besides the model and the kernels."""

from __future__ import annotations

from pathlib import Path

from tests.support import artifacts


def test_tokenizer_hash_follows_the_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    empty = artifacts.tokenizer_hash(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    one = artifacts.tokenizer_hash(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": {"vocab": {"b": 0}}}')
    other = artifacts.tokenizer_hash(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"\0")  # not a tokenizer file
    assert len({empty, one, other}) == 3
    assert artifacts.tokenizer_hash(tmp_path) == other


def test_machine_key_names_the_tokenizer_code_versions() -> None:
    key = artifacts.machine_key()
    assert key["transformers"] and key["tokenizers"]
    assert key["torch"] and key["vllm"]
