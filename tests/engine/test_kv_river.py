"""KV strategy ``river`` (River-LLM's Exit River) with River-LLM's cosine signal: an exited token
keeps running through int4 copies of the remaining layers, which write its K/V into its own
slots (prompts through the river too). Audit: no read of an unwritten (layer, slot); negative
control: a river whose layers do not write the K/V of exited tokens is caught.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import kv_strategies as kv
from tests.support.depth_probe import (
    audit_report,
    install_kv_audit,
    reset_audit_violations,
    restore_river_kv_writes,
    stop_river_kv_writes,
)
from tests.support.engines import shutdown


@pytest.fixture(scope="module")
def llm(model_dir: Path, depth_profile: Path):
    depth = {
        "profile": str(depth_profile),
        "floor": {"tokens": 4},
        "kv_strategy": "river",
        "river": {"entry_layer": 8, "prefill": "river"},
        "signal": {"policy": "river", "river": {"tau": 0.95}},
    }
    llm = kv.engine(model_dir, depth, install_kv_audit)
    yield llm
    shutdown(llm)


def test_exits_off_is_stock(llm, stock_bf16: dict) -> None:
    kv.check_exits_off_is_stock(llm, stock_bf16)


@pytest.mark.slow  # the full suite: 137 s on an AVX2 EPYC; tests/engine/test_depth_engine.py
# runs the same audit workload in the default tier
def test_every_slot_has_kv_at_every_layer(llm) -> None:
    moved = kv.workload(llm, 3, "river")
    report = llm.apply_model(audit_report)[0]
    eng = kv.engine_stats(llm)
    assert report["reads"] > 1000
    assert report["violations"] == 0, report["first_violations"]
    assert eng["signal"] == ["river"] and eng["kv_strategy"] == "river"
    assert eng["river_token_layers"] > 0 and eng["mean_decode_depth"] < 30
    assert min(int(k) for k in eng["exit_tokens"]) >= 8  # no exit before the entry layer
    assert eng["peels"] == 0  # the river keeps every row in the batch
    assert moved["preemptions"] > 0 and moved["prefix_hits"] > 0


@pytest.mark.slow  # the full suite, beside the audit it controls
def test_kv_audit_catches_a_river_that_does_not_write_exited_kv(llm) -> None:
    """Negative control: with the Exit River's layers not writing the K/V of the exited decode
    tokens they run (prompt tokens in the river still write theirs), the same audit sees reads
    of unwritten (layer, slot)s, at the river's layers only."""
    llm.reset_prefix_cache()
    llm.apply_model(reset_audit_violations)
    before = kv.engine_stats(llm)["river_token_layers"]
    (entry,) = llm.apply_model(stop_river_kv_writes)
    try:
        llm.generate(["Write a story about a lighthouse keeper."], kv.params(48), use_tqdm=False)
        report = llm.apply_model(audit_report)[0]
        ran_in_river = kv.engine_stats(llm)["river_token_layers"] - before
    finally:
        llm.apply_model(restore_river_kv_writes)
        llm.apply_model(reset_audit_violations)
        llm.reset_prefix_cache()  # blocks whose deep K/V were never written
    assert ran_in_river > 0  # decode tokens exited into the river
    assert report["violations"] > 0
    assert all(layer >= entry for layer, _ in report["first_violations"]), report
