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
from vllm_adaptive.precision.linear import ROUTE_CODES, GearedLinear
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
    assert method.route_op is not None and g.routed == {"fp16"}
    tier = g.tiers.tiers["fp16"]
    calls = []

    def spy(x):  # the Python op's fast call: counts every call that reaches Python
        calls.append(x.shape[0])
        return linear(tier, x)

    compiled = torch.compile(lambda x: method.apply(layer, x), dynamic=True, fullgraph=True)
    torch._dynamo.reset()
    with torch.inference_mode():
        g.set_uniform("fp16")
        assert int(g.uniform_routed[0]) == ROUTE_CODES["fp16"]
        g.fast = spy  # the flag stays set: the C++ op must not call it
        for m in (1, 3, 17, 40, 70):  # native and FBGEMM rows, beyond the last bucket
            x = torch.randn(m, K)
            y = compiled(x)
            assert torch.equal(y, linear(tier, x)), (m, kernel_name(tier, m, torch.float32))
        assert calls == []
        # rows that do not all run the gear (a request with adaptivity off): the Python op
        g.set_uniform("full")
        assert int(g.uniform_routed[0]) == 0
        x = torch.randn(5, K)
        assert torch.equal(compiled(x), F.linear(x, layer.weight))
        assert (compiled(x) - linear(tier, x)).abs().max() > 0  # the float weight, not fp16


def test_no_route_where_the_cpp_op_cannot_serve(needs_native) -> None:
    """A bias (the packed tiers' ops compute x W^T alone) keeps the Python op."""
    _, method = _geared(bias=True)
    assert method.route_op is None and method.geared.routed == set()


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
            y = native.geared_fp16_linear_op()(
                x,
                tier.prepared["native_fp16"],
                tier.prepared["fbgemm_fp16"],
                rows,
                g.uniform_routed,
                g.index,
                N,
            )
            native_y, fbgemm_y = kernels["native_fp16"](x), kernels["fbgemm_fp16"](x)
            assert not torch.equal(native_y, fbgemm_y)  # sums in another order: distinguishable
            assert torch.equal(y, native_y if m <= 2 else fbgemm_y), m


