"""Self-speculative decoding with a low-precision draft (symmetric absmax int4, off the default
model's Q4_1 grid, so drafts are often rejected), through a real float32 engine.

Greedy: token-identical to stock vLLM on the same engine arguments, alone and in mixed batches
with chunked prefill. Per request: ``adaptive_mode: "off"`` gets no drafts. The expensive
checks (prefix-cache hits and preemption, the sampling distribution's chi-square with its
negative control) are in ``tests/slow/test_spec_lowbit_full.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import speculative as spec
from tests.support.engines import shutdown

K = 4


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    llm = spec.spec_engine(model_dir, spec.LOWBIT_DRAFT, K)
    yield llm
    shutdown(llm)


def test_greedy_identical_to_stock_in_mixed_batches(llm, stock_f32: dict) -> None:
    spec.check_identity(llm, stock_f32, ["spec_mixed"])


def test_request_with_mode_off_gets_no_drafts(llm, stock_f32: dict) -> None:
    spec.check_mode_off_gets_no_drafts(llm, stock_f32, K)
