"""The fixed fp16 gear on vLLM's compiled path (the engine not eager), through one real float32
engine: the compiled graph calls each geared linear's C++ op (`geared_fp16_linear`), which runs
the measured kernel while every row of the step runs the gear and hands mixed steps (a request
with adaptivity off beside plain ones) to the plugin's Python op."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.engines import make_llm, shutdown
from tests.support.workloads import SPEC_PROMPTS

pytestmark = pytest.mark.slow

CONFIG = {"precision": {"policy": "fixed", "gear": "fp16"}}


def geared_routes(model) -> dict[str, int]:
    """How many geared linears the compiled graph reaches through the C++ op, and how many
    have their fp16 flag set now (runs in the worker)."""
    from vllm_adaptive.models.geared_linear_method import GearedLinearMethod

    methods = [
        m.quant_method
        for m in model.modules()
        if isinstance(getattr(m, "quant_method", None), GearedLinearMethod)
    ]
    return {
        "geared": len(methods),
        "routed": sum(m.route is not None for m in methods),
        "uniform_fp16": sum(int(m.geared.uniform_fp16[0]) for m in methods),
    }


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    llm = make_llm(model_dir, {"adaptive": CONFIG}, dtype="float32", enforce_eager=False)
    yield llm
    shutdown(llm)


def _greedy(n: int, **extra):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, extra_args=extra)


def _text(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def count_python_calls(model) -> int:
    """Wrap each decoder linear's Python fast call with a counter (the flag stays set: a graph
    that reads the live flag never calls it); returns how many were wrapped."""
    from vllm_adaptive.models.geared_linear_method import GearedLinearMethod

    wrapped = 0
    for name, m in model.named_modules():
        method = getattr(m, "quant_method", None)
        if not isinstance(method, GearedLinearMethod) or name.endswith("lm_head"):
            continue
        g, fast = method.geared, method.geared.fast

        def counted(x, fast=fast, g=g):
            g.python_calls = getattr(g, "python_calls", 0) + 1
            return fast(x)

        g.fast, g.python_calls = counted, 0
        wrapped += 1
    return wrapped


def _decoder_geared(model) -> list:
    from vllm_adaptive.models.geared_linear_method import GearedLinearMethod

    return [
        m.quant_method.geared
        for name, m in model.named_modules()
        if isinstance(getattr(m, "quant_method", None), GearedLinearMethod)
        and not name.endswith("lm_head")
    ]


def python_calls(model) -> dict[str, int]:
    """Calls the counters saw, and how many counters are still in place."""
    geared = _decoder_geared(model)
    return {
        "calls": sum(getattr(g, "python_calls", 0) for g in geared),
        "counted": sum(getattr(g.fast, "__name__", "") == "counted" for g in geared),
    }


def clear_flags(model) -> int:
    """The negative control: the flags cleared by hand, the counters left in place."""
    geared = _decoder_geared(model)
    for g in geared:
        g.uniform_fp16[0] = 0
    return len(geared)


def test_every_geared_linear_takes_the_cpp_op(llm) -> None:
    first = _text(llm.generate(SPEC_PROMPTS[:2], _greedy(8), use_tqdm=False))
    routes = llm.apply_model(geared_routes)[0]
    assert routes["geared"] == 30 * 4 + 1  # qkv, o, gate_up, down per layer, and the head
    assert routes["routed"] == routes["geared"]
    assert routes["uniform_fp16"] == routes["geared"]
    # the compiled graph reads the live flag: no decoder linear enters Python while it is set
    assert llm.apply_model(count_python_calls)[0] == 30 * 4
    again = _text(llm.generate(SPEC_PROMPTS[:2], _greedy(8), use_tqdm=False))
    assert again == first
    assert llm.apply_model(python_calls)[0] == {"calls": 0, "counted": 30 * 4}
    # cleared by hand, the same graph hands every call to the Python op (the same kernels)
    assert llm.apply_model(clear_flags)[0] == 30 * 4
    cleared = _text(llm.generate(SPEC_PROMPTS[:2], _greedy(8), use_tqdm=False))
    assert cleared == first
    seen = llm.apply_model(python_calls)[0]
    assert seen["counted"] == 30 * 4 and seen["calls"] >= 30 * 4 * 8


def test_mixed_steps_fall_back_to_the_python_op(llm) -> None:
    """Step routing (the fixed gear's): a step with a request at adaptivity off runs every row
    at full precision, through the Python op; alone, each plain request runs the C++ op."""
    n = 24
    prompts = [SPEC_PROMPTS[0], SPEC_PROMPTS[2]]
    off = [
        _text(llm.generate([p], _greedy(n, adaptive_mode="off"), use_tqdm=False))[0]
        for p in prompts
    ]
    assert llm.apply_model(geared_routes)[0]["uniform_fp16"] == 0
    plain = _text(llm.generate(prompts, _greedy(n), use_tqdm=False))
    assert llm.apply_model(geared_routes)[0]["uniform_fp16"] > 0
    params = [_greedy(n), _greedy(n, adaptive_mode="off"), _greedy(n)]
    mixed = _text(llm.generate([prompts[0], prompts[0], prompts[1]], params, use_tqdm=False))
    assert mixed == [off[0], off[0], off[1]]
    assert llm.apply_model(geared_routes)[0]["uniform_fp16"] == 0
    # the gear itself: the fp16 text stays the plain requests' (C++ op) text in a batch
    again = _text(llm.generate(prompts, _greedy(n), use_tqdm=False))
    assert again == plain
