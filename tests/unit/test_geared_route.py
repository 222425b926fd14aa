"""The fp16 gear's linear as a compiled graph calls it (`GearedLinearMethod.apply` under
torch.compile): the C++ op `vllm_adaptive_native::geared_fp16_linear` runs the measured kernel
for the row count without a Python frame while every row runs the fp16 gear, and hands the call
to the plugin's Python op otherwise (full precision here, as a request with adaptivity off)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_adaptive.kernels import native
from vllm_adaptive.kernels.weights import kernel_name, linear
from vllm_adaptive.models.geared_linear_method import GearedLinearMethod
from vllm_adaptive.precision.linear import GearedLinear
from vllm_adaptive.precision.tiers import LinearTiers

N, K = 200, 576  # output columns that are not a whole block of 32; the model's width


class _FloatMethod:
    """A linear layer's own method (the full gear): the float weight."""

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)


def _geared(bias: bool = False) -> tuple[torch.nn.Linear, GearedLinearMethod]:
    torch.manual_seed(0)
    layer = torch.nn.Linear(K, N, bias=bias).requires_grad_(False)
    level_map = ("fp16", "fp16", "fp16", "full")
    tiers = LinearTiers.build(layer.weight, set(level_map), "independent", None, True)
    tiers.prepare(layer.weight.dtype)
    g = GearedLinear(layer, "toy.proj", level_map, tiers, _FloatMethod(), controller=None)
    g.autotune(64)
    method = GearedLinearMethod(g)
    method.use_route()
    return layer, method


@pytest.fixture(scope="module")
def needs_native() -> None:
    if native.geared_fp16_linear_op() is None:
        pytest.skip(f"no native fp16 kernel here: {native.why_unavailable()}")


def test_compiled_graph_runs_the_fp16_gear_in_cpp_and_falls_back_to_python(needs_native) -> None:
    layer, method = _geared()
    g = method.geared
    assert method.route is not None
    tier = g.tiers.tiers["fp16"]
    calls = []

    def spy(x):  # the Python op's fast call: counts every call that reaches Python
        calls.append(x.shape[0])
        return linear(tier, x)

    compiled = torch.compile(lambda x: method.apply(layer, x), dynamic=True, fullgraph=True)
    torch._dynamo.reset()
    with torch.inference_mode():
        g.set_uniform("fp16")
        assert int(g.uniform_fp16[0]) == 1
        g.fast = spy  # the flag stays set: the C++ op must not call it
        for m in (1, 3, 17, 40, 70):  # native and FBGEMM rows, beyond the last bucket
            x = torch.randn(m, K)
            y = compiled(x)
            assert torch.equal(y, linear(tier, x)), (m, kernel_name(tier, m, torch.float32))
        assert calls == []
        # rows that do not all run the gear (a request with adaptivity off): the Python op
        g.set_uniform("full")
        assert int(g.uniform_fp16[0]) == 0
        x = torch.randn(5, K)
        assert torch.equal(compiled(x), F.linear(x, layer.weight))
        assert (compiled(x) - linear(tier, x)).abs().max() > 0  # the float weight, not fp16


def test_no_route_where_the_cpp_op_cannot_serve(needs_native) -> None:
    """A bias (the op computes x W^T alone) keeps the Python op."""
    _, method = _geared(bias=True)
    assert method.route is None and method.route_op is None


def test_cpp_op_follows_its_row_table_to_either_kernel(needs_native) -> None:
    """The op runs the kernel the flattened dispatch table names for the row count (the last
    entry beyond it): here native for up to 2 rows, FBGEMM's from 3."""
    from vllm_adaptive.kernels.float_linear import fbgemm_available

    if not fbgemm_available():
        pytest.skip("no FBGEMM in this torch")
    _, method = _geared()
    g = method.geared
    tier = g.tiers.tiers["fp16"]
    for name in ("native_fp16", "fbgemm_fp16"):
        tier.prepare(name)
    kernels = {name: tier.bind(name) for name in ("native_fp16", "fbgemm_fp16")}
    rows = torch.tensor([1, 1, 1, 0], dtype=torch.uint8)
    g.set_uniform("fp16")
    with torch.inference_mode():
        for m in (1, 2, 3, 9):
            x = torch.randn(m, K)
            y = method.route_op(
                x,
                tier.prepared["native_fp16"],
                tier.prepared["fbgemm_fp16"],
                rows,
                g.uniform_fp16,
                g.index,
                N,
            )
            native_y, fbgemm_y = kernels["native_fp16"](x), kernels["fbgemm_fp16"](x)
            assert not torch.equal(native_y, fbgemm_y)  # sums in another order: distinguishable
            assert torch.equal(y, native_y if m <= 2 else fbgemm_y), m
