"""The per-draft preemption matrix (full suite): early-layer and M2R2 drafts through real
float32 engines, greedy output identical to stock vLLM with prefix-cache hits and preemption.
(The low-precision draft runs the same workload in the default tier.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import speculative as spec
from tests.support.engines import shutdown


@pytest.fixture(scope="module", params=["early", "m2r2"])
def llm(request, model_dir: Path, tmp_path_factory):
    if request.param == "early":
        draft, k = {"draft": "early", "layers": 4}, 2
    else:
        adapter = spec.random_m2r2_adapter(model_dir, tmp_path_factory.mktemp("m2r2") / "a")
        draft, k = {"draft": "m2r2", "adapter": str(adapter)}, 3
    llm = spec.spec_engine(model_dir, draft, k)
    yield llm
    shutdown(llm)


def test_greedy_identical_with_prefix_hits_and_preemption(llm, stock_f32: dict) -> None:
    moved = spec.check_identity(llm, stock_f32, ["spec_mixed", "spec_cache"])
    assert moved["preemptions"] > 0 and moved["prefix_hits"] > 0
