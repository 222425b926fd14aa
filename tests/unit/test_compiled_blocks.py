"""Decoder blocks compiled one at a time and as one stack (models/compiled_blocks.py), on
blocks shaped like vLLM's: ``block(positions, hidden, residual) -> (hidden, residual)``, a
first block without a residual, per-head views (which make the many-token graph exclude one
token) and a constant of each block's own (as vLLM's attention layer name is) that a shared
graph would get wrong."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm_adaptive.models.compiled_blocks import CompiledSpan

HIDDEN, HEADS = 32, 4


class ToyBlock(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index  # a per-layer constant the graph bakes in
        self.norm = nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)
        self.mlp = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = hidden
        else:
            residual = hidden + residual
        x = self.norm(residual)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        n = x.shape[0]
        q = q.view(n, HEADS, -1) * torch.cos(positions.float())[:, None, None]
        att = (q * k.view(n, HEADS, -1)).sum(-1, keepdim=True) * v.view(n, HEADS, -1)
        h = self.out(att.reshape(n, HIDDEN)) * (self.index + 1)
        return self.mlp(torch.relu(h)), residual


def _inputs(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.arange(n) + 7, torch.randn(n, HIDDEN, generator=g)


def _run(blocks, positions, hidden):
    residual = None
    for b in blocks:
        hidden, residual = b(positions, hidden, residual)
    return hidden, residual


def test_compiled_blocks_match_eager_at_every_token_count_without_recompiling() -> None:
    torch.manual_seed(0)
    eager = [ToyBlock(i).eval() for i in range(3)]
    compiled = [CompiledSpan((b,), f"toy_block_{i}") for i, b in enumerate(eager)]
    with torch.inference_mode():
        pos, h = _inputs(9, 0)
        residual = None
        for c in compiled:  # the warm-up: many tokens, then one
            h, residual = c.warm_up(pos, h, residual)
        assert all(c.compile_seconds is not None and c.compile_seconds > 0 for c in compiled)
        assert all(c.direct for c in compiled)
        frames = torch._dynamo.utils.counters["frames"]["ok"]
        for n in (1, 2, 5, 33, 1):
            pos, h = _inputs(n, n)
            want = _run(eager, pos, h)
            got = _run(compiled, pos, h)
            torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
        # every call after the warm-up ran the captured bytecode: dynamo traced nothing new
        assert torch._dynamo.utils.counters["frames"]["ok"] == frames


def test_blocks_of_one_class_keep_graphs_of_their_own() -> None:
    """Guards are dropped, so a graph shared between layers would silently run the first
    layer's constant in the second: each block's output must follow its own ``index``."""
    torch.manual_seed(1)
    a, b = ToyBlock(0).eval(), ToyBlock(5).eval()
    b.load_state_dict(a.state_dict())  # same weights: only the constant differs
    ca, cb = CompiledSpan((a,), "toy_same_0"), CompiledSpan((b,), "toy_same_5")
    with torch.inference_mode():
        pos, h = _inputs(4, 3)
        ya, _ = ca.warm_up(pos, h, None)
        yb, _ = cb.warm_up(pos, h, None)
        torch.testing.assert_close(yb, b(pos, h, None)[0], rtol=1e-4, atol=1e-5)
        assert not torch.allclose(ya, yb)


def test_two_engines_blocks_of_one_name_keep_their_own_graphs() -> None:
    """Two engines in one process name their blocks alike; each must still run its own."""
    torch.manual_seed(2)
    a, b = ToyBlock(1).eval(), ToyBlock(2).eval()
    ca, cb = CompiledSpan((a,), "toy_twin"), CompiledSpan((b,), "toy_twin")
    with torch.inference_mode():
        pos, h = _inputs(3, 4)
        ca.warm_up(pos, h, None)  # the first engine compiles first
        cb.warm_up(pos, h, None)
        assert ca.direct and cb.direct
        for n in (1, 6):
            pos, h = _inputs(n, n + 10)
            torch.testing.assert_close(
                ca(pos, h, None)[0], a(pos, h, None)[0], rtol=1e-4, atol=1e-5
            )
            torch.testing.assert_close(
                cb(pos, h, None)[0], b(pos, h, None)[0], rtol=1e-4, atol=1e-5
            )


def test_a_span_of_blocks_is_one_graph_equal_to_its_blocks_run_eagerly() -> None:
    """The whole stack as one graph (steps with nothing to decide between blocks): the same
    output as the blocks one by one at every token count, with each block's own constant."""
    torch.manual_seed(3)
    eager = [ToyBlock(i).eval() for i in range(4)]
    stack = CompiledSpan(eager, "toy_stack")
    with torch.inference_mode():
        pos, h = _inputs(7, 5)
        stack.warm_up(pos, h, None)
        assert stack.direct and stack.compile_seconds is not None
        frames = torch._dynamo.utils.counters["frames"]["ok"]
        for n in (1, 3, 17):
            pos, h = _inputs(n, n + 20)
            want = _run(eager, pos, h)
            got = stack(pos, h, None)
            torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
        assert torch._dynamo.utils.counters["frames"]["ok"] == frames
        # a stack that dropped or repeated a block would not match (the check can fail)
        short = _run(eager[:3], pos, h)
        assert not torch.allclose(stack(pos, h, None)[0], short[0])


def test_spans_cut_the_stack_after_each_probe_layer() -> None:
    """Steps that probe run the stack in spans cut after the probe layers: consecutive, covering
    every block once, and chained they give the blocks' output (the last span's residual
    included); cuts outside the stack are dropped."""
    from vllm_adaptive.models.compiled_blocks import with_compiled_spans

    torch.manual_seed(4)
    eager = [ToyBlock(i).eval() for i in range(5)]
    layers = tuple(
        _Layer(block=b, compiled=CompiledSpan((b,), f"toy_cut_{i}")) for i, b in enumerate(eager)
    )
    parts = with_compiled_spans(_Parts(layers=layers), cuts=(2, 0, 4, 5, 2))
    assert [(a, b) for a, b, _ in parts.spans] == [(0, 2), (2, 4), (4, 5)]
    assert all(layer.compiled is None for layer in parts.layers)  # the spans replace them
    with torch.inference_mode():
        pos, h = _inputs(6, 7)
        r = None
        for _, _, span in parts.spans:  # the warm-up
            h, r = span.warm_up(pos, h, r)
        for n in (1, 4):
            pos, h = _inputs(n, n + 30)
            want = _run(eager, pos, h)
            got, r = h, None
            for _, b, span in parts.spans:
                got, r = span(pos, got, r)
                torch.testing.assert_close(got, _run(eager[:b], pos, h)[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(r, want[1], rtol=1e-4, atol=1e-5)


@dataclass(frozen=True)
class _Layer:
    block: nn.Module
    compiled: CompiledSpan | None = None


@dataclass(frozen=True)
class _Parts:
    layers: tuple
    spans: tuple = ()
