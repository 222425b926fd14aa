"""The low-bit self-draft's expensive checks (the default tier keeps greedy identity on mixed
batches, ``tests/engine/test_spec_lowbit.py``): greedy identity with prefix-cache hits and
preemption, and random sampling that keeps the target's distribution (chi-square on the most
likely tokens, with a negative control that shows the test can fail). Symmetric absmax int4
draft, off the default model's Q4_1 grid, so drafts are often rejected; float32 engine.
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
