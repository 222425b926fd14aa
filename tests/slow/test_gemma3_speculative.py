"""The "early" self-draft on Gemma 3 (vLLM's hybrid KV cache manager off, so one KV cache group):
output is stock vLLM's, token for token, and drafts are proposed and verified. Slow tier: two
float32 engines; on Gemma 3 the early layers' logit lens almost never agrees with the output
(docs/models.md), so acceptance is near zero and this draft is a correctness check, not a
speed-up."""

from __future__ import annotations

from pathlib import Path

from tests.support.engines import (
    GEMMA3_NUM_BLOCKS,
    make_llm,
    metric,
    run_stock,
    shutdown,
    suite_engine_args,
)
from tests.support.workloads import run_workloads

ARGS = {"num_gpu_blocks_override": GEMMA3_NUM_BLOCKS, "disable_hybrid_kv_cache_manager": True}
SPEC = {
    "method": "custom_class",
    "model": "vllm_adaptive.speculative.proposer.SelfSpeculativeProposer",
    "num_speculative_tokens": 2,
}


def test_early_draft_is_lossless_on_gemma3(gemma_dir: Path, tmp_path: Path) -> None:
    stock = run_stock(
        gemma_dir, suite_engine_args("float32", **ARGS), ["spec_mixed"], tmp_path / "stock.json"
    )
    llm = make_llm(
        gemma_dir,
        {"adaptive": {"speculative": {"draft": "early", "layers": 4}}},
        dtype="float32",
        speculative_config=SPEC,
        **ARGS,
    )
    try:
        got = run_workloads(llm, ["spec_mixed"])
        drafts = metric(llm, "vllm:spec_decode_num_draft_tokens")
        accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens")
    finally:
        shutdown(llm)
    assert got["spec_mixed"] == stock["spec_mixed"]
    assert drafts > 0 and 0 <= accepted <= drafts
