"""Self-speculative decoding with an early-layer draft (the first 4 layers; rejected most of
the time) through a real float32 engine: greedy output identical to stock vLLM alone and in a
mixed batch with a chunked prefill, and per-request ``adaptive_mode: "off"`` gets no drafts.
(Prefix hits and preemption with this draft: tests/slow/test_spec_cache_matrix.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import speculative as spec
from tests.support.engines import shutdown

K = 2


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    llm = spec.spec_engine(model_dir, {"draft": "early", "layers": 4}, K)
    yield llm
    shutdown(llm)


def test_greedy_identical_to_stock(llm, stock_f32: dict) -> None:
    spec.check_identity(llm, stock_f32, ["spec_mixed"])


def test_request_with_mode_off_gets_no_drafts(llm, stock_f32: dict) -> None:
    spec.check_mode_off_gets_no_drafts(llm, stock_f32, K)
