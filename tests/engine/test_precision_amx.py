"""Gears of a bf16 engine on vLLM's AMX int8 GEMM (GEARBX's machine default there is (w8a8,
full, full), with the LM head at its own bf16 weight; here the gears name W8A16 as the mid gear
too): every managed linear's W8A8 and W8A16 tiers run the AMX kernel on bf16 rows (no float32
round trip), and the quality order holds through a real engine: W8A16 tracks full precision
(teacher-forced along full's own greedy text), at least as well as W8A8. Only where the CPU has
AMX (elsewhere bf16 rows of these tiers run the float32 kernels, covered by
tests/unit/test_float_linear.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.engines import make_llm, shutdown
from tests.support.forcing import agreement, perplexity, teacher_force
from tests.support.workloads import SPEC_PROMPTS
from vllm_adaptive.kernels.float_linear import amx_int8_available

pytestmark = pytest.mark.skipif(
    not amx_int8_available(), reason="no AMX int8 GEMM on this CPU (vLLM's sgl kernel)"
)


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    from vllm_adaptive.bench.teacher_forcing import TeacherForcingLogitsProcessor

    config = {
        "precision": {
            "policy": "gearbx",
            "gears": ["w8a8", "w8a16", "full"],
            "routing": "token",
            "gearbx": {"calibration": "none", "cold_start": False},
        }
    }
    llm = make_llm(
        model_dir,
        {"adaptive": config},
        dtype="bfloat16",
        logits_processors=[TeacherForcingLogitsProcessor],
    )
    yield llm
    shutdown(llm)


def _greedy(n: int, **extra):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, extra_args=extra)


def test_int8_gears_run_the_amx_kernel_and_the_head_is_not_geared(llm) -> None:
    from vllm_adaptive.introspection import gear_telemetry, kernel_dispatch

    tel = llm.apply_model(gear_telemetry)[0]
    assert tel["layer_maps"] == [["w8a8", "w8a16", "full", "full"]]  # no geared head
    (info,) = llm.apply_model(kernel_dispatch)
    # 30 layers x (qkv, o, gate_up, down), both int8 tiers of each
    assert info["amx_int8_linears"] == {"w8a8": 120, "w8a16": 120}, info


def test_w8a16_tracks_full_precision_on_bf16(llm) -> None:
    outs = llm.generate(SPEC_PROMPTS[:3], _greedy(48, adaptive_mode="off"), use_tqdm=False)
    agree = {"mid": [], "low": []}
    ratio = {"mid": [], "low": []}
    for k, o in enumerate(outs):
        prompt, cont = list(o.prompt_token_ids), list(o.outputs[0].token_ids)
        full = teacher_force(llm, prompt, cont, f"full{k}", adaptive_mode="off")
        for gear in agree:
            geared = teacher_force(llm, prompt, cont, f"{gear}{k}", adaptive_gear=gear)
            agree[gear].append(agreement(geared, cont))
            ratio[gear].append(perplexity(geared) / perplexity(full))
    mid = sum(agree["mid"]) / 3
    assert mid >= 0.9, agree
    assert max(ratio["mid"]) < 1.03, ratio
    assert mid >= sum(agree["low"]) / 3, agree
    # the cheap gear is lossy, not broken: most tokens still agree
    assert sum(agree["low"]) / 3 >= 0.7, agree
