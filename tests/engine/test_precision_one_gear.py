"""GEARBX whose levels all run one precision (its float32 defaults on a CPU without an int8 dot
product: fp16 everywhere) through a real float32 engine: routing cannot change a token, so the
engine runs no entropy pass and no calibration, pins still apply, and every level's text is the
same."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.engines import make_llm, metric, shutdown
from tests.support.workloads import SPEC_PROMPTS

CONFIG = {"precision": {"policy": "gearbx", "gears": ["fp16", "fp16", "fp16"]}}


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    llm = make_llm(model_dir, {"adaptive": CONFIG}, dtype="float32")
    yield llm
    shutdown(llm)


def _greedy(n: int, **extra):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, extra_args=extra)


def test_one_gear_runs_no_entropy_pass_and_every_level_gives_the_same_text(llm) -> None:
    from vllm_adaptive.introspection import gear_telemetry

    n = 24
    prompts = SPEC_PROMPTS[:2]
    params = [
        _greedy(n, adaptive_request_tag="one-plain"),
        _greedy(n, adaptive_request_tag="one-low", adaptive_gear="low"),
    ]
    plain, low = llm.generate(prompts[:1] * 2, params, use_tqdm=False)
    assert list(low.outputs[0].token_ids) == list(plain.outputs[0].token_ids)
    (high,) = llm.generate(prompts[:1], _greedy(n, adaptive_gear="high"), use_tqdm=False)
    assert list(high.outputs[0].token_ids) == list(plain.outputs[0].token_ids)

    tel = llm.apply_model(gear_telemetry)[0]
    assert tel["routes"] is False and tel["policy"]["policy"] == "gearbx"
    assert ["fp16", "fp16", "fp16", "full"] in tel["layer_maps"]
    assert all(m[:3] == ["fp16"] * 3 for m in tel["layer_maps"])
    recs = {r["tag"]: r for r in tel["finished"]}
    assert recs["one-plain"]["entropy_bits"] == []  # no pass over the vocabulary per step
    assert sum(recs["one-plain"]["gear_tokens"].values()) == n
    assert recs["one-low"]["pinned"] == "low" and recs["one-low"]["gear_tokens"]["low"] == n


def test_off_still_runs_full_precision(llm) -> None:
    """``adaptive_mode: off`` maps to the model's own float32 weights, not to the one gear."""
    from vllm_adaptive.introspection import gear_telemetry

    llm.generate(SPEC_PROMPTS[:1], _greedy(8, adaptive_mode="off", adaptive_request_tag="one-off"))
    tel = llm.apply_model(gear_telemetry)[0]
    recs = {r["tag"]: r for r in tel["finished"]}
    assert recs["one-off"]["gear_tokens"]["off"] == 8


def test_gearbx_as_typed_takes_the_checkpoints_4bit_grid(model_dir: Path) -> None:
    """The default model's weights lie on a Q4_1 grid. GEARBX as a user types it quantizes its
    int4 tiers on that grid (asymmetric), and on a bf16 engine whose plugin kernels run the bf16
    dot product it runs int4, which gives the weights back, at every level: no routing, no
    entropy pass (the LM head at int8 g32, the Q8_0 grid of its tied embedding), so vLLM's
    drafters compose with it. Elsewhere its routing defaults stay."""
    from vllm_adaptive.introspection import gear_telemetry
    from vllm_adaptive.kernels import native

    one_gear = native.bf16_dot_available()
    # with nothing to route it composes with vLLM's drafters (else refused: unit tests)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    spec = {"speculative_config": ngram} if one_gear else {}
    config = {"adaptive": {"precision": {"policy": "gearbx"}}}
    llm = make_llm(model_dir, config, dtype="bfloat16", **spec)
    try:
        n = 32
        # under vLLM's drafts the plugin cannot follow a request: its keys are refused
        params = _greedy(n) if one_gear else _greedy(n, adaptive_request_tag="typed")
        (out,) = llm.generate(SPEC_PROMPTS[:1], params, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == n
        if one_gear:
            with pytest.raises(Exception, match="speculative drafts"):
                llm.generate(SPEC_PROMPTS[:1], _greedy(4, adaptive_gear="low"), use_tqdm=False)
        tel = llm.apply_model(gear_telemetry)[0]
        drafted = metric(llm, "vllm:spec_decode_num_draft_tokens")
    finally:
        shutdown(llm)
    assert (drafted > 0) == one_gear
    assert tel["low_bit_grid"] == "asymmetric"
    if one_gear:
        maps = sorted(m[:3] for m in tel["layer_maps"])
        assert maps == [["int4"] * 3, ["int8"] * 3], maps  # the decoder's, the head's
        assert tel["routes"] is False
    else:  # routed: each decode token's entropy read
        assert tel["routes"] is True
        (rec,) = [r for r in tel["finished"] + tel["live"] if r["tag"] == "typed"]
        assert len(rec["entropy_bits"]) == n
