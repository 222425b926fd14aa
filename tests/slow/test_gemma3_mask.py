"""KV strategy ``mask`` on Gemma 3 270M through one real vLLM engine: exited tokens write no K/V
at the layers they skip and the masked backend leaves those slots out, on the sliding-window
layers (the kernel applies each layer's window as vLLM's op does) as on the global ones.

The audit poisons every cached (layer, slot) its shadow says was never written with NaN for one
attention call; a masked slot that contributed would make the output non-finite. Negative
control: the same poison with the mask withheld from the backend. With the engine's budget 1.0
the output is stock vLLM's token for token.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import kv_strategies as kv
from tests.support.depth_probe import install_mask_audit
from tests.support.engines import NUM_BLOCKS, make_llm, shutdown
from tests.support.workloads import PROMPTS, _ids, _params

NUM_LAYERS = 18


@pytest.fixture(scope="module")
def gemma_mask_llm(gemma_dir: Path, gemma_depth_profile: Path):
    from tests.support.engines import amx_bf16_attention

    if amx_bf16_attention():
        pytest.skip(
            "bf16 attention on this AMX CPU packs K in vLLM's 'amx' layout, which the masked "
            "backend refuses by name at engine start; the suite's engines are bf16"
        )
    depth = {
        "profile": str(gemma_depth_profile),
        "budget": 0.5,
        "floor": {"tokens": 4},
        "kv_strategy": "mask",
    }
    llm = make_llm(
        gemma_dir,
        {"adaptive": {"depth": depth}},
        num_gpu_blocks_override=NUM_BLOCKS,
        disable_hybrid_kv_cache_manager=True,
    )
    llm.apply_model(install_mask_audit)
    yield llm
    shutdown(llm)


def _local_windows(model) -> list[int]:
    return [layer.attn.impl.sliding_window for layer in model.adaptive_parts().layers]


def test_budget_one_is_token_identical_to_stock(gemma_mask_llm, stock_gemma_bf16: dict) -> None:
    windows = gemma_mask_llm.apply_model(_local_windows)[0]
    assert -1 in windows and any(w > 0 for w in windows)  # local and global layers both masked
    gemma_mask_llm.reset_prefix_cache()
    exits_off = _params(None, {"adaptive_depth_budget": 1.0})  # the engine's budget is 0.5
    alone = [_ids(gemma_mask_llm.generate([p], exits_off, use_tqdm=False))[0] for p in PROMPTS]
    assert alone == stock_gemma_bf16["identity"]["alone"]


def test_masked_slots_never_contribute(gemma_mask_llm) -> None:
    moved = kv.workload(gemma_mask_llm, 2, "g-mask")
    kv.check_masked_slots_never_contribute(gemma_mask_llm, moved, NUM_LAYERS)


def test_mask_withheld_reads_poisoned_slots(gemma_mask_llm) -> None:
    """Negative control: the poison is real, only the mask keeps it out."""
    prompts = ["def quicksort(items):\n    ", "The history of the printing press"]
    kv.check_mask_withheld_reads_poison(gemma_mask_llm, prompts, kv.params(96, 0.4))
