"""The KV strategies for exited tokens, each through a real vLLM engine with a different exit
signal (docs/kv-strategies.md):

* ``mask`` + EMAD: skipped layers write no K/V and attention leaves those slots out. The audit
  (tests/depth_probe.py) poisons every cached (layer, slot) the shadow says was never written
  with NaN before each attention call; a masked slot that contributed would make the output
  non-finite. Negative control: the same workload with the mask withheld from the backend.
* ``propagate`` + QuickSilver: every slot has K/V at every layer after the step (audit: no read
  of an unwritten (layer, slot), with no prefill cap and no mask to hide one).
* ``river`` + River-LLM's cosine signal: the same property, K/V written by the int4 river.
* ``recompute`` + EMAD or River's batch minimum: the same property, the previous token resumed
  through its skipped layers before the current one attends to it.

Each engine also shows that with exits off (``adaptive_depth_budget: 1.0``) its greedy output is
stock vLLM's, and that later tokens may go deeper than earlier ones (no monotone cap).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from tests.identity_workload import MAX_TOKENS, PROMPTS
from vllm_adaptive.introspection import depth_telemetry

pytestmark = pytest.mark.engine

NUM_BLOCKS = 12  # x 128 slots: long batches preempt
WORDS = "the of model cache layer token exit depth value key block request batch".split()


def _engine(model_dir: Path, depth: dict, audit):
    from tests.conftest import _make_llm

    llm = _make_llm(
        model_dir,
        {"adaptive": {"depth": depth}},
        enable_prefix_caching=True,
        num_gpu_blocks_override=NUM_BLOCKS,
        disable_log_stats=False,
        max_num_batched_tokens=256,
    )
    llm.apply_model(audit)
    return llm


def _params(n: int, budget: float | None = None, tag: str | None = None, **kw):
    from vllm import SamplingParams

    extra = {}
    if budget is not None:
        extra["adaptive_depth_budget"] = budget
    if tag is not None:
        extra["adaptive_request_tag"] = tag
    kw.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=n, ignore_eos=True, extra_args=extra or None, **kw)


def _metric(llm, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name and hasattr(m, "value"))


def _engine_stats(llm) -> dict:
    return llm.apply_model(depth_telemetry)[0]["engine"]


def _exits_off_is_stock(llm, stock_reference: dict) -> None:
    outs = llm.generate(PROMPTS[:4], [_params(MAX_TOKENS, 1.0) for _ in range(4)], use_tqdm=False)
    for i, o in enumerate(outs):
        assert list(o.outputs[0].token_ids) == stock_reference["alone"][i], PROMPTS[i]


def _workload(llm, seed: int, tag: str) -> None:
    """Mixed batches, prefix-cache hits on blocks exited tokens wrote, chunked prefill and
    preemption (the KV cache holds 12 blocks)."""
    rng = random.Random(seed)
    for round_ in range(2):
        prompts, params = [], []
        for j in range(rng.randint(3, 5)):
            prompts.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 150))))
            params.append(_params(rng.randint(8, 160), tag=f"{tag}{round_}-{j}"))
        llm.generate(prompts, params, use_tqdm=False)
    first = llm.generate(["Write a story about a lighthouse keeper."], _params(300))[0]
    ids = list(first.prompt_token_ids) + list(first.outputs[0].token_ids)
    out = llm.generate([{"prompt_token_ids": ids}], _params(16, logprobs=1), use_tqdm=False)[
        0
    ].outputs[0]
    assert all(math.isfinite(next(iter(lp.values())).logprob) for lp in out.logprobs)
    long = [f"Chapter {k}. " + " ".join(WORDS) for k in range(5)]
    llm.generate(long, [_params(300) for _ in long], use_tqdm=False)


def _deeper_later(llm) -> int:
    """Decode steps where a token ran deeper than the token before it (no monotone cap)."""
    tel = llm.apply_model(depth_telemetry)[0]
    total = 0
    for r in tel["finished"]:
        d = r["depths"][1:]  # decode tokens
        total += sum(1 for t in range(1, len(d)) if d[t] > d[t - 1])
    return total


# -- mask ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mask_llm(model_dir: Path, depth_profile: Path):
    from tests.conftest import _shutdown
    from tests.depth_probe import install_mask_audit

    depth = {"profile": str(depth_profile), "budget": 0.5, "floor": {"tokens": 4}}
    llm = _engine(model_dir, depth | {"kv_strategy": "mask"}, install_mask_audit)
    yield llm
    _shutdown(llm)


def test_mask_exits_off_is_stock(mask_llm, stock_reference: dict) -> None:
    _exits_off_is_stock(mask_llm, stock_reference)


def test_mask_masked_slots_never_contribute(mask_llm) -> None:
    from tests.depth_probe import audit_report

    preempt0 = _metric(mask_llm, "vllm:num_preemptions")
    hits0 = _metric(mask_llm, "vllm:prefix_cache_hits")
    _workload(mask_llm, 1, "mask")
    report = mask_llm.apply_model(audit_report)[0]
    eng = _engine_stats(mask_llm)
    masked = mask_llm.apply_model(_mask_stats)[0]
    assert report["installed"] and report["reads"] > 1000
    assert report["poisoned"] > 1000, report  # unwritten slots were in attended ranges
    assert report["nan_outputs"] == 0, report["first_nan_layers"]
    assert masked["masked"] > 0, masked  # the backend's masked path ran
    assert eng["kv_strategy"] == "mask" and eng["masked_steps"] > 0
    assert eng["capped_prefills"] == 0  # a mask needs no prefill cap
    assert eng["mean_decode_depth"] < 30
    assert _deeper_later(mask_llm) > 0
    assert _metric(mask_llm, "vllm:num_preemptions") > preempt0
    assert _metric(mask_llm, "vllm:prefix_cache_hits") > hits0


def test_mask_withheld_reads_poisoned_slots(mask_llm) -> None:
    """Negative control: the poison is real, only the mask keeps it out."""
    from tests.depth_probe import (
        audit_report,
        reset_nan_outputs,
        restore_publishing_mask,
        stop_publishing_mask,
    )

    mask_llm.apply_model(stop_publishing_mask)
    try:
        mask_llm.generate(["The history of the printing press"], _params(64), use_tqdm=False)
        report = mask_llm.apply_model(audit_report)[0]
    finally:
        mask_llm.apply_model(restore_publishing_mask)
        mask_llm.apply_model(reset_nan_outputs)
    assert report["nan_outputs"] > 0


def _mask_stats(model) -> dict:
    from vllm_adaptive.depth.mask_context import mask_stats

    return mask_stats()


# -- propagate ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def propagate_llm(model_dir: Path, depth_profile: Path):
    from tests.conftest import _shutdown
    from tests.depth_probe import install_kv_audit

    depth = {
        "profile": str(depth_profile),
        "floor": {"tokens": 4},
        "kv_strategy": "propagate",
        "signal": {
            "policy": "quicksilver",
            "quicksilver": {"tau_drift": 60.0, "tau_entropy": 2.0, "min_halting_depth": 5},
        },
    }
    llm = _engine(model_dir, depth, install_kv_audit)
    yield llm
    _shutdown(llm)


def test_propagate_exits_off_is_stock(propagate_llm, stock_reference: dict) -> None:
    _exits_off_is_stock(propagate_llm, stock_reference)


def test_propagate_every_slot_has_kv_at_every_layer(propagate_llm) -> None:
    from tests.depth_probe import audit_report

    _workload(propagate_llm, 2, "prop")
    report = propagate_llm.apply_model(audit_report)[0]
    eng = _engine_stats(propagate_llm)
    assert report["reads"] > 1000
    assert report["violations"] == 0, report["first_violations"]
    assert eng["signal"] == ["quicksilver"] and eng["kv_strategy"] == "propagate"
    assert eng["mean_decode_depth"] < 30 and eng["propagated_kv"] > 0
    assert eng["capped_prefills"] == 0
    assert _deeper_later(propagate_llm) > 0


# -- river --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def river_llm(model_dir: Path, depth_profile: Path):
    from tests.conftest import _shutdown
    from tests.depth_probe import install_kv_audit

    depth = {
        "profile": str(depth_profile),
        "floor": {"tokens": 4},
        "kv_strategy": "river",
        "river": {"entry_layer": 8, "prefill": "river"},
        "signal": {"policy": "river", "river": {"tau": 0.95}},
    }
    llm = _engine(model_dir, depth, install_kv_audit)
    yield llm
    _shutdown(llm)


def test_river_exits_off_is_stock(river_llm, stock_reference: dict) -> None:
    _exits_off_is_stock(river_llm, stock_reference)


def test_river_every_slot_has_kv_at_every_layer(river_llm) -> None:
    from tests.depth_probe import audit_report

    _workload(river_llm, 3, "river")
    report = river_llm.apply_model(audit_report)[0]
    eng = _engine_stats(river_llm)
    assert report["reads"] > 1000
    assert report["violations"] == 0, report["first_violations"]
    assert eng["signal"] == ["river"] and eng["kv_strategy"] == "river"
    assert eng["river_token_layers"] > 0 and eng["mean_decode_depth"] < 30
    assert min(int(k) for k in eng["exit_tokens"]) >= 8  # no exit before the entry layer
    assert eng["peels"] == 0  # the river keeps every row in the batch


# -- recompute ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def recompute_llm(model_dir: Path, depth_profile: Path):
    from tests.conftest import _shutdown
    from tests.depth_probe import install_kv_audit

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
    llm = _engine(model_dir, depth, install_kv_audit)
    yield llm
    _shutdown(llm)


def test_recompute_every_read_slot_has_kv(recompute_llm) -> None:
    """The previous token is resumed through its skipped layers before the current one
    attends to it; a prefill over cached slots of unresumed tokens is capped (audit: no read
    of an unwritten (layer, slot))."""
    from tests.depth_probe import audit_report

    _workload(recompute_llm, 4, "rec")
    report = recompute_llm.apply_model(audit_report)[0]
    eng = _engine_stats(recompute_llm)
    assert report["reads"] > 1000
    assert report["violations"] == 0, report["first_violations"]
    assert eng["signal"] == ["emad", "river"] and eng["kv_strategy"] == "recompute"
    assert eng["recomputed_kv"] > 0 and eng["mean_decode_depth"] < 30
    assert _deeper_later(recompute_llm) > 0
