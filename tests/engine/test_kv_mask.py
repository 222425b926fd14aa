"""KV strategy ``mask`` with EMAD exits (QuickSilver KV skipping, D-LLM): skipped layers write no
K/V and attention leaves those slots out. The audit poisons every cached (layer, slot) its shadow
says was never written with NaN for one attention call; a masked slot that contributed would make
the output non-finite. Negative control: the same poison with the mask withheld from the backend.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import kv_strategies as kv
from tests.support.depth_probe import install_mask_audit
from tests.support.engines import shutdown


@pytest.fixture(scope="module")
def llm(model_dir: Path, depth_profile: Path):
    from tests.support.engines import amx_bf16_attention

    if amx_bf16_attention():
        pytest.skip(
            "bf16 attention on this AMX CPU packs K in vLLM's 'amx' layout, which the masked "
            "backend refuses by name at engine start (masked_backend._isa_error); the suite's "
            "engines and stock reference are bf16"
        )
    depth = {"profile": str(depth_profile), "budget": 0.5, "floor": {"tokens": 4}}
    llm = kv.engine(model_dir, depth | {"kv_strategy": "mask"}, install_mask_audit)
    yield llm
    shutdown(llm)


def test_exits_off_is_stock(llm, stock_bf16: dict) -> None:
    kv.check_exits_off_is_stock(llm, stock_bf16)


@pytest.mark.slow  # the full suite: 265 s on an AVX2 EPYC; tests/engine/test_depth_engine.py
# runs the same audit workload in the default tier
def test_masked_slots_never_contribute(llm) -> None:
    moved = kv.workload(llm, 1, "mask")
    kv.check_masked_slots_never_contribute(llm, moved, 30)


def test_mask_withheld_reads_poisoned_slots(llm) -> None:
    """Negative control: the poison is real, only the mask keeps it out."""
    kv.check_mask_withheld_reads_poison(llm, ["The history of the printing press"], kv.params(64))
