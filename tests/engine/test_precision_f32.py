"""The float32 precisions through one real float32 engine: GEARBX gears (w8a8 smoothed, fp16,
full) with per-token routing, the LM head geared too, each gear pinned per request.

The high gear is vLLM's own float linear and head: token-identical to stock vLLM. The fp16 gear
(weights rounded to float16, the head too) follows the full-precision continuation as closely as
kernel numerics allow; the smoothed W8A8 gear (int8 weights, int8 per-token activations) is a
lossy low gear. Quality is teacher-forced through the decode path against full precision.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.engines import make_llm, shutdown
from tests.support.forcing import agreement, perplexity, teacher_force
from tests.support.workloads import SPEC_PROMPTS


@pytest.fixture(scope="module")
def llm(model_dir: Path, smoothing_profile: Path):
    from vllm_adaptive.bench.teacher_forcing import TeacherForcingLogitsProcessor

    config = {
        "precision": {
            "policy": "gearbx",
            "gears": ["w8a8", "fp16", "full"],
            "routing": "token",
            "smoothing": {"profile": str(smoothing_profile), "alpha": 0.5},
            "gearbx": {"calibration": "none", "cold_start": False},
        }
    }
    llm = make_llm(
        model_dir,
        {"adaptive": config},
        dtype="float32",
        logits_processors=[TeacherForcingLogitsProcessor],
    )
    yield llm
    shutdown(llm)


def _greedy(n: int, **extra):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, extra_args=extra)


def test_high_gear_is_stock(llm, stock_f32: dict) -> None:
    """Pinned high: vLLM's own linears and head, each prompt alone as stock ran it."""
    llm.reset_prefix_cache()
    for i, prompt in enumerate(SPEC_PROMPTS):
        out = llm.generate([prompt], _greedy(40, adaptive_gear="high"), use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == stock_f32["spec_mixed"]["alone"][i], prompt


@pytest.fixture(scope="module")
def continuations(llm) -> list[tuple[list[int], list[int]]]:
    """Full-precision greedy continuations (prompt ids, 48 tokens) to force the gears along."""
    outs = llm.generate(SPEC_PROMPTS[:3], _greedy(48, adaptive_mode="off"), use_tqdm=False)
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]


def _quality(llm, continuations, gear: str) -> tuple[float, float]:
    """(agreement with full precision, perplexity ratio) over the continuations."""
    agree, ratio = [], []
    for k, (prompt, cont) in enumerate(continuations):
        geared = teacher_force(llm, prompt, cont, f"{gear}{k}", adaptive_gear=gear)
        full = teacher_force(llm, prompt, cont, f"full{gear}{k}", adaptive_mode="off")
        agree.append(agreement(geared, cont))
        ratio.append(perplexity(geared) / perplexity(full))
    return sum(agree) / len(agree), max(ratio)


def test_fp16_gear_tracks_full_precision(llm, continuations) -> None:
    agree, ppl_ratio = _quality(llm, continuations, "mid")
    assert agree >= 0.97, agree
    assert ppl_ratio < 1.01, ppl_ratio


def test_smoothed_w8a8_gear_stays_close(llm, continuations) -> None:
    agree, ppl_ratio = _quality(llm, continuations, "low")
    assert agree >= 0.75, agree
    assert ppl_ratio < 1.25, ppl_ratio


def test_gears_share_a_batch(llm) -> None:
    """Token routing: a full-precision request next to low- and mid-gear ones decodes as it
    does alone, and the telemetry attributes each request's tokens to its gear."""
    alone = llm.generate(SPEC_PROMPTS[:1], _greedy(32, adaptive_mode="off"), use_tqdm=False)
    params = [
        _greedy(32, adaptive_mode="off", adaptive_request_tag="b-off"),
        _greedy(32, adaptive_gear="low", adaptive_request_tag="b-low"),
        _greedy(32, adaptive_gear="mid", adaptive_request_tag="b-mid"),
    ]
    mixed = llm.generate(SPEC_PROMPTS[:3], params, use_tqdm=False)
    a, b = alone[0].outputs[0].token_ids, mixed[0].outputs[0].token_ids
    assert sum(x == y for x, y in zip(a, b, strict=True)) / len(a) >= 0.9

    from vllm_adaptive.introspection import gear_telemetry

    tel = llm.apply_model(gear_telemetry)[0]
    recs = {r["tag"]: r for r in tel["finished"]}
    assert recs["b-low"]["gear_tokens"]["low"] == 32
    assert recs["b-mid"]["gear_tokens"]["mid"] == 32
    assert recs["b-off"]["gear_tokens"]["off"] == 32


def test_head_is_geared_and_dispatch_is_measured(llm) -> None:
    from vllm_adaptive.introspection import gear_telemetry, kernel_dispatch

    tel = llm.apply_model(gear_telemetry)[0]
    assert ["fp16", "fp16", "full", "full"] in tel["layer_maps"]  # the LM head's map
    assert ["w8a8", "fp16", "full", "full"] in tel["layer_maps"]
    rb = tel["resident_bytes"]
    assert rb["w8a8"] > 0 and rb["fp16"] > 0
    ratios = tel["level_byte_ratios"]
    assert ratios["high"] == pytest.approx(1.0) and ratios["mid"] == pytest.approx(0.5)
    assert ratios["low"] < ratios["mid"]
    (info,) = llm.apply_model(kernel_dispatch)
    keys = set(info["dispatch"])
    assert "fp16:49152x576" in keys  # the head
    assert {"w8a8:960x576", "w8a8:3072x576", "w8a8:576x1536"} <= keys
    assert all(
        k in ("fbgemm_fp16", "native_fp16", "reference")
        for k in info["dispatch"]["fp16:49152x576"].values()
    )
    assert info["machine"]["isa"]
