"""Shared pieces of the self-speculative engine tests (tests/engine/test_spec_*.py): float32
engines with the suite's arguments and the plugin's proposer, checked against stock vLLM on the
same arguments (the ``stock_f32`` fixture)."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from tests.support.engines import make_llm, metric
from tests.support.workloads import SPEC_PROMPTS, run_workloads
from vllm_adaptive.config import SELF_SPECULATIVE_PROPOSER


def spec_engine(model_dir: Path, draft: dict, k: int) -> Any:
    return make_llm(
        model_dir,
        {"adaptive": {"speculative": draft}},
        dtype="float32",
        speculative_config={
            "method": "custom_class",
            "model": SELF_SPECULATIVE_PROPOSER,
            "num_speculative_tokens": k,
        },
    )


#: The low-bit self-draft of the engine tests: symmetric absmax int4, off the default model's
#: Q4_1 grid, so drafts are often rejected.
LOWBIT_DRAFT = {"draft": "lowbit", "precision": "int4", "symmetric": True}


def random_m2r2_adapter(model_dir: Path, out: Path) -> Path:
    """A spec-mode adapter (k=3, rank 4) with random non-zero up-projections, so every delta of
    the accelerated stream is exercised (trained adapters' quality is the bench's business)."""
    import torch

    from vllm_adaptive.artifacts import model_fingerprint
    from vllm_adaptive.m2r2.adapters import AdapterConfig, M2R2Adapters

    cfg = AdapterConfig.from_model_config(
        json.loads((model_dir / "config.json").read_text()), mode="spec", k=3, rank=4
    )
    adapters = M2R2Adapters.zeros(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in adapters.named_parameters():
            if name.endswith(("q_B", "o_B", "mlp_U")):
                t.copy_(torch.randn(t.shape, generator=g) * 0.02)
    adapters.save(out, {"model_fingerprint": model_fingerprint(model_dir)})
    return out


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def check_identity(llm, stock_f32: dict, workloads: list[str]) -> dict[str, float]:
    """Greedy output identical to stock on the named workloads, with drafts both accepted and
    rejected. Returns how far vLLM's preemption and prefix-hit counters moved."""
    drafts0 = metric(llm, "vllm:spec_decode_num_draft_tokens")
    accepted0 = metric(llm, "vllm:spec_decode_num_accepted_tokens")
    preempt0 = metric(llm, "vllm:num_preemptions")
    hits0 = metric(llm, "vllm:prefix_cache_hits")
    got = run_workloads(llm, workloads)
    for name in workloads:
        for key, seqs in got[name].items():
            ref = stock_f32[name][key]
            assert len(seqs) == len(ref), (name, key)
            for i, (a, b) in enumerate(zip(seqs, ref, strict=True)):
                assert a == b, f"{name}.{key}[{i}]: first difference at {_first_difference(a, b)}"
    drafted = metric(llm, "vllm:spec_decode_num_draft_tokens") - drafts0
    accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens") - accepted0
    assert drafted > 300  # speculation really ran
    assert 0 < accepted < drafted  # some drafts accepted, some rejected
    return {
        "preemptions": metric(llm, "vllm:num_preemptions") - preempt0,
        "prefix_hits": metric(llm, "vllm:prefix_cache_hits") - hits0,
    }


def check_mode_off_gets_no_drafts(llm, stock_f32: dict, k: int) -> None:
    """``adaptive_mode: "off"`` turns drafting off for that request only; output unchanged."""
    from vllm import SamplingParams

    def drafts_for(params) -> tuple[float, list[list[int]]]:
        before = metric(llm, "vllm:spec_decode_num_draft_tokens")
        outs = llm.generate(SPEC_PROMPTS[:2], params, use_tqdm=False)
        ids = [list(o.outputs[0].token_ids) for o in outs]
        return metric(llm, "vllm:spec_decode_num_draft_tokens") - before, ids

    def greedy(extra: dict | None = None) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, extra_args=extra)

    off = greedy({"adaptive_mode": "off"})
    ref = stock_f32["spec_mixed"]["alone"][:2]
    drafted, ids = drafts_for([off, off])
    assert drafted == 0
    assert ids == ref
    drafted, ids = drafts_for([off, greedy()])  # one of two drafts: fewer, not none
    assert 0 < drafted <= k * 40
    assert ids == ref


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: Counter, probs: dict[int, float], total: int) -> tuple[float, int]:
    """Chi-square of ``counts`` against ``probs`` over the tokens expected >= 5 times, the
    remaining mass pooled into one bucket."""
    keep = [t for t, p in probs.items() if p * total >= 5]
    other_p = 1.0 - sum(probs[t] for t in keep)
    stat = sum((counts[t] - probs[t] * total) ** 2 / (probs[t] * total) for t in keep)
    other = total - sum(counts[t] for t in keep)
    if other_p * total >= 5:
        stat += (other - other_p * total) ** 2 / (other_p * total)
        return stat, len(keep)
    return stat, len(keep) - 1
