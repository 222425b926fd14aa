"""The hybrid drafter: prompt lookup first (vLLM's n-gram proposer on the request's own context),
the W8A8 self-draft for requests without a match. Output is stock vLLM's, token for token, on
the speculation workloads (mixed batches, prefix hits, preemption), and both sources really
drafted (the proposer's own counters, read in the worker). Slow tier: one more float32 engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import speculative as spec
from tests.support.engines import shutdown

K = 3


def _drafter_stats(worker) -> dict:
    return dict(worker.model_runner.drafter.stats)


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    draft = {"draft": "lowbit", "precision": "w8a8", "prompt_lookup": {"min": 2, "max": 5}}
    llm = spec.spec_engine(model_dir, draft, K)
    yield llm
    shutdown(llm)


def test_hybrid_drafts_are_lossless_and_use_both_sources(llm, stock_f32: dict) -> None:
    spec.check_identity(llm, stock_f32, ["spec_mixed", "spec_cache"])
    stats = llm.collective_rpc(_drafter_stats)[0]
    assert stats["lookup_rows"] > 0, stats  # prompt lookup matched for some rows
    assert stats["rows"] > 0, stats  # and the draft model ran for the others
