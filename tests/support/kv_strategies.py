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


def _mask_stats(model) -> dict:
    from vllm_adaptive.depth.mask_context import mask_stats

    return mask_stats()


def check_masked_slots_never_contribute(llm, moved: dict, num_layers: int) -> None:
    """After a workload under the ``mask`` strategy with the mask audit: unwritten slots were
    in attended ranges and poisoned, none reached an output, and the masked path really ran."""
    from tests.support.depth_probe import audit_report

    report = llm.apply_model(audit_report)[0]
    eng = engine_stats(llm)
    masked = llm.apply_model(_mask_stats)[0]
    assert report["installed"] and report["reads"] > 1000
    assert report["poisoned"] > 1000, report  # unwritten slots were in attended ranges
    assert report["nan_outputs"] == 0, report["first_nan_layers"]
    assert masked["masked"] > 0, masked  # the backend's masked path ran
    assert eng["kv_strategy"] == "mask" and eng["masked_steps"] > 0
    assert eng["capped_prefills"] == 0  # a mask needs no prefill cap
    assert eng["mean_decode_depth"] < num_layers
    assert deeper_later(llm) > 0  # not monotone: a token may run deeper than the one before
    assert moved["preemptions"] > 0 and moved["prefix_hits"] > 0


def check_mask_withheld_reads_poison(llm, prompts: list[str], sampling: Any) -> None:
    """Negative control: the same poison with the mask withheld from the backend reaches the
    outputs (``prompts`` must exit early, so that unwritten slots are attended)."""
    from tests.support.depth_probe import (
        audit_report,
        reset_nan_outputs,
        restore_publishing_mask,
        scrub_nan_kv,
        stop_publishing_mask,
    )

    llm.apply_model(stop_publishing_mask)
    try:
        llm.generate(prompts, [sampling for _ in prompts], use_tqdm=False)
        report = llm.apply_model(audit_report)[0]
    finally:
        llm.apply_model(restore_publishing_mask)
        llm.apply_model(reset_nan_outputs)
        scrubbed = llm.apply_model(scrub_nan_kv)[0]
    assert report["poisoned"] > 0  # exited tokens left unwritten slots in attended ranges
    assert report["nan_outputs"] > 0
    assert scrubbed > 0  # the poison reached K/V written after it (and is gone now)
