"""The int4 group-32 asymmetric gear through a real float32 engine, on the plugin's native
4-bit kernel.

The default model's decoder weights come from a Q4_1 GGUF, whose grid this gear reproduces (the
plugin detects the grid and quantizes asymmetrically unless told otherwise): on
held-out text it kept teacher-forced agreement 0.995 with stock float32 and 64 free-running
tokens identical (docs/precision.md). Here: decode rows take ``native_int4`` wherever the C++
kernels build (prompt rows too, or the layer's float weight where it measured faster at those
rows), and the gear follows stock float32's own greedy text. (The grid
is what makes it close: on a real layer the asymmetric g32 grid leaves 0.14% relative error and
a symmetric one over 5%, tests/unit/test_packed.py; W8A16's per-row int8 kept 0.23 of 64
free-running tokens on held-out text.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.engines import make_llm, shutdown
from tests.support.forcing import agreement, perplexity, teacher_force
from tests.support.workloads import SPEC_PROMPTS


def _config() -> dict:
    """The gear as a user types it: no "symmetric" key, so the plugin picks the checkpoint's
    own (asymmetric) grid, which it detects (``models/precision.resolve_symmetric``)."""
    return {"precision": {"policy": "fixed", "gear": "int4"}}


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    from vllm_adaptive.bench.teacher_forcing import TeacherForcingLogitsProcessor

    llm = make_llm(
        model_dir,
        {"adaptive": _config()},
        dtype="float32",
        logits_processors=[TeacherForcingLogitsProcessor],
    )
    yield llm
    shutdown(llm)


def _greedy(n: int, **extra):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, extra_args=extra)


def test_decode_rows_run_the_native_4bit_kernel(llm) -> None:
    from vllm_adaptive.environment import cpu_flags
    from vllm_adaptive.introspection import kernel_dispatch

    (info,) = llm.apply_model(kernel_dispatch)
    paths = info["packed_paths"]["int4"]
    built = shutil.which("c++") is not None and {"avx2", "fma"} <= cpu_flags()
    want = ["native_int4"] if built else ["dequant_f32"]
    assert paths["1"] == want, paths
    assert set(paths["256"]) <= {*want, "full"}, paths  # full: measured faster at those rows
    if built:  # measured against dequant_f32 on this machine up to 64 rows
        assert any(k.startswith("int4-g32-asymmetric:") for k in info["dispatch"]), info


def test_gear_follows_stock_float32_greedy_text(llm, stock_f32: dict) -> None:
    """Free-running, each prompt alone, against stock float32's own greedy tokens; teacher-
    forced along them, agreement and perplexity against the same engine at full precision."""
    llm.reset_prefix_cache()
    same, agree, ratio = [], [], []
    for i, prompt in enumerate(SPEC_PROMPTS):
        stock = stock_f32["spec_mixed"]["alone"][i]
        out = llm.generate([prompt], _greedy(len(stock)), use_tqdm=False)[0]
        got = list(out.outputs[0].token_ids)
        same.append(sum(a == b for a, b in zip(got, stock, strict=True)) / len(stock))
        ids = list(out.prompt_token_ids)
        geared = teacher_force(llm, ids, stock, f"int4-{i}")
        full = teacher_force(llm, ids, stock, f"full-{i}", adaptive_mode="off")
        agree.append(agreement(geared, stock))
        ratio.append(perplexity(geared) / perplexity(full))
    assert sum(same) / len(same) >= 0.9, same
    assert sum(agree) / len(agree) >= 0.97, agree
    assert max(ratio) < 1.02, ratio
