"""Adaptive depth on its compiled path (the engine not eager: each decoder block compiled at
vLLM's warm-up, models/compiled_blocks.py), through one real float32 engine.

Budget 1.0 must give stock vLLM's greedy text; requests below it must exit, probing on spans
(the stretches between probe layers compiled as one graph each); the KV audit
(tests/support/depth_probe.py) must see no read of a (layer, slot) never written while exits,
a capped prefix-hit prefill, chunked prefill and preemption run through compiled blocks; and
the compile must be over before the first request.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.depth_probe import audit_report, install_kv_audit
from tests.support.engines import make_llm, metric, shutdown
from tests.support.workloads import PROMPTS, run_workloads
from vllm_adaptive.introspection import depth_telemetry

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def compiled_depth_llm(model_dir: Path, depth_profile: Path):
    depth = {"profile": str(depth_profile), "budget": 1.0, "floor": {"tokens": 4}}
    llm = make_llm(model_dir, {"adaptive": {"depth": depth}}, dtype="float32", enforce_eager=False)
    llm.apply_model(install_kv_audit)
    yield llm
    shutdown(llm)


def _params(n: int, budget: float | None = None):
    from vllm import SamplingParams

    extra = {"adaptive_depth_budget": budget} if budget is not None else None
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, extra_args=extra)


def test_blocks_compile_at_warm_up_not_at_a_request(compiled_depth_llm) -> None:
    eng = compiled_depth_llm.apply_model(depth_telemetry)[0]["engine"]
    assert eng["steps"] == 0  # no request has run yet
    assert eng["block_compile_seconds"] is not None and eng["block_compile_seconds"] > 0


def test_budget_one_is_stock_text(compiled_depth_llm, stock_f32_identity: dict) -> None:
    got = run_workloads(compiled_depth_llm, ["identity"])["identity"]
    eng = compiled_depth_llm.apply_model(depth_telemetry)[0]["engine"]
    assert set(eng["exit_tokens"]) == {"30"} and eng["decode_tokens"] >= len(PROMPTS)
    # no row could exit: every step ran the stack as one graph, none block by block
    assert eng["whole_stack_steps"] == eng["steps"] and eng["peels"] == 0
    assert got["alone"] == stock_f32_identity["identity"]["alone"]


def test_exits_and_kv_audit_on_compiled_blocks(compiled_depth_llm) -> None:
    llm = compiled_depth_llm
    preempt0 = metric(llm, "vllm:num_preemptions")
    eng0 = llm.apply_model(depth_telemetry)[0]["engine"]
    words = "the of model cache layer token exit depth value key block request batch".split()
    prompts = [f"Chapter {k}. " + " ".join(words[k:] + words[:k]) for k in range(5)]
    llm.generate(prompts, [_params(330, 0.5) for _ in prompts], use_tqdm=False)
    first = llm.generate(["Write a story about a lighthouse keeper."], _params(200, 0.4))[0]
    ids = list(first.prompt_token_ids) + list(first.outputs[0].token_ids)
    llm.generate([{"prompt_token_ids": ids}], _params(16), use_tqdm=False)  # prefix hit
    eng = llm.apply_model(depth_telemetry)[0]["engine"]
    report = llm.apply_model(audit_report)[0]
    assert report["installed"] and report["reads"] > 1000
    assert report["violations"] == 0, report["first_violations"]
    assert metric(llm, "vllm:num_preemptions") > preempt0
    assert eng["peels"] > eng0["peels"]  # batches were subset mid-step
    # steps that probed ran the stretches between probe layers as one graph each
    assert eng["span_steps"] > eng0["span_steps"]
    assert eng["capped_prefills"] > eng0["capped_prefills"]
    exited = {int(k): v for k, v in eng["exit_tokens"].items() if int(k) < 30}
    assert sum(exited.values()) > 0


def _span_cuts(model) -> tuple[list[int], list[int]]:
    runtime = model.depth
    return sorted(end for _, end, _ in runtime.parts.spans), list(runtime.profile.probe_layers)


def test_an_engine_budget_cuts_the_stack_only_where_it_can_stop(
    model_dir: Path, depth_profile: Path
) -> None:
    """An EMAD engine below 1.0 compiles spans only at the probes its own thresholds can pass
    (fewer graph calls a probing step), and exits only there at its own budget; a request with
    a lower budget of its own still exits (a step whose live probes are not all span ends runs
    block by block, the path eager engines take)."""
    depth = {"profile": str(depth_profile), "budget": 0.8, "floor": {"tokens": 4}}
    llm = make_llm(model_dir, {"adaptive": {"depth": depth}}, dtype="float32", enforce_eager=False)
    try:
        ends, probes = llm.apply_model(_span_cuts)[0]
        cuts = set(ends) - {30}
        assert cuts and cuts < set(probes), (ends, probes)
        words = "the model cache layer token exit depth"
        prompts = [f"Chapter {k}. " + " ".join([words] * (k + 3)) for k in range(4)]
        llm.generate(prompts, [_params(96) for _ in prompts], use_tqdm=False)
        eng = llm.apply_model(depth_telemetry)[0]["engine"]
        assert eng["span_steps"] > 0
        exited = {int(k) for k, v in eng["exit_tokens"].items() if int(k) < 30 and v}
        assert exited and exited <= cuts, (exited, cuts)
        e0 = eng
        llm.generate(prompts, [_params(96, 0.3) for _ in prompts], use_tqdm=False)
        eng = llm.apply_model(depth_telemetry)[0]["engine"]
        early = sum(v for k, v in eng["exit_tokens"].items() if int(k) < 30)
        assert early > sum(v for k, v in e0["exit_tokens"].items() if int(k) < 30)
    finally:
        shutdown(llm)
