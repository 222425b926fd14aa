"""Every KV strategy on the fast kernels: adaptive depth with the fixed fp16 gear (every decoder
linear and the LM head) in float32 engines, the AVX2 machines' fastest lossless configuration.

One gear for the whole step is what survives depth-peeling (the batch shrinks inside the step),
so the config accepts exactly that combination. Per strategy, one real engine: with exits off
(per-request budget 1.0) the batch decodes token for token as the same gear without depth; with
exits on, tokens stop early, every geared linear still runs fp16, and the strategy's KV audit
(tests/support/depth_probe.py) finds no read of a (layer, slot) no one wrote (``mask``: no
masked slot reaches an output) through mixed batches, a continuation that hits exited tokens'
cached blocks, chunked prefill and preemption. (The Exit River's own W8A16 layers with an fp16
head: ``test_river_with_precision.py``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import kv_strategies as kv
from tests.support.depth_probe import audit_report, install_kv_audit, install_mask_audit
from tests.support.engines import make_llm, metric, shutdown
from tests.support.workloads import exits_off
from vllm_adaptive.introspection import gear_telemetry

pytestmark = pytest.mark.slow

FP16 = {"policy": "fixed", "gear": "fp16"}
#: the strategy's depth settings beyond the profile (each with the signal its engine test uses)
STRATEGIES = {
    "monotone": {"budget": 0.5},
    "mask": {"budget": 0.5, "kv_strategy": "mask"},
    "propagate": {
        "kv_strategy": "propagate",
        "signal": {
            "policy": "quicksilver",
            "quicksilver": {"tau_drift": 60.0, "tau_entropy": 2.0, "min_halting_depth": 5},
        },
    },
    "recompute": {
        "budget": 0.5,
        "kv_strategy": "recompute",
        "signal": {
            "policy": ["emad", "river"],
            "combine": "any",
            "river": {"tau": 0.97, "batch_min": True},
        },
    },
    "river": {
        "kv_strategy": "river",
        "river": {"entry_layer": 8},
        "signal": {"policy": "river", "river": {"tau": 0.95}},
    },
}


@pytest.fixture(scope="module")
def gear_alone(model_dir: Path) -> list[list[int]]:
    """The exits-off batch on the same gear without depth (the reference)."""
    llm = make_llm(model_dir, {"adaptive": {"precision": FP16}}, dtype="float32")
    try:
        return exits_off(llm)
    finally:
        shutdown(llm)


@pytest.fixture(scope="module", params=list(STRATEGIES))
def depth_gear_llm(request, model_dir: Path, depth_profile: Path, gear_alone):
    name = request.param
    depth = {"profile": str(depth_profile), "floor": {"tokens": 4}, **STRATEGIES[name]}
    llm = make_llm(model_dir, {"adaptive": {"depth": depth, "precision": FP16}}, dtype="float32")
    llm.apply_model(install_mask_audit if name == "mask" else install_kv_audit)
    yield name, llm
    shutdown(llm)


def test_exits_off_is_the_gear_without_depth(depth_gear_llm, gear_alone) -> None:
    name, llm = depth_gear_llm
    llm.reset_prefix_cache()
    got = exits_off(llm, {"adaptive_depth_budget": 1.0})
    for i, (a, b) in enumerate(zip(got, gear_alone, strict=True)):
        assert a == b, f"{name}, prompt {i}: first difference at token " + str(
            next(j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        )
    assert set(kv.engine_stats(llm)["exit_tokens"]) == {"30"}


def test_exits_on_the_gear_with_consistent_kv(depth_gear_llm) -> None:
    name, llm = depth_gear_llm
    preempt0 = metric(llm, "vllm:num_preemptions")
    hits0 = metric(llm, "vllm:prefix_cache_hits")
    words = kv.WORDS
    prompts = [f"Chapter {k}. " + " ".join(words[k:] + words[:k]) for k in range(5)]
    llm.generate(prompts, [kv.params(300, tag=f"{name}-{k}") for k in range(5)], use_tqdm=False)
    kv.exiting_continuation(llm, "Write a story about a lighthouse keeper.")
    assert metric(llm, "vllm:num_preemptions") > preempt0
    assert metric(llm, "vllm:prefix_cache_hits") > hits0

    eng = kv.engine_stats(llm)
    assert eng["kv_strategy"] == name
    exited = {int(k): v for k, v in eng["exit_tokens"].items() if int(k) < 30}
    assert sum(exited.values()) > 0, eng["exit_tokens"]
    report = llm.apply_model(audit_report)[0]
    assert report["installed"] and report["reads"] > 1000
    if name == "mask":
        assert report["poisoned"] > 0 and report["nan_outputs"] == 0, report
    else:
        assert report["violations"] == 0, report["first_violations"]

    tel = llm.apply_model(gear_telemetry)[0]
    assert tel["resident_bytes"]["fp16"] > 0
    # every level of every managed linear runs fp16 (the last entry: adaptivity-off requests)
    assert all(list(m[:-1]) == ["fp16"] * (len(m) - 1) for m in tel["layer_maps"]), tel
    # 4 linears in each of the 30 layers, and the LM head
    assert llm.apply_model(_geared_linears)[0] == 121


def _geared_linears(model) -> int:
    return len(model.precision.geared)
