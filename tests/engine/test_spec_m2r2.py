"""Self-speculative decoding with M2R2 drafts (the accelerated residual stream of the first 3
layers with adapters on q, o and the MLP; random non-zero adapters so every delta is exercised)
through a real float32 engine: greedy output identical to stock vLLM alone and in a mixed batch
with a chunked prefill, and per-request ``adaptive_mode: "off"`` gets no drafts. (Prefix hits and
preemption with this draft: tests/slow/test_spec_cache_matrix.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import speculative as spec
from tests.support.engines import shutdown

K = 3


@pytest.fixture(scope="module")
def llm(model_dir: Path, tmp_path_factory):
    adapter = spec.random_m2r2_adapter(model_dir, tmp_path_factory.mktemp("m2r2") / "adapter")
    llm = spec.spec_engine(model_dir, {"draft": "m2r2", "adapter": str(adapter)}, K)
    yield llm
    shutdown(llm)


def test_greedy_identical_to_stock(llm, stock_f32: dict) -> None:
    spec.check_identity(llm, stock_f32, ["spec_mixed"])


def test_request_with_mode_off_gets_no_drafts(llm, stock_f32: dict) -> None:
    spec.check_mode_off_gets_no_drafts(llm, stock_f32, K)
