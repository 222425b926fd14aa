"""What every KV-strategy engine test runs (tests/engine/test_kv_*.py): one engine per strategy
with its own exit signal, the KV audit installed (tests/support/depth_probe.py)."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

from tests.support.engines import AMX_EAGER_DRIFT, amx_bf16_attention, make_llm, metric
from tests.support.workloads import exits_off
from vllm_adaptive.introspection import depth_telemetry

WORDS = "the of model cache layer token exit depth value key block request batch".split()


def engine(model_dir: Path, depth: dict, audit) -> Any:
    """A bf16 engine with the suite's arguments (prefix caching, a 12-block cache that long
    batches overflow, 256-token prefill chunks) and the audit installed in its worker."""
    llm = make_llm(model_dir, {"adaptive": {"depth": depth}})
    llm.apply_model(audit)
    return llm


def params(n: int, budget: float | None = None, tag: str | None = None, **kw) -> Any:
    from vllm import SamplingParams

    extra = {}
    if budget is not None:
        extra["adaptive_depth_budget"] = budget
    if tag is not None:
        extra["adaptive_request_tag"] = tag
    kw.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=n, ignore_eos=True, extra_args=extra or None, **kw)


def engine_stats(llm) -> dict:
    return llm.apply_model(depth_telemetry)[0]["engine"]


def check_exits_off_is_stock(llm, stock_bf16: dict) -> None:
    """Exits off (budget 1.0): the same batch as stock's, token for token."""
    llm.reset_prefix_cache()
    got = exits_off(llm, {"adaptive_depth_budget": 1.0})
    if got != stock_bf16["exits_off"] and amx_bf16_attention():
        import pytest

        pytest.xfail(AMX_EAGER_DRIFT)
    for i, (a, b) in enumerate(zip(got, stock_bf16["exits_off"], strict=True)):
        assert a == b, f"prompt {i}: first difference at token " + str(
            next(j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        )


def workload(llm, seed: int, tag: str) -> dict[str, float]:
    """Mixed batches, prefix-cache hits on blocks exited tokens wrote, chunked prefill and
    preemption (the KV cache holds 12 blocks). Returns how far vLLM's counters moved."""
    preempt0 = metric(llm, "vllm:num_preemptions")
    hits0 = metric(llm, "vllm:prefix_cache_hits")
    rng = random.Random(seed)
    for round_ in range(2):
        prompts, ps = [], []
        for j in range(rng.randint(3, 5)):
            prompts.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 150))))
            ps.append(params(rng.randint(8, 160), tag=f"{tag}{round_}-{j}"))
        llm.generate(prompts, ps, use_tqdm=False)
    first = llm.generate(["Write a story about a lighthouse keeper."], params(300))[0]
    ids = list(first.prompt_token_ids) + list(first.outputs[0].token_ids)
    out = llm.generate([{"prompt_token_ids": ids}], params(16, logprobs=1), use_tqdm=False)
    assert all(math.isfinite(next(iter(lp.values())).logprob) for lp in out[0].outputs[0].logprobs)
    long = [f"Chapter {k}. " + " ".join(WORDS) for k in range(5)]
    llm.generate(long, [params(300) for _ in long], use_tqdm=False)
    return {
        "preemptions": metric(llm, "vllm:num_preemptions") - preempt0,
        "prefix_hits": metric(llm, "vllm:prefix_cache_hits") - hits0,
    }


def deeper_later(llm) -> int:
    """Decode steps where a token ran deeper than the token before it (no monotone cap)."""
    tel = llm.apply_model(depth_telemetry)[0]
    total = 0
    for r in tel["finished"]:
        d = r["depths"][1:]  # decode tokens
        total += sum(1 for t in range(1, len(d)) if d[t] > d[t - 1])
    return total


def exiting_continuation(llm, prompt: str, budget: float | None = None) -> None:
    """One request that exits, then a continuation of it that attends to its slots."""
    llm.reset_prefix_cache()
    first = llm.generate([prompt], params(200, budget), use_tqdm=False)[0]
    ids = list(first.prompt_token_ids) + list(first.outputs[0].token_ids)
    llm.generate([{"prompt_token_ids": ids}], params(16, budget), use_tqdm=False)
    llm.reset_prefix_cache()
