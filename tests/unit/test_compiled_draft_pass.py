"""The opaque reduced-precision linear op (kernels/weight_op.py) and the compiled draft pass
(speculative/draft_step.py): compiled in one graph (fullgraph, so a graph break fails), dynamic
in the row count, and equal to the same pass run eagerly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_adaptive.kernels.weight_op import weight_linear_op
from vllm_adaptive.kernels.weights import linear, quantize_weight
from vllm_adaptive.speculative.draft_step import compiled_draft_pass, engine_compiles

D, H = 64, 96


def _weights(precision: str) -> list:
    g = torch.Generator().manual_seed(0)
    shapes = [(H, D), (D, H)]
    return [
        quantize_weight(torch.randn(s, generator=g) * 0.05, precision, None, True) for s in shapes
    ]


@pytest.mark.parametrize("precision", ["fp16", "w8a8"])
def test_weight_op_runs_the_weights_own_kernel(precision: str) -> None:
    w = _weights(precision)[0]
    op = weight_linear_op(w)
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(1))
    assert torch.equal(op(x), linear(w, x))


@pytest.mark.parametrize("precision", ["fp16", "w8a8"])
def test_compiled_pass_equals_eager_for_one_and_several_rows(precision: str) -> None:
    up, down = (weight_linear_op(w) for w in _weights(precision))
    norm = torch.nn.RMSNorm(D, eps=1e-6)
    embed = torch.nn.Embedding(100, D)

    def forward(positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        h = embed(token_ids)
        for _ in range(3):  # the same "block" three times, as a draft runs its layers
            h = h + down(torch.nn.functional.silu(up(norm(h)))) + positions[:, None] * 1e-3
        return norm(h)

    compiled = compiled_draft_pass(forward, compile_it=True)
    assert compiled_draft_pass(forward, compile_it=False) is forward
    with torch.inference_mode():
        for rows in (1, 3, 5):  # one row is its own graph; 3 and 5 share the dynamic one
            ids = torch.arange(rows) * 7 % 100
            pos = torch.arange(rows) + 11
            assert torch.allclose(compiled(pos, ids), forward(pos, ids), atol=1e-5, rtol=1e-5)


def test_engine_compiles_follows_vllms_compilation_mode() -> None:
    from vllm.config import CompilationMode

    eager = SimpleNamespace(compilation_config=SimpleNamespace(mode=CompilationMode.NONE))
    traced = SimpleNamespace(compilation_config=SimpleNamespace(mode=CompilationMode.VLLM_COMPILE))
    assert not engine_compiles(eager) and engine_compiles(traced)
