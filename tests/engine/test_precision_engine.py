"""Entropy-routed precision through a real vLLM engine (bf16, so the packed CPU kernels run).

One engine for the module: GEARBX policy with per-token routing and thresholds set inside
this model's entropy range, so requests shift gears mid-generation.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.support.engines import make_llm, shutdown
from tests.support.forcing import teacher_force

PROMPTS = [
    "The history of the Roman empire begins",
    "def merge_sort(items):\n    ",
    "A recipe for bread: first, mix the flour",
]
GEAR_CONFIG = {
    "precision": {
        "policy": "gearbx",
        # the packed weight-only tiers and an fp16 head on every machine (a bf16 engine's
        # default on AMX CPUs is (w8a8, w8a16, full): tests/engine/test_precision_amx.py)
        "gears": ["int4", "int8", "full"],
        "head_gears": ["fp16", "fp16", "full"],
        "routing": "token",
        "gearbx": {
            "calibration": "none",
            "cold_start": False,
            "window": 2,
            "min_gear_duration": 2,
            "theta_low": 1.0,
            "theta_high": 2.0,
        },
    }
}


@pytest.fixture(scope="module")
def gear_llm(model_dir: Path):
    from vllm_adaptive.bench.teacher_forcing import TeacherForcingLogitsProcessor

    llm = make_llm(
        model_dir, {"adaptive": GEAR_CONFIG}, logits_processors=[TeacherForcingLogitsProcessor]
    )
    yield llm
    shutdown(llm)


def _params(tag: str, n: int = 32, **extra):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0,
        max_tokens=n,
        ignore_eos=True,
        extra_args={"adaptive_request_tag": tag, **extra},
    )


def _telemetry(llm) -> dict:
    from vllm_adaptive.introspection import gear_telemetry

    tel = llm.apply_model(gear_telemetry)[0]
    return {r["tag"]: r for r in tel["finished"] + tel["live"]} | {"_": tel}


def test_gears_shift_mid_request_and_output_stays_sane(gear_llm) -> None:
    outs = gear_llm.generate(
        PROMPTS, [_params(f"shift{i}") for i in range(len(PROMPTS))], use_tqdm=False
    )
    ref = gear_llm.generate(
        PROMPTS,
        [_params(f"ref{i}", adaptive_mode="off") for i in range(len(PROMPTS))],
        use_tqdm=False,
    )
    tel = _telemetry(gear_llm)
    shifted = 0
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        rec = tel[f"shift{i}"]
        assert rec["generated_tokens"] == len(o.outputs[0].token_ids) == 32
        assert sum(rec["gear_tokens"].values()) == 32
        assert len(rec["entropy_bits"]) == 32 and all(e >= 0 for e in rec["entropy_bits"])
        shifted += rec["shifts"] > 0 and len({g for g in rec["gears"]}) > 1
        assert tel[f"ref{i}"]["gear_tokens"]["off"] == 32  # mode off: full precision
        # Sanity across the shifts: the geared model, forced along the full-precision
        # continuation, predicts it about as well as full precision does (KV written at
        # different gears before and after each shift is read back coherently).
        prompt_ids = list(o.prompt_token_ids)
        forced = list(r.outputs[0].token_ids)
        geared = teacher_force(gear_llm, prompt_ids, forced, f"tfg{i}")
        full = teacher_force(gear_llm, prompt_ids, forced, f"tff{i}", adaptive_mode="off")
        agree = sum(a == b for a, b in zip(geared.greedy, forced[1:], strict=False)) / (
            len(forced) - 1
        )
        assert agree >= 0.6, (i, agree)
        ppl_g = math.exp(-sum(geared.logprobs) / len(geared.logprobs))
        ppl_f = math.exp(-sum(full.logprobs) / len(full.logprobs))
        assert ppl_g < 2.0 * ppl_f + 0.5, (i, ppl_g, ppl_f)
    assert shifted >= 1, "no request shifted gears; the thresholds no longer fit this model"


def test_packed_gear_kv_is_consistent_between_decode_and_prefill(gear_llm) -> None:
    """Pinned to the low gear (int4 packed weights), scoring a sequence token by token through
    the KV cache gives the same log-probabilities as scoring it in one prefill pass."""
    from vllm import SamplingParams

    out = gear_llm.generate(PROMPTS[:1], [_params("seed", 40)], use_tqdm=False)[0]
    prompt_ids = list(out.prompt_token_ids)
    forced = list(out.outputs[0].token_ids)
    decode = teacher_force(gear_llm, prompt_ids, forced, "kv-dec", adaptive_gear="low")
    gear_llm.reset_prefix_cache()
    full = prompt_ids + forced
    (pre,) = gear_llm.generate(
        [{"prompt_token_ids": full}],
        SamplingParams(
            max_tokens=1,
            prompt_logprobs=0,
            extra_args={"adaptive_gear": "low", "adaptive_request_tag": "kv-pre"},
        ),
        use_tqdm=False,
    )
    p = len(prompt_ids)
    prefill = [pre.prompt_logprobs[i][full[i]].logprob for i in range(p + 1, p + len(forced))]
    assert len(prefill) == len(decode.logprobs)
    ppl_dec = math.exp(-sum(decode.logprobs) / len(decode.logprobs))
    ppl_pre = math.exp(-sum(prefill) / len(prefill))
    assert math.isclose(ppl_dec, ppl_pre, rel_tol=0.05), (ppl_dec, ppl_pre)
    tel = _telemetry(gear_llm)
    assert tel["kv-dec"]["gear_tokens"]["low"] == len(forced)
    assert tel["kv-dec"]["pinned"] == "low"


def test_token_routing_isolates_requests(gear_llm) -> None:
    """A full-precision request batched with low-gear requests decodes as it does alone."""
    alone = gear_llm.generate(PROMPTS[:1], [_params("alone", adaptive_mode="off")], use_tqdm=False)
    mixed = gear_llm.generate(
        PROMPTS,
        [
            _params("mixed-off", adaptive_mode="off"),
            _params("mixed-low1", adaptive_gear="low"),
            _params("mixed-low2", adaptive_gear="low"),
        ],
        use_tqdm=False,
    )
    a, b = alone[0].outputs[0].token_ids, mixed[0].outputs[0].token_ids
    agree = sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
    assert agree >= 0.9, agree
    tel = _telemetry(gear_llm)
    assert tel["mixed-low1"]["gear_tokens"]["low"] == 32
    assert tel["mixed-off"]["gear_tokens"]["off"] == 32


def test_resident_bytes_and_policy_report(gear_llm) -> None:
    tel = _telemetry(gear_llm)["_"]
    rb = tel["resident_bytes"]
    # the CPU int4 kernel keeps its own layout next to the packed codes (docs/precision.md)
    assert 0 < rb["int8"] < rb["full"] and 0 < rb["int4"] < rb["full"]
    assert tel["policy"]["policy"] == "gearbx" and tel["routing"] == "token"
    ratios = tel["level_byte_ratios"]
    # low: int4 decoder linears (0.5 of bf16's bytes) and the fp16 LM head (as many as bf16)
    layers, head = 30 * 576 * (960 + 576 + 3072 + 1536), 49152 * 576
    assert ratios["low"] == pytest.approx((0.25 * layers + head) / (layers + head))
    assert ratios["high"] == pytest.approx(1.0)
    assert ["fp16", "fp16", "full", "full"] in tel["layer_maps"]  # the geared LM head


def test_bad_per_request_gear_is_rejected_and_engine_keeps_serving(gear_llm) -> None:
    with pytest.raises(Exception, match="adaptive_gear"):
        gear_llm.generate(PROMPTS[:1], [_params("bad", adaptive_gear="turbo")], use_tqdm=False)
    # The offline LLM knows its engine's config too: a depth budget on a precision engine is
    # refused naming why, not logged as ignored.
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="adaptive_depth_budget=0.5 cannot be honoured"):
        gear_llm.generate(PROMPTS[:1], [_params("nodepth", adaptive_depth_budget=0.5)])
    ok = gear_llm.generate(PROMPTS[:1], [_params("after-bad", 4)], use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 4
