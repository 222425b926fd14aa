"""vLLM's EAGLE-3 proposer with its head on the plugin's gears: on the fixed fp16 gear
(`scripts/serve.sh`'s float32 target) the head's linears run the same fp16 gear, and with
``adaptive.draft_head`` on a stock-precision target they run int8 (half / a quarter of the bytes
a draft step reads); vLLM drafts with the geared head, and greedy output stays identical to
stock vLLM float32. An untrained head (``eagle3_head.random_head``) is enough: what is checked
is the mechanism, not acceptance."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.eagle3 import run_eagle3
from vllm_adaptive.speculative.eagle3_head import random_head

FP16 = {"precision": {"policy": "fixed", "gear": "fp16"}}
INT8_HEAD = {"draft_head": {"gear": "int8"}}  # the target at stock's precision


@pytest.fixture(scope="module")
def head(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_head(tmp_path_factory.mktemp("eagle3") / "head", model_dir)


@pytest.mark.parametrize(
    ("adaptive", "gear"),
    [(FP16, "fp16"), (INT8_HEAD, "int8")],
    ids=["fp16-target", "int8-head"],
)
def test_geared_draft_head_drafts_and_output_identical_to_stock(
    model_dir: Path, head: Path, stock_f32: dict, adaptive: dict, gear: str
) -> None:
    got, drafted, gears = run_eagle3(model_dir, adaptive, head)
    assert drafted > 100, drafted  # vLLM's EAGLE-3 proposer really ran
    assert gears["precisions"] == [gear], gears
    ends = {name.rsplit(".", 1)[-1] for name in gears["linears"]}
    assert ends == {"fc", "qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    for key, seqs in got.items():
        assert seqs == stock_f32["spec_mixed"][key], key
