"""The hybrid drafter's per-request choice and its per-source tally (``speculative/draft_mix``),
and the refusals of ``adaptive.hybrid`` configurations an engine cannot run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_adaptive.config import AdaptiveConfigError, HybridConfig, parse_adaptive_config
from vllm_adaptive.metal_backend.support import unsupported
from vllm_adaptive.speculative.draft_mix import LEARNED, LOOKUP, DraftMix
from vllm_adaptive.speculative.hybrid import engine_problem


def test_lookup_wins_where_it_matches_learned_elsewhere() -> None:
    mix = DraftMix(min_lookup_tokens=2)
    out = mix.choose(
        ["a", "b", "c", "d"],
        learned=[[1], [2], [3], []],
        looked=[[7, 8, 9], [5], [], []],
    )
    # b's one-token lookup draft is below min_lookup_tokens: the learned draft goes instead
    assert out == [[7, 8, 9], [2], [3], []]
    assert mix.pending == {"a": (LOOKUP, 3), "b": (LEARNED, 1), "c": (LEARNED, 1)}


def test_tally_counts_accepted_tokens_per_source() -> None:
    mix = DraftMix()
    mix.choose(["a", "b", "c"], learned=[[1], [2], [3]], looked=[[7, 8, 9], [], []])
    # a kept 3 tokens (2 of its 3 drafted accepted), b kept 1 (its draft rejected), c was not
    # sampled this step (a prefill chunk): it stays pending
    mix.verified(["a", "b", "c"], [[7, 8, 4], [6], []])
    s = mix.summary()
    assert s[LOOKUP] == {
        "drafts": 1,
        "tokens": 3,
        "accepted": 2,
        "acceptance": pytest.approx(2 / 3, abs=1e-4),
    }
    assert s[LEARNED] == {"drafts": 1, "tokens": 1, "accepted": 0, "acceptance": 0.0}
    assert set(mix.pending) == {"c"}
    # c leaves the batch: its pending draft is dropped, never counted
    mix.verified(["a"], [[1]])
    assert mix.pending == {} and mix.summary()[LEARNED]["drafts"] == 1


def test_accepted_never_exceeds_drafted() -> None:
    mix = DraftMix()
    mix.choose(["a"], learned=[[1]], looked=[[]])
    mix.verified(["a"], [[1, 2, 3]])  # the scheduler cannot give more, but the tally caps it
    assert mix.summary()[LEARNED]["accepted"] == 1


def _spec(**kw):
    return SimpleNamespace(
        **({"method": "eagle3", "num_speculative_tokens": 4, "draft_sample_method": "greedy"} | kw)
    )


@pytest.mark.parametrize(
    ("spec", "settings", "words"),
    [
        (None, {}, "must name one"),
        (_spec(method="ngram"), {}, "'ngram'"),
        (_spec(), {"learned_tokens": 5, "lookup": "ngram"}, "learned_tokens 5 > "),
        (_spec(draft_sample_method="probabilistic"), {"lookup": "ngram"}, "draft probabilities"),
    ],
)
def test_engine_problems_are_named(spec, settings, words) -> None:
    problem = engine_problem(spec, HybridConfig(**settings))
    assert problem is not None and words in problem


def test_a_runnable_engine_has_no_problem() -> None:
    assert engine_problem(_spec(), HybridConfig(lookup="ngram", learned_tokens=4)) is None


def test_hybrid_config_refusals() -> None:
    with pytest.raises(AdaptiveConfigError, match="use one"):
        parse_adaptive_config({"hybrid": {}, "speculative": {"draft": "early"}})
    with pytest.raises(AdaptiveConfigError, match="prompt_lookup"):
        parse_adaptive_config({"hybrid": {"lookup": "suffix", "prompt_lookup": {"min": 2}}})
    with pytest.raises(AdaptiveConfigError, match="learned_tokens"):
        parse_adaptive_config({"hybrid": {"learned_tokens": -1}})
    cfg = parse_adaptive_config({"hybrid": {"lookup": "ngram"}})
    assert cfg.active_hybrid is not None and cfg.active_hybrid.ngram.max == 5
    assert parse_adaptive_config({"mode": "off", "hybrid": {}}).active_hybrid is None
    assert "adaptive.hybrid" in dict(unsupported(cfg))
