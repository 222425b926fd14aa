"""With adaptivity off, and with the adaptive class but every mechanism off,
vLLM's output is token-for-token stock vLLM's (plugin not loaded at all)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.identity_workload import MAX_TOKENS, PROMPTS, run_identity_workload
from vllm_adaptive.introspection import describe_model

pytestmark = pytest.mark.engine
TESTS = Path(__file__).resolve().parent


def test_reference_is_nontrivial(stock_reference: dict) -> None:
    assert len(stock_reference["alone"]) == len(PROMPTS) >= 8
    for seq in stock_reference["alone"] + stock_reference["batch"]:
        assert len(seq) == MAX_TOKENS
    # greedy and seeded-random requests differ, so the batch really is mixed
    assert stock_reference["batch"][2] != stock_reference["alone"][2]


def test_plugin_off_loads_stock_class(plugin_off_llm) -> None:
    (info,) = plugin_off_llm.apply_model(describe_model)
    assert info == {
        "class": "vllm.model_executor.models.llama.LlamaForCausalLM",
        "adaptive_config": None,
    }


def test_adaptive_section_selects_adaptive_class(adaptive_llm) -> None:
    (info,) = adaptive_llm.apply_model(describe_model)
    assert info["class"] == "vllm_adaptive.models.llama.AdaptiveLlamaForCausalLM"
    assert info["adaptive_config"] == {
        "mode": "on",
        "precision": None,
        "depth": None,
        "speculative": None,
    }


def test_plugin_off_identical_to_stock(plugin_off_llm, stock_reference: dict) -> None:
    got = run_identity_workload(plugin_off_llm)
    assert got["alone"] == stock_reference["alone"]
    assert got["batch"] == stock_reference["batch"]


def test_adaptive_all_off_identical_to_stock(adaptive_llm, stock_reference: dict) -> None:
    got = run_identity_workload(adaptive_llm)
    for i, (a, b) in enumerate(zip(got["alone"], stock_reference["alone"], strict=True)):
        first = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        assert first is None, f"prompt {i} alone diverges from stock at token {first}"
    assert got["batch"] == stock_reference["batch"]


def test_bad_request_value_rejected_and_engine_survives(adaptive_llm) -> None:
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="adaptive_mode"):
        adaptive_llm.generate(
            ["hi"], SamplingParams(max_tokens=2, extra_args={"adaptive_mode": "x"})
        )
    with pytest.raises(VLLMValidationError, match="adaptive_budgett"):
        adaptive_llm.generate(
            ["hi"], SamplingParams(max_tokens=2, extra_args={"adaptive_budgett": 1})
        )
    ok = adaptive_llm.generate(
        ["hi"], SamplingParams(max_tokens=3, extra_args={"adaptive_mode": "off"})
    )
    assert len(ok[0].outputs[0].token_ids) == 3
