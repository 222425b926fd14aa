"""The MoEfied Llama in a real engine: experts offloaded to the slow tier with a fast tier of
25% of them give the same greedy tokens as the same model with every expert resident.

The model is the **mechanics fixture** of ``tests/support/moefied.py`` (the default dense model
split into 8 experts by the identity permutation, with a random top-4 router): its text means
nothing and no hit rate measured here says anything about a real MoE. One engine pair, one at a
time: all-resident (no ``adaptive`` section), then tiered (``capacity`` 0.25, ``m2r2`` looking 2
layers ahead with adapters trained on the fixture for a few seconds), whose predictor is then
switched to ``pregate`` (2 ahead) and to ``none`` on the same engine, all with the default
"cyclic" eviction, and last to "lru" eviction (an empty tier of 25% again). The
workload is one batch of several greedy prompts, two sharing a prefix longer than a KV block,
run twice (the second run reads the prefix cache), on the suite's engine arguments (prefix
caching, chunked prefill, a small KV cache). Preemption: ``tests/slow/test_moe_preemption.py``.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import pytest

from tests.support.engines import (
    AMX_EAGER_DRIFT,
    amx_bf16_attention,
    make_llm,
    metric,
    shutdown,
)
from tests.support.moefied import build_mechanics_moefied, train_fixture_adapters
from tests.support.workloads import PROMPTS
from vllm_adaptive.introspection import describe_parts
from vllm_adaptive.models.moefied_llama import (
    moe_stats,
    reset_moe_stats,
    set_moe_capacity,
    set_moe_predictor,
)

SHARED = "Here is a long list of facts about the planets of the solar system. " * 12
BATCH = [*PROMPTS[:5], SHARED + "Mercury is", SHARED + "Neptune is"]
MAX_TOKENS = 16
PREDICTORS = ["m2r2", "pregate", "none"]


def _tiered(adapters: Path) -> dict:
    moe = {"capacity": 0.25, "predictor": "m2r2", "lookahead": 2, "m2r2_adapters": str(adapters)}
    return {"adaptive": {"moe": moe}}


def _generate(llm) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    runs = []
    for _ in range(2):  # the second run hits the prefix cache
        outs = llm.generate(BATCH, params, use_tqdm=False)
        runs.append([list(o.outputs[0].token_ids) for o in outs])
    return runs[0] + runs[1]


@pytest.fixture(scope="module")
def moefied_dir(model_dir: Path, tmp_path_factory) -> Path:
    return build_mechanics_moefied(model_dir, tmp_path_factory.mktemp("moefied") / "model")


@pytest.fixture(scope="module")
def m2r2_adapters(moefied_dir: Path, tmp_path_factory) -> Path:
    return train_fixture_adapters(moefied_dir, tmp_path_factory.mktemp("m2r2"))


@pytest.fixture(scope="module")
def runs(moefied_dir: Path, m2r2_adapters: Path) -> dict:
    out: dict = {}
    llm = make_llm(moefied_dir, {})
    try:
        out["resident"] = _generate(llm)
        (out["resident_stats"],) = llm.apply_model(moe_stats)
        (out["parts"],) = llm.apply_model(describe_parts)
    finally:
        shutdown(llm)
    llm = make_llm(moefied_dir, _tiered(m2r2_adapters))
    try:
        for name in PREDICTORS:
            if name != "m2r2":  # the engine started with m2r2
                llm.apply_model(partial(set_moe_predictor, name=name, lookahead=2))
            llm.apply_model(reset_moe_stats)  # leave out the profiling run / the last predictor
            llm.reset_prefix_cache()
            out[name] = _generate(llm)
            (out[f"{name}_stats"],) = llm.apply_model(moe_stats)
        # the other eviction policy, selectable on a running engine (an empty tier of 25%)
        t0 = time.perf_counter()
        llm.apply_model(partial(set_moe_capacity, capacity=0.25, eviction="lru"))
        llm.apply_model(reset_moe_stats)
        llm.reset_prefix_cache()
        out["lru"] = _generate(llm)
        (out["lru_stats"],) = llm.apply_model(moe_stats)
        out["lru_seconds"] = time.perf_counter() - t0  # what the lru case adds to the tier
        out["prefix_hits"] = metric(llm, "vllm:prefix_cache_hits")
    finally:
        shutdown(llm)
    for name in PREDICTORS:  # shown with -s (mechanics fixture: no claims)
        s = out[f"{name}_stats"]
        keys = ("slots", "hits", "misses", "loads", "evictions", "stall_seconds", "tokens")
        print(name, {k: s[k] for k in keys}, "prediction", s["prediction"])
    print("slow tier cold read MB/s", out["none_stats"]["slow_tier_cold_read_bytes_per_s"] / 1e6)
    print(f"lru case: {out['lru_seconds']:.1f} s")
    return out


def test_resident_reference_is_nontrivial(runs) -> None:
    assert runs["resident_stats"] is None  # no adaptive section: every expert resident
    seqs = runs["resident"]
    assert len(seqs) == 2 * len(BATCH) and all(len(s) == MAX_TOKENS for s in seqs)
    assert len({tuple(s) for s in seqs[: len(BATCH)]}) > 1


def test_model_interface_names_the_experts(runs) -> None:
    """Through the model interface a MoEfied layer has its attention linears and its experts,
    no dense MLP linears, so no mechanism that re-runs a Llama block takes it for one."""
    parts = runs["parts"]
    assert parts["owned"] and len(parts["layers"]) == parts["num_layers"] == 30
    for layer in parts["layers"]:
        assert layer["owned"], layer["index"]
        assert layer["linears"] == ["o_proj", "qkv_proj"]
        assert layer["optional"] == ["experts"]
        assert layer["block_recipe"] is None


@pytest.mark.parametrize("predictor", [*PREDICTORS, "lru"])
def test_tiered_output_is_the_resident_output(runs, predictor) -> None:
    if runs[predictor] != runs["resident"] and amx_bf16_attention():
        # seen on the AMX Xeon before the tiers were touched too (main 4060e0e: m2r2 and lru
        # diverged at token 1): the two engines are two processes running one batch in bf16
        pytest.xfail(AMX_EAGER_DRIFT)
    for i, (got, ref) in enumerate(zip(runs[predictor], runs["resident"], strict=True)):
        first = next((j for j, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b), None)
        assert first is None, f"{predictor}: sequence {i} diverges at token {first}"


@pytest.mark.parametrize("predictor", [*PREDICTORS, "lru"])
def test_tiers_evicted_and_never_computed_an_unready_expert(runs, predictor) -> None:
    s = runs[f"{predictor}_stats"]
    # cyclic by default; "lru" (predictor none) selected on the running engine
    assert s["eviction"] == ("lru" if predictor == "lru" else "cyclic")
    assert s["slots"] == int(0.25 * s["experts"])
    assert s["violations"] == 0
    assert s["evictions"] > 0 and s["loads"] > s["slots"]
    assert s["misses"] > 0 and s["stall_seconds"] > 0
    assert s["slow_tier_cold_read_bytes_per_s"] > 0
    if predictor not in ("none", "lru"):
        assert s["predictor"] == predictor and s["lookahead"] == 2
        assert s["prefetches"] > 0
        assert set(s["prediction"]) == {"1", "2"}
    else:
        assert s["prefetches"] == 0 and s["prediction"] == {}


def test_prefix_cache_was_used(runs) -> None:
    assert runs["prefix_hits"] > 0
