"""Preemption on a tiered MoE engine: a batch that outgrows the suite's 12 KV blocks while
decoding is preempted and recomputed, and the greedy tokens equal the all-resident engine's.

Mechanics fixture (``tests/support/moefied.py``: identity split, random router; no quality or
speed claim). Tiered: ``capacity`` 0.25 (evictions on every step) with the ``m2r2`` predictor
looking 2 layers ahead (adapters trained on the fixture for seconds). Two engines, one at a
time; slow tier because each start costs about a minute on the project's machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.engines import make_llm, metric, shutdown
from tests.support.moefied import build_mechanics_moefied, train_fixture_adapters
from vllm_adaptive.models.moefied_llama import moe_stats

pytestmark = pytest.mark.slow

#: 6 prompts of 250 tokens hold 2 blocks of 128 each (all 12); decoding past 256 needs a third
PROMPTS = [[(97 * i + 31 * j) % 20000 + 200 for j in range(250)] for i in range(6)]
NEW_TOKENS = 12


def _preempting(llm) -> tuple[list[list[int]], float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    before = metric(llm, "vllm:num_preemptions")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return tokens, metric(llm, "vllm:num_preemptions") - before


def test_preempted_requests_give_the_resident_output(model_dir: Path, tmp_path: Path) -> None:
    moefied = build_mechanics_moefied(model_dir, tmp_path / "moefied")
    adapters = train_fixture_adapters(moefied, tmp_path / "m2r2")
    llm = make_llm(moefied, {})
    try:
        ref, ref_preemptions = _preempting(llm)
    finally:
        shutdown(llm)
    moe = {"capacity": 0.25, "predictor": "m2r2", "lookahead": 2, "m2r2_adapters": str(adapters)}
    llm = make_llm(moefied, {"adaptive": {"moe": moe}})
    try:
        got, preemptions = _preempting(llm)
        (stats,) = llm.apply_model(moe_stats)
    finally:
        shutdown(llm)
    assert ref_preemptions > 0 and preemptions > 0  # the workload really preempts
    assert all(len(t) == NEW_TOKENS for t in ref)
    assert got == ref
    assert stats["violations"] == 0 and stats["evictions"] > 0 and stats["prefetches"] > 0
