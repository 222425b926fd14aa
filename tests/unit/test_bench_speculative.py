"""The speculation bench's --spec parsing, labels and table (engines: docs/speculative.md)."""

from __future__ import annotations

import pytest

from vllm_adaptive.bench.speculative import engine_settings, parse_spec, spec_label, table_markdown
from vllm_adaptive.config import SELF_SPECULATIVE_PROPOSER, AdaptiveConfigError


def test_specs_map_to_engine_settings() -> None:
    ngram = parse_spec('{"method": "ngram", "k": 4}')
    assert engine_settings(ngram) == (
        {},
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 5,
        },
    )
    low = parse_spec('{"draft": {"draft": "lowbit", "symmetric": true}, "k": 2}')
    additional, speculative = engine_settings(low)
    assert additional == {"adaptive": {"speculative": {"draft": "lowbit", "symmetric": True}}}
    assert speculative["model"] == SELF_SPECULATIVE_PROPOSER
    assert speculative["num_speculative_tokens"] == 2
    assert spec_label(low) == "lowbit int4 sym k=2"
    assert spec_label(parse_spec('{"draft": {"draft": "early", "layers": 8}, "k": 4}')) == (
        "early 8 layers k=4"
    )
    fp16 = parse_spec(
        '{"draft": {"draft": "lowbit", "precision": "w8a8"}, "k": 3,'
        ' "target": {"policy": "fixed", "gear": "fp16"}}'
    )
    additional, _ = engine_settings(fp16)
    assert additional["adaptive"]["precision"] == {"policy": "fixed", "gear": "fp16"}
    assert spec_label(fp16) == "lowbit w8a8 k=3, target fp16"
    ngram_fp16 = parse_spec(
        '{"method": "ngram", "k": 4, "target": {"policy": "fixed", "gear": "fp16"}}'
    )
    additional, speculative = engine_settings(ngram_fp16)
    assert additional == {"adaptive": {"precision": {"policy": "fixed", "gear": "fp16"}}}
    assert speculative["method"] == "ngram"
    assert spec_label(ngram_fp16) == "ngram k=4, target fp16"
    tuned = parse_spec('{"method": "ngram", "k": 2, "options": {"prompt_lookup_max": 3}}')
    assert engine_settings(tuned)[1]["prompt_lookup_max"] == 3
    assert spec_label(tuned) == "ngram k=2, prompt_lookup_max 3"
    hybrid = parse_spec(
        '{"draft": {"draft": "lowbit", "precision": "w8a8", "prompt_lookup": {}}, "k": 3}'
    )
    assert spec_label(hybrid) == "prompt lookup, else lowbit w8a8 k=3"


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"method": "ngram"}', "integer k"),
        ('{"method": "eagle", "k": 2}', "built-in methods"),
        ('{"k": 2}', "either"),
        ('{"k": 2, "draft": {"draft": "lowbit"}, "extra": 1}', "unknown keys"),
        ("not json", "not JSON"),
        ('{"k": 2, "draft": {"draft": "lowbit"}, "options": {}}', 'for "method" engines'),
    ],
)
def test_bad_specs_are_refused(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_spec(text)


def test_suffix_decoding_is_vllms_method_and_needs_arctic_inference() -> None:
    import importlib.util

    text = '{"method": "suffix", "k": 8}'
    if importlib.util.find_spec("arctic_inference") is None:
        with pytest.raises(ValueError, match="arctic-inference"):
            parse_spec(text)
        return
    spec = parse_spec(text)
    assert engine_settings(spec) == ({}, {"method": "suffix", "num_speculative_tokens": 8})
    assert spec_label(spec) == "suffix k=8"


def test_bad_draft_settings_are_refused_before_any_engine() -> None:
    with pytest.raises(AdaptiveConfigError, match="adaptive.speculative.layers"):
        parse_spec('{"draft": {"draft": "early", "layers": 0}, "k": 2}')
    with pytest.raises(AdaptiveConfigError, match="gear"):
        parse_spec('{"method": "ngram", "k": 2, "target": {"policy": "fixed", "gear": "int3"}}')


def test_table_has_one_row_per_run() -> None:
    results = {
        "corpora": {
            "code.txt": {
                "stock_decode_tokens_per_s": {"1": 20.0, "8": 80.0},
                "runs": [
                    {
                        "label": "a",
                        "speedup": {"1": 1.5, "8": 0.9},
                        "acceptance_rate": 0.8,
                        "mean_accepted_length": 3.2,
                        "identical_to_stock": 1.0,
                    },
                    {
                        "label": "b",
                        "speedup": {"1": 0.5, "8": 0.4},
                        "acceptance_rate": None,
                        "mean_accepted_length": None,
                        "identical_to_stock": 1.0,
                    },
                ],
            }
        }
    }
    md = table_markdown(results)
    assert "| a | 1.50 | 0.90 | 0.800 | 3.20 | 1.00 |" in md
    assert "| b | 0.50 | 0.40 | - | - | 1.00 |" in md
