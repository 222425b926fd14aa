"""KV strategy ``recompute`` (EE-LLM batching recompute) with EMAD or River-LLM's batch minimum:
the previous token is resumed through its skipped layers before the current one attends to it;
a prefill over cached slots of unresumed tokens is capped. Audit: no read of an unwritten
(layer, slot). Negative control: with resuming switched off the audit fires.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import kv_strategies as kv
from tests.support.depth_probe import (
    audit_report,
    install_kv_audit,
    reset_audit_violations,
    restore_resuming,
    stop_resuming,
)
from tests.support.engines import shutdown


@pytest.fixture(scope="module")
def llm(model_dir: Path, depth_profile: Path):
    depth = {
        "profile": str(depth_profile),
        "budget": 0.5,
        "floor": {"tokens": 4},
        "kv_strategy": "recompute",
        "signal": {
            "policy": ["emad", "river"],
            "combine": "any",
            "river": {"tau": 0.97, "batch_min": True},
        },
    }
    llm = kv.engine(model_dir, depth, install_kv_audit)
    yield llm
    shutdown(llm)


def test_exits_off_is_stock(llm, stock_bf16: dict) -> None:
    kv.check_exits_off_is_stock(llm, stock_bf16)


def test_every_read_slot_has_kv(llm) -> None:
    moved = kv.workload(llm, 4, "rec")
    report = llm.apply_model(audit_report)[0]
    eng = kv.engine_stats(llm)
    assert report["reads"] > 1000
    assert report["violations"] == 0, report["first_violations"]
    assert eng["signal"] == ["emad", "river"] and eng["kv_strategy"] == "recompute"
    assert eng["recomputed_kv"] > 0 and eng["mean_decode_depth"] < 30
    assert kv.deeper_later(llm) > 0
    assert moved["preemptions"] > 0 and moved["prefix_hits"] > 0


def test_audit_fires_without_resuming(llm) -> None:
    """Negative control: tokens that exited and were never resumed are read by the next."""
    llm.apply_model(stop_resuming)
    try:
        kv.exiting_continuation(llm, "Write a story about a lighthouse keeper.")
        report = llm.apply_model(audit_report)[0]
    finally:
        llm.apply_model(restore_resuming)
        llm.apply_model(reset_audit_violations)
    assert report["violations"] > 0
