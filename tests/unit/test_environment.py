"""The plugin's environment variables: names without vLLM's prefix, old names still read."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from vllm_adaptive import environment
from vllm_adaptive.environment import CACHE, cache_root, setting


def test_new_name_wins_and_old_name_still_works(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setattr(environment, "_warned", set())
    monkeypatch.delenv(CACHE, raising=False)
    monkeypatch.setenv("VLLM_" + CACHE, str(tmp_path / "old"))
    with caplog.at_level(logging.WARNING, logger="vllm.adaptive.environment"):
        assert cache_root() == tmp_path / "old"
    assert "VLLM_ADAPTIVE_CACHE is deprecated: name it ADAPTIVE_CACHE" in caplog.text
    monkeypatch.setenv(CACHE, str(tmp_path / "new"))
    assert cache_root() == tmp_path / "new"


def test_default_cache_and_settings(monkeypatch) -> None:
    for name in (CACHE, "VLLM_" + CACHE, "ADAPTIVE_X", "VLLM_ADAPTIVE_X"):
        monkeypatch.delenv(name, raising=False)
    assert cache_root() == Path.home() / ".cache" / "vllm-adaptive"
    assert setting("ADAPTIVE_X", "on") == "on"


@pytest.mark.parametrize("name", [environment.CACHE, environment.AUTOTUNE])
def test_names_carry_no_vllm_prefix(name: str) -> None:
    # vLLM warns at every start about each VLLM_* variable it does not know
    assert not name.startswith("VLLM_")
