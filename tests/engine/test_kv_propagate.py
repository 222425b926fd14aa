"""KV strategy ``propagate`` (CALM) with QuickSilver's dual signal: every slot has K/V at every
layer after the step, the skipped layers' K/V propagated from the exit state. Audit: no read of an
unwritten (layer, slot), with no prefill cap and no mask to hide one. Negative control: with
propagation switched off the audit fires.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import kv_strategies as kv
from tests.support.depth_probe import (
    audit_report,
    install_kv_audit,
    reset_audit_violations,
    restore_propagating,
    stop_propagating,
)
from tests.support.engines import shutdown


@pytest.fixture(scope="module")
def llm(model_dir: Path, depth_profile: Path):
    depth = {
        "profile": str(depth_profile),
        "floor": {"tokens": 4},
        "kv_strategy": "propagate",
        "signal": {
            "policy": "quicksilver",
            "quicksilver": {"tau_drift": 60.0, "tau_entropy": 2.0, "min_halting_depth": 5},
        },
    }
    llm = kv.engine(model_dir, depth, install_kv_audit)
    yield llm
    shutdown(llm)


def test_exits_off_is_stock(llm, stock_bf16: dict) -> None:
    kv.check_exits_off_is_stock(llm, stock_bf16)


@pytest.mark.slow  # the full suite: 98 s on an AVX2 EPYC; tests/engine/test_depth_engine.py
# runs the same audit workload in the default tier
def test_every_slot_has_kv_at_every_layer(llm) -> None:
    moved = kv.workload(llm, 2, "prop")
    report = llm.apply_model(audit_report)[0]
    eng = kv.engine_stats(llm)
    assert report["reads"] > 1000
    assert report["violations"] == 0, report["first_violations"]
    assert eng["signal"] == ["quicksilver"] and eng["kv_strategy"] == "propagate"
    assert eng["mean_decode_depth"] < 30 and eng["propagated_kv"] > 0
    assert eng["capped_prefills"] == 0
    assert kv.deeper_later(llm) > 0
    assert moved["preemptions"] > 0 and moved["prefix_hits"] > 0


def test_audit_fires_without_propagation(llm) -> None:
    """Negative control: exited tokens without propagated K/V are read by later tokens."""
    llm.apply_model(stop_propagating)
    try:
        kv.exiting_continuation(llm, "Write a story about a lighthouse keeper.")
        report = llm.apply_model(audit_report)[0]
    finally:
        llm.apply_model(restore_propagating)
        llm.apply_model(reset_audit_violations)
    assert report["violations"] > 0
