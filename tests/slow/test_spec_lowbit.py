"""Self-speculative decoding with a low-precision draft (symmetric absmax int4, off the default
model's Q4_1 grid, so drafts are often rejected), through a real float32 engine: greedy output
token-identical to stock vLLM alone and in mixed batches with chunked prefill, and with
prefix-cache hits and preemption; ``adaptive_mode: "off"`` gets no drafts; random sampling keeps
the target's distribution (chi-square on the most likely tokens, with a negative control that
shows the test can fail).

The full suite only: on an AVX2 EPYC this module took over 4 minutes of the default tier, and a
draft at half the target's bytes does not pay (docs/speculative.md); the default tier's lossless
speculation checks are the early-layer and M2R2 drafts (``tests/engine/test_spec_*.py``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.support import speculative as spec
from tests.support.engines import metric, shutdown
from tests.support.workloads import STAT_PROMPT

K = 4
STAT_SAMPLES = 1200


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    llm = spec.spec_engine(model_dir, spec.LOWBIT_DRAFT, K)
    yield llm
    shutdown(llm)


def test_greedy_identical_to_stock_in_mixed_batches(llm, stock_f32: dict) -> None:
    spec.check_identity(llm, stock_f32, ["spec_mixed"])


def test_request_with_mode_off_gets_no_drafts(llm, stock_f32: dict) -> None:
    spec.check_mode_off_gets_no_drafts(llm, stock_f32, K)


def test_greedy_identical_to_stock_with_prefix_hits_and_preemption(llm, stock_f32: dict) -> None:
    moved = spec.check_identity(llm, stock_f32, ["spec_cache"])
    assert moved["preemptions"] > 0 and moved["prefix_hits"] > 0


def test_sampling_keeps_target_distribution(llm, stock_f32: dict) -> None:
    from vllm import SamplingParams

    stat = stock_f32["spec_stat"]
    drafts0 = metric(llm, "vllm:spec_decode_num_draft_tokens")
    accepted0 = metric(llm, "vllm:spec_decode_num_accepted_tokens")
    params = [  # two tokens: the second is drafted (k=4) and verified
        SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=s)
        for s in range(STAT_SAMPLES)
    ]
    outs = llm.generate([STAT_PROMPT] * STAT_SAMPLES, params, use_tqdm=False)
    second = Counter(
        o.outputs[0].token_ids[1] for o in outs if o.outputs[0].token_ids[0] == stat["t1"]
    )
    total = sum(second.values())
    assert total >= 300, f"only {total} samples began with the most likely token"
    drafted = metric(llm, "vllm:spec_decode_num_draft_tokens") - drafts0
    accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens") - accepted0
    assert drafted > STAT_SAMPLES and 0 < accepted < drafted  # drafts both kept and rejected

    probs = {int(t): p for t, p in stat["p"].items()}
    value, df = spec.chi2(second, probs, total)
    assert value < spec.chi2_critical(df), (value, df, second.most_common(8))
    # negative control: the same samples against the target at temperature 0.6 are rejected
    z = sum(p ** (1 / 0.6) for p in probs.values())
    sharp = {t: p ** (1 / 0.6) / z * sum(probs.values()) for t, p in probs.items()}
    wrong, df_w = spec.chi2(second, sharp, total)
    assert wrong > spec.chi2_critical(df_w), (wrong, df_w)
