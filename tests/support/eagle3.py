"""One engine with vLLM's EAGLE-3 proposer over the suite's mixed speculative workload: what
the EAGLE-3 tests (default suite and slow) run before their own assertions."""

from __future__ import annotations

from pathlib import Path

from tests.support.engines import make_llm, metric, shutdown
from tests.support.workloads import run_workloads
from vllm_adaptive.introspection import draft_gears

K = 3


def eagle3_spec(head: Path) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}


def run_eagle3(model_dir: Path, adaptive: dict, head: Path) -> tuple[dict, float, dict]:
    """(greedy token ids per workload key, drafted tokens from vLLM's counter, the draft head's
    geared linears) of a float32 engine drafting with ``head``."""
    llm = make_llm(
        model_dir, {"adaptive": adaptive}, dtype="float32", speculative_config=eagle3_spec(head)
    )
    try:
        got = run_workloads(llm, ["spec_mixed"])["spec_mixed"]
        drafted = metric(llm, "vllm:spec_decode_num_draft_tokens")
        (gears,) = llm.apply_model(draft_gears)
    finally:
        shutdown(llm)
    return got, drafted, gears
