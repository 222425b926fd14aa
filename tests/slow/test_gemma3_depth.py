"""Adaptive depth (EMAD, the monotone KV strategy) on Gemma 3 270M through one real vLLM engine.

Gemma 3's blocks run whole through vLLM's own modules (no block recipe: four norms, query/key
norms, sliding-window layers), the engine runs with vLLM's hybrid KV cache manager off (one KV
cache group), and the profile is calibrated on Gemma itself (its final norm scales by
``1 + w``). With the engine's budget 1.0 the output is stock vLLM's token for token; requests
below it exit early, monotone in depth; a KV audit watches every cache write and attention read
through mixed batches, prefix-cache hits on blocks exited tokens wrote, and preemption, and must
see no read of a slot at a layer whose K/V were never written.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.support.depth_probe import audit_report, install_kv_audit
from tests.support.engines import NUM_BLOCKS, make_llm, metric, shutdown
from tests.support.workloads import PROMPTS, run_workloads
from vllm_adaptive.introspection import depth_telemetry

NUM_LAYERS = 18


@pytest.fixture(scope="module")
def gemma_depth_llm(gemma_dir: Path, gemma_depth_profile: Path):
    depth = {"profile": str(gemma_depth_profile), "budget": 1.0, "floor": {"tokens": 4}}
    # one KV cache group: the suite's 12 blocks of 128 slots hold 1536 tokens, so the long
    # batch below preempts (with the hybrid manager's six groups Gemma needs 48)
    llm = make_llm(
        gemma_dir,
        {"adaptive": {"depth": depth}},
        num_gpu_blocks_override=NUM_BLOCKS,
        disable_hybrid_kv_cache_manager=True,
    )
    llm.apply_model(install_kv_audit)
    yield llm
    shutdown(llm)


def _params(n: int, budget: float | None = None, tag: str | None = None):
    from vllm import SamplingParams

    extra = {}
    if budget is not None:
        extra["adaptive_depth_budget"] = budget
    if tag is not None:
        extra["adaptive_request_tag"] = tag
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, extra_args=extra or None)


def _records(llm, tag: str) -> list[dict]:
    return [r for r in llm.apply_model(depth_telemetry)[0]["finished"] if r["tag"] == tag]


def test_budget_one_is_token_identical_to_stock(gemma_depth_llm, stock_gemma_bf16: dict) -> None:
    before = gemma_depth_llm.apply_model(depth_telemetry)[0]["engine"]
    got = run_workloads(gemma_depth_llm, ["identity"])["identity"]
    ref = stock_gemma_bf16["identity"]
    assert got["alone"] == ref["alone"]
    after = gemma_depth_llm.apply_model(depth_telemetry)[0]["engine"]
    # the runtime planned those steps (not a bypass) and no token stopped early
    assert after["decode_tokens"] > before["decode_tokens"]
    assert set(after["exit_tokens"]) == {str(NUM_LAYERS)}
    assert len(got["alone"]) == len(PROMPTS)


def test_request_budget_exits_monotone(gemma_depth_llm) -> None:
    prompts = ["def quicksort(items):\n    ", "The history of the printing press"]
    outs = gemma_depth_llm.generate(
        prompts, [_params(64, 0.5, f"g-mono{i}") for i in range(2)], use_tqdm=False
    )
    assert all(len(o.outputs[0].token_ids) == 64 for o in outs)
    shallow = 0
    for i in range(2):
        (rec,) = _records(gemma_depth_llm, f"g-mono{i}")
        depths = rec["depths"]
        assert len(depths) == 64 and depths[0] == NUM_LAYERS  # prefill: full depth
        assert all(depths[t] <= depths[t - 1] for t in range(1, 64)), depths  # monotone
        shallow += sum(d < NUM_LAYERS for d in depths)
    assert shallow > 0


def test_kv_audit_mixed_batches_prefix_hits_preemption(gemma_depth_llm) -> None:
    """No attention call, on sliding-window or global layers, reads a (layer, slot) whose K/V
    were never written."""
    llm = gemma_depth_llm
    rng = random.Random(0)
    words = "the of model cache layer token exit depth value key block request batch".split()
    preempt0 = metric(llm, "vllm:num_preemptions")
    hits0 = metric(llm, "vllm:prefix_cache_hits")
    eng0 = llm.apply_model(depth_telemetry)[0]["engine"]
    for round_ in range(2):
        prompts, params = [], []
        for j in range(rng.randint(3, 5)):
            prompts.append(" ".join(rng.choice(words) for _ in range(rng.randint(5, 150))))
            budget = rng.choice([None, 0.4, 0.5, 0.7])
            params.append(_params(rng.randint(8, 120), budget, f"g-mix{round_}-{j}"))
        llm.generate(prompts, params, use_tqdm=False)
    # prefix-cache hits on blocks that exited tokens wrote: continue a finished request
    first = llm.generate(["Write a story about a lighthouse keeper."], _params(200, 0.4))[0]
    ids = list(first.prompt_token_ids) + list(first.outputs[0].token_ids)
    llm.generate([{"prompt_token_ids": ids}], _params(16, tag="g-resume"), use_tqdm=False)
    # preemption: more concurrent KV than the 12 blocks hold
    long = [f"Chapter {k}. " + " ".join(words) for k in range(8)]
    llm.generate(long, [_params(300, 0.5) for _ in long], use_tqdm=False)

    report = llm.apply_model(audit_report)[0]
    eng = llm.apply_model(depth_telemetry)[0]["engine"]
    assert report["installed"] and report["reads"] > 1000
    assert report["violations"] == 0, report["first_violations"]
    assert metric(llm, "vllm:num_preemptions") > preempt0
    assert metric(llm, "vllm:prefix_cache_hits") > hits0
    assert eng["capped_prefills"] > eng0["capped_prefills"]  # the resumed prefill was capped
    assert eng["peels"] > eng0["peels"]  # batches were really subset mid-step
    (resume,) = _records(llm, "g-resume")
    assert resume["capped_prefill_depth"] is not None
    assert resume["capped_prefill_depth"] < NUM_LAYERS
