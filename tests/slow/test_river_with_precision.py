"""Depth with a fixed precision in one float32 engine: the Exit River on W8A16 copies of the
layers past the entry layer, and the LM head at fp16 through the precision gears.

One gear for the whole step is what survives depth-peeling's shrinking batch, so the config
accepts exactly that combination. Checked: a request with adaptivity off decodes as stock
float32 does (float head, no exits); exits run the river and the head is geared; no query reads
a (layer, slot) no one wrote, through mixed batches, prefix hits, chunked prefill and
preemption.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import kv_strategies as kv
from tests.support.depth_probe import audit_report, install_kv_audit
from tests.support.engines import make_llm, shutdown
from tests.support.workloads import SPEC_PROMPTS


@pytest.fixture(scope="module")
def llm(model_dir: Path, depth_profile: Path):
    adaptive = {
        "depth": {
            "profile": str(depth_profile),
            "floor": {"tokens": 4},
            "kv_strategy": "river",
            "river": {"entry_layer": 8, "precision": "w8a16"},
            "signal": {"policy": "river", "river": {"tau": 0.95}},
        },
        "precision": {"policy": "fixed", "gear": "fp16", "modules": ["lm_head"]},
    }
    llm = make_llm(model_dir, {"adaptive": adaptive}, dtype="float32")
    llm.apply_model(install_kv_audit)
    yield llm
    shutdown(llm)


def test_adaptivity_off_is_stock_float32(llm, stock_f32: dict) -> None:
    from vllm import SamplingParams

    llm.reset_prefix_cache()
    off = SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, extra_args={"adaptive_mode": "off"}
    )
    for i, prompt in enumerate(SPEC_PROMPTS):
        out = llm.generate([prompt], off, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == stock_f32["spec_mixed"]["alone"][i], prompt


def test_river_exits_with_an_fp16_head_and_consistent_kv(llm) -> None:
    from vllm_adaptive.introspection import gear_telemetry

    moved = kv.workload(llm, 5, "river-f32")
    eng = kv.engine_stats(llm)
    assert eng["kv_strategy"] == "river" and eng["river_token_layers"] > 0
    assert min(int(k) for k in eng["exit_tokens"]) >= 8
    report = llm.apply_model(audit_report)[0]
    assert report["reads"] > 1000
    assert report["violations"] == 0, report["first_violations"]
    assert moved["preemptions"] > 0 and moved["prefix_hits"] > 0
    tel = llm.apply_model(gear_telemetry)[0]
    assert tel["layer_maps"] == [["fp16", "fp16", "fp16", "full"]]  # the head alone
    assert tel["resident_bytes"]["fp16"] > 0
