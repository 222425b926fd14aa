"""The fixed fp16 gear on vLLM's compiled path (the engine not eager), through one real float32
engine: the compiled graph calls each geared linear's C++ op (`geared_fp16_linear`), which runs
the measured kernel while every row of the step runs the gear and hands mixed steps (a request
with adaptivity off beside plain ones) to the plugin's Python op."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.engines import make_llm, shutdown
from tests.support.geared_routes import (
    clear_flags,
    count_python_calls,
    geared_routes,
    greedy,
    python_calls,
    token_ids,
)
from tests.support.workloads import SPEC_PROMPTS

pytestmark = pytest.mark.slow

CONFIG = {"precision": {"policy": "fixed", "gear": "fp16"}}


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    llm = make_llm(model_dir, {"adaptive": CONFIG}, dtype="float32", enforce_eager=False)
    yield llm
    shutdown(llm)


def test_every_geared_linear_takes_the_cpp_op(llm) -> None:
    first = token_ids(llm.generate(SPEC_PROMPTS[:2], greedy(8), use_tqdm=False))
    routes = llm.apply_model(geared_routes)[0]
    assert routes["geared"] == 30 * 4 + 1  # qkv, o, gate_up, down per layer, and the head
    assert routes["routed"] == routes["geared"]
    assert routes["uniform_routed"] == routes["geared"]
    # the compiled graph reads the live flag: no decoder linear enters Python while it is set
    assert llm.apply_model(count_python_calls)[0] == 30 * 4
    again = token_ids(llm.generate(SPEC_PROMPTS[:2], greedy(8), use_tqdm=False))
    assert again == first
    assert llm.apply_model(python_calls)[0] == {"calls": 0, "counted": 30 * 4}
    # cleared by hand, the same graph hands every call to the Python op (the same kernels)
    assert llm.apply_model(clear_flags)[0] == 30 * 4
    cleared = token_ids(llm.generate(SPEC_PROMPTS[:2], greedy(8), use_tqdm=False))
    assert cleared == first
    seen = llm.apply_model(python_calls)[0]
    assert seen["counted"] == 30 * 4 and seen["calls"] >= 30 * 4 * 8


def test_mixed_steps_run_the_full_gear_from_cpp(llm) -> None:
    """Step routing (the fixed gear's): a step with a request at adaptivity off runs every row
    at full precision, the decoder's linears on vLLM's own oneDNN GEMM called from the C++ op
    (their full route); alone, each plain request runs the fp16 gear's C++ op."""
    n = 24
    prompts = [SPEC_PROMPTS[0], SPEC_PROMPTS[2]]
    off = [
        token_ids(llm.generate([p], greedy(n, adaptive_mode="off"), use_tqdm=False))[0]
        for p in prompts
    ]
    routes = llm.apply_model(geared_routes)[0]
    assert routes["full_routed"] == 30 * 4  # the decoder's; the head is vLLM's embedding
    assert routes["flagged_full"] == routes["uniform_routed"] == routes["full_routed"]
    plain = token_ids(llm.generate(prompts, greedy(n), use_tqdm=False))
    routes = llm.apply_model(geared_routes)[0]
    assert routes["uniform_routed"] == routes["geared"] and routes["flagged_full"] == 0
    params = [greedy(n), greedy(n, adaptive_mode="off"), greedy(n)]
    mixed = token_ids(llm.generate([prompts[0], prompts[0], prompts[1]], params, use_tqdm=False))
    assert mixed == [off[0], off[0], off[1]]
    assert llm.apply_model(geared_routes)[0]["flagged_full"] == 30 * 4
    # the gear itself: the fp16 text stays the plain requests' (C++ op) text in a batch
    again = token_ids(llm.generate(prompts, greedy(n), use_tqdm=False))
    assert again == plain
