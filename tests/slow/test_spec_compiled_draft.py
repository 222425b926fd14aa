"""The W8A8 self-draft with its draft pass compiled (the engine compiles, vLLM's default): output
is stock vLLM's (compiled too, same arguments), token for token, and the compiled draft proposes
what the eager one does (acceptance near the W8A8 draft's 0.9, docs/float32-kernels.md).
Slow tier: two compiled float32 engines and the draft pass's two compilations (one row, more)."""

from __future__ import annotations

from pathlib import Path

from tests.support.engines import make_llm, metric, run_stock, shutdown, suite_engine_args
from tests.support.workloads import run_workloads
from vllm_adaptive.config import SELF_SPECULATIVE_PROPOSER

K = 3


def test_compiled_w8a8_draft_is_lossless_and_accepted(model_dir: Path, tmp_path: Path) -> None:
    args = {"enforce_eager": False}
    stock = run_stock(
        model_dir, suite_engine_args("float32", **args), ["spec_mixed"], tmp_path / "stock.json"
    )
    llm = make_llm(
        model_dir,
        {"adaptive": {"speculative": {"draft": "lowbit", "precision": "w8a8"}}},
        dtype="float32",
        speculative_config={
            "method": "custom_class",
            "model": SELF_SPECULATIVE_PROPOSER,
            "num_speculative_tokens": K,
        },
        **args,
    )
    try:
        got = run_workloads(llm, ["spec_mixed"])
        drafts = metric(llm, "vllm:spec_decode_num_draft_tokens")
        accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens")
    finally:
        shutdown(llm)
    assert got["spec_mixed"] == stock["spec_mixed"]
    assert drafts > 300
    assert 0.6 < accepted / drafts < 1.0, (accepted, drafts)