def _assert_cpp_route(method, precision: str, dtype, rows) -> None:
    """Under torch.compile, a step whose rows all run ``precision`` gives exactly what the
    Python op's kernel gives at each row count without entering Python (a spy on the Python
    call stays empty); a full-precision step goes to Python and runs the float weight."""
    g, layer = method.geared, method.geared.layer
    tier = g.tiers.tiers[precision]
    calls = []

    def spy(x):
        calls.append(x.shape[0])
        return linear(tier, x)

    compiled = torch.compile(lambda x: method.apply(layer, x), dynamic=True, fullgraph=True)
    torch._dynamo.reset()
    with torch.inference_mode():
        g.set_uniform(precision)
        assert int(g.uniform_routed[0]) == ROUTE_CODES[precision]
        g.fast = spy
        for m in rows:
            x = torch.randn(m, K).to(dtype)
            y = compiled(x)
            assert y.dtype == dtype
            assert torch.equal(y, linear(tier, x)), (m, kernel_name(tier, m, dtype))
        assert calls == []
        g.set_uniform("full")
        assert int(g.uniform_routed[0]) == 0
        x = torch.randn(5, K).to(dtype)
        assert torch.equal(compiled(x), F.linear(x, layer.weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_graph_runs_the_int4_gear_in_cpp(dtype) -> None:
    """The int4 gear's op (``geared_int4_linear``): on a float32 or bf16 layer, every row count
    (decode buckets, beyond them, prompt rows) gives exactly what the Python op's kernels give,
    without entering Python while the flag is set; a full-precision step goes to Python."""
    from vllm_adaptive.kernels import matmul as mm

    if native.geared_int4_linear_op() is None:
        pytest.skip(f"no native 4-bit kernel here: {native.why_unavailable()}")
    torch.manual_seed(0)
    layer = torch.nn.Linear(K, 192, bias=False).requires_grad_(False).to(dtype)
    level_map = ("int4", "int4", "int4", "full")
    tiers = LinearTiers.build(layer.weight, set(level_map), "independent", 32, False)
    tiers.prepare(dtype)
    g = GearedLinear(layer, "toy.proj", level_map, tiers, _FloatMethod(), controller=None)
    g.autotune(8)  # below FULL_MIN_ROWS: every row count on the 4-bit kernels
    assert g.full_from == {}
    method = GearedLinearMethod(g)
    assert method.use_route() and g.routed == {"int4"}
    tier = g.tiers.tiers["int4"]
    paths = {kernel_name(tier, m, dtype) for m in (1, 2, 9, 40, 300)}
    assert paths <= {mm.NATIVE_INT4, mm.INT4PACK}, paths
    if dtype == torch.float32:
        assert paths == {mm.NATIVE_INT4}  # torch's int4pack runs float32 rows 6-55x slower
    _assert_cpp_route(method, "int4", dtype, (1, 3, 17, 40, 300))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_graph_runs_the_int8_gear_in_cpp(dtype) -> None:
    """The int8 gear's op (``geared_int8_linear``, grouped int8 on the native kernel): every row
    count gives exactly what the Python op's kernel gives, without entering Python while the
    flag is set; a full-precision step goes to Python."""
    from vllm_adaptive.kernels import matmul as mm

    if native.geared_int8_linear_op() is None:
        pytest.skip(f"no native int8 kernel here: {native.why_unavailable()}")
    torch.manual_seed(0)
    layer = torch.nn.Linear(K, 200, bias=False).requires_grad_(False).to(dtype)
    level_map = ("int8", "int8", "int8", "full")
    tiers = LinearTiers.build(
        layer.weight, set(level_map), "independent", 32, True, int8_group_size=32
    )
    tiers.prepare(dtype)
    g = GearedLinear(layer, "toy.proj", level_map, tiers, _FloatMethod(), controller=None)
    g.autotune(8)
    method = GearedLinearMethod(g)
    assert method.use_route() and g.routed == {"int8"}
    tier = g.tiers.tiers["int8"]
    assert {kernel_name(tier, m, dtype) for m in (1, 9, 300)} == {mm.NATIVE_INT8}
    _assert_cpp_route(method, "int8", dtype, (1, 3, 17, 300))


def test_every_gear_of_a_gearbx_layer_stays_in_cpp() -> None:
    """A layer whose gears change from step to step (GEARBX's int4 / int8 / int8 on a bf16
    engine) registers both tiers: under torch.compile a step at either gear gives exactly its
    kernel's output with no Python call, a step that switches back is served again, and a
    mixed step (flag clear) goes to Python."""
    if native.geared_routes() is None:
        pytest.skip(f"no native kernels here: {native.why_unavailable()}")
    torch.manual_seed(0)
    layer = torch.nn.Linear(K, 192, bias=False).requires_grad_(False).to(torch.bfloat16)
    level_map = ("int4", "int8", "int8", "full")
    tiers = LinearTiers.build(
        layer.weight, set(level_map), "independent", 32, False, int8_group_size=32
    )
    tiers.prepare(torch.bfloat16)
    g = GearedLinear(layer, "toy.proj", level_map, tiers, _FloatMethod(), controller=None)
    g.autotune(8)
    method = GearedLinearMethod(g)
    assert method.use_route() and g.routed == {"int4", "int8"}  # full: not vLLM's oneDNN here
    calls = []
    compiled = torch.compile(lambda x: method.apply(layer, x), dynamic=True, fullgraph=True)
    torch._dynamo.reset()
    with torch.inference_mode():
        for precision in ("int4", "int8", "int4"):
            tier = g.tiers.tiers[precision]
            g.set_uniform(precision)
            assert int(g.uniform_routed[0]) == ROUTE_CODES[precision]
            g.fast = lambda x: calls.append(x.shape[0])  # noqa: B023 - counts Python calls
            for m in (1, 5, 9):
                x = torch.randn(m, K).to(torch.bfloat16)
                assert torch.equal(compiled(x), linear(tier, x)), (precision, m)
        assert calls == []
        g.set_uniform(None)  # rows at different gears: the Python op groups them
        assert int(g.uniform_routed[0]) == 0


def test_full_gear_runs_vllms_onednn_gemm_from_cpp() -> None:
    """The full gear of a layer whose own method is vLLM's CPU linear (oneDNN): registered with
    its handle, a full step gives exactly what vLLM's method gives, without a Python call; so do
    the prompt rows an int4 tier hands to the layer's weight."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    if native.geared_routes() is None:
        pytest.skip(f"no native kernels here: {native.why_unavailable()}")
    torch.manual_seed(0)
    layer = torch.nn.Linear(K, 960, bias=False).requires_grad_(False).to(torch.bfloat16)
    base = UnquantizedLinearMethod()
    level_map = ("int4", "int4", "int4", "full")
    tiers = LinearTiers.build(layer.weight, set(level_map), "independent", 32, False)
    tiers.prepare(torch.bfloat16)
    g = GearedLinear(layer, "toy.proj", level_map, tiers, base, controller=None)
    g.autotune(8)
    method = GearedLinearMethod(g)
    base.process_weights_after_loading(layer)  # vLLM's CPU dispatch: the oneDNN handle
    if g._onednn_handle() is None:
        pytest.skip("vLLM's CPU linear does not run oneDNN for this shape here")
    g.full_from["int4"] = 16
    assert method.use_route() and g.routed == {"int4", "full"}
    calls = []
    compiled = torch.compile(lambda x: method.apply(layer, x), dynamic=True, fullgraph=True)
    torch._dynamo.reset()
    with torch.inference_mode():
        xs = [torch.randn(m, K).to(torch.bfloat16) for m in (1, 7, 40)]
        want = [base.apply(layer, x) for x in xs]
        g.set_uniform("full")
        assert int(g.uniform_routed[0]) == ROUTE_CODES["full"]
        g.fast = lambda x: calls.append(x.shape[0])
        for x, y in zip(xs, want, strict=True):
            assert torch.equal(compiled(x), y), x.shape[0]
        g.set_uniform("int4")
        g.fast = lambda x: calls.append(x.shape[0])
        assert torch.equal(compiled(xs[2]), want[2])  # 40 rows >= full_from: the own weight
        assert not torch.equal(compiled(xs[0]), want[0])  # 1 row: the 4-bit tier
        assert calls == []


def _int4_layer(base, on_grid: bool = True) -> GearedLinear:
    """A bf16 layer with an int4 g32 asymmetric tier; ``on_grid``: its weight already lies on
    that grid (as the default model's Q4_1 checkpoint does), so the tier holds it."""
    from vllm_adaptive.kernels.packed import dequantize, quantize

    torch.manual_seed(0)
    layer = torch.nn.Linear(K, 192, bias=False).requires_grad_(False)
    if on_grid:
        grid = quantize(layer.weight, 4, 32, symmetric=False, check_double_quant=False)
        layer.weight.copy_(dequantize(grid, torch.float32))
    layer = layer.to(torch.bfloat16)
    level_map = ("int4", "int4", "int4", "full")
    tiers = LinearTiers.build(layer.weight, set(level_map), "independent", 32, False)
    tiers.prepare(torch.bfloat16)
    return GearedLinear(layer, "toy.proj", level_map, tiers, base, controller=None)


def test_rows_from_full_from_run_the_layers_own_weight() -> None:
    """Rows at or above ``full_from`` (prompts, large batches) leave the 4-bit kernels for the
    layer's own weight: from the compiled graph through the Python op, and from the Python op
    itself; fewer rows stay in C++ on the 4-bit tier."""
    if native.geared_int4_linear_op() is None:
        pytest.skip(f"no native 4-bit kernel here: {native.why_unavailable()}")
    g = _int4_layer(_FloatMethod())
    g.full_from["int4"] = 16
    method = GearedLinearMethod(g)
    assert method.use_route()
    layer, tier = g.layer, g.tiers.tiers["int4"]
    compiled = torch.compile(lambda x: method.apply(layer, x), dynamic=True, fullgraph=True)
    torch._dynamo.reset()
    with torch.inference_mode():
        g.set_uniform("int4")
        for m in (1, 15, 16, 40, 300):
            x = torch.randn(m, K).to(torch.bfloat16)
            want = F.linear(x, layer.weight) if m >= 16 else linear(tier, x)
            assert torch.equal(compiled(x), want), m
            assert torch.equal(g.run(x, "int4"), want), m


class _TimedMethod:
    """A layer's own method whose cost is set by the test: ``fast`` answers from a cache."""

    def __init__(self, fast: bool) -> None:
        self.fast = fast

    def process_weights_after_loading(self, layer) -> None:
        """As vLLM's CPU method on a bf16 layer: the weight moves into the method's own handle
        (oneDNN's packed weight) and ``layer.weight`` is emptied."""
        self.weight = layer.weight.detach().clone()
        layer.weight = torch.nn.Parameter(layer.weight.new_empty(0), requires_grad=False)

    def apply(self, layer, x, bias=None):
        if self.fast:
            return x.new_zeros(x.shape[0], self.weight.shape[0])
        import time

        time.sleep(0.05)  # slower than the 4-bit kernels at 64 rows even on a loaded CI runner
        return F.linear(x, self.weight, bias)


@pytest.mark.parametrize("fast, on_grid", [(True, True), (False, True), (True, False)])
def test_full_from_follows_the_measurement(tmp_path, monkeypatch, fast: bool, on_grid: bool):
    """``autotune`` times the layer's own weight against the packed tier from FULL_MIN_ROWS
    rows on where the tier holds that weight: a faster float weight takes those rows, a slower
    one none; a tier off the weight's grid (another model's numbers) never hands rows over."""
    from vllm_adaptive.kernels import autotune
    from vllm_adaptive.precision.linear import FULL_MIN_ROWS

    monkeypatch.setattr(autotune, "CELL_SECONDS", 0.005)
    monkeypatch.delenv("ADAPTIVE_AUTOTUNE", raising=False)
    monkeypatch.setattr(autotune, "_TABLE", autotune.DispatchTable(tmp_path / "t.json"))
    g = _int4_layer(_TimedMethod(fast), on_grid)
    g.autotune(64)
    g.base_method.process_weights_after_loading(g.layer)  # the weight leaves the layer first
    assert g.layer.weight.numel() == 0
    g.measure_full_from()
    assert g.full_from == ({"int4": FULL_MIN_ROWS} if fast and on_grid else {})


def test_a_streamed_weight_hands_rows_over_from_two(tmp_path, monkeypatch) -> None:
    """A weight too large to stay in cache (the LM head) is timed as it runs, so its own weight
    may take rows from 2 on where it measures faster there; a cache-sized one waits for
    FULL_MIN_ROWS."""
    from vllm_adaptive.kernels import autotune
    from vllm_adaptive.precision import linear as geared

    monkeypatch.setattr(autotune, "CELL_SECONDS", 0.005)
    monkeypatch.delenv("ADAPTIVE_AUTOTUNE", raising=False)
    monkeypatch.setattr(autotune, "_TABLE", autotune.DispatchTable(tmp_path / "t.json"))
    g = _int4_layer(_TimedMethod(fast=True))
    monkeypatch.setattr(geared, "STREAMED_BYTES", g.full_bytes)  # this toy layer counts as large
    g.autotune(64)
    g.base_method.process_weights_after_loading(g.layer)
    g.measure_full_from()
    assert g.full_from == {"int4": 2}
