"""The int4 gear on the checkpoint's grid, with the LM head on the int8 gear (the checkpoint's
Q8_0 grid), on vLLM's compiled path, through one real bf16 engine: every decoder linear's
compiled call goes to the C++ op `geared_int4_linear` (torch's int4pack kernel or the plugin's
native one per row count, as measured at engine start) without entering Python, the head runs
grouped int8 codes that give its weight back exactly, the same text comes out when the calls go
through the Python op instead, and teacher-forced along stock bf16's greedy tokens the gear
agrees with them (prompt rows run the float weight where it is measured faster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.engines import make_llm, shutdown
from tests.support.forcing import agreement, perplexity, teacher_force
from tests.support.geared_routes import (
    clear_flags,
    count_python_calls,
    geared_routes,
    greedy,
    head_tier,
    python_calls,
    token_ids,
)
from tests.support.workloads import PROMPTS, SPEC_PROMPTS

pytestmark = pytest.mark.slow

CONFIG = {
    "precision": {
        "policy": "fixed",
        "gear": "int4",
        "symmetric": False,
        "head_gears": ["int8", "int8", "int8"],
    }
}
DECODER = 30 * 4  # qkv, o, gate_up, down per layer


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    from vllm_adaptive.kernels import native

    if native.geared_int4_linear_op() is None:
        pytest.skip(f"no native 4-bit kernel here: {native.why_unavailable()}")
    from vllm_adaptive.bench.teacher_forcing import TeacherForcingLogitsProcessor

    llm = make_llm(
        model_dir,
        {"adaptive": CONFIG},
        dtype="bfloat16",
        enforce_eager=False,
        logits_processors=[TeacherForcingLogitsProcessor],
    )
    yield llm
    shutdown(llm)


def test_every_decoder_linear_takes_the_int4_cpp_op(llm) -> None:
    first = token_ids(llm.generate(SPEC_PROMPTS[:2], greedy(8), use_tqdm=False))
    routes = llm.apply_model(geared_routes)[0]
    assert routes["routed"] == DECODER + 1, routes  # and the head's int8 op
    assert routes["uniform_routed"] == DECODER + 1
    assert llm.apply_model(head_tier)[0] == {
        "group_size": 32,
        "scale_dtype": "torch.float16",
        "exact": True,
    }
    assert llm.apply_model(count_python_calls)[0] == DECODER
    again = token_ids(llm.generate(SPEC_PROMPTS[:2], greedy(8), use_tqdm=False))
    assert again == first
    assert llm.apply_model(python_calls)[0] == {"calls": 0, "counted": DECODER}
    assert llm.apply_model(clear_flags)[0] == DECODER
    cleared = token_ids(llm.generate(SPEC_PROMPTS[:2], greedy(8), use_tqdm=False))
    assert cleared == first
    assert llm.apply_model(python_calls)[0]["calls"] >= DECODER * 8


def test_gear_agrees_with_stock_bf16_teacher_forced(llm, stock_bf16: dict) -> None:
    """Along stock bf16's own greedy tokens, the gear's next-token argmax and perplexity
    against the same engine at full precision (free-running bf16 text drifts apart after a
    first near-tie, as bf16 runs of different shapes do)."""
    llm.reset_prefix_cache()
    agree, ratio = [], []
    for i, (prompt, stock) in enumerate(zip(PROMPTS, stock_bf16["identity"]["alone"], strict=True)):
        ids = list(llm.generate([prompt], greedy(1), use_tqdm=False)[0].prompt_token_ids)
        geared = teacher_force(llm, ids, stock, f"int4-bf16-{i}")
        full = teacher_force(llm, ids, stock, f"full-bf16-{i}", adaptive_mode="off")
        agree.append(agreement(geared, stock))
        ratio.append(perplexity(geared) / perplexity(full))
    assert sum(agree) / len(agree) >= 0.95, agree
    assert sum(ratio) / len(ratio) < 1.03, ratio
