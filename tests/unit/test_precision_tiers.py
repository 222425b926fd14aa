"""Packed tiers of one linear: what each precision keeps resident, release and restore."""

from __future__ import annotations

import pytest
import torch

from vllm_adaptive.kernels.matmul import bound_kernel, choose_path_cached, matmul
from vllm_adaptive.precision.tiers import LinearTiers


@pytest.fixture
def weight() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(256, 128)


@pytest.mark.parametrize("layout", ["independent", "matryoshka"])
def test_release_and_restore_round_trip(weight: torch.Tensor, layout: str) -> None:
    tiers = LinearTiers.build(weight, {"int8", "int4", "int2", "full"}, layout, 32, True)
    tiers.prepare(torch.bfloat16)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    before = {p: matmul(x, tiers.tiers[p]) for p in ("int8", "int4", "int2")}
    held = tiers.resident_bytes("int4")
    tiers.release("int4")
    assert tiers.resident_bytes("int4") < held
    tiers.restore("int4", torch.device("cpu"), torch.bfloat16)
    assert tiers.resident_bytes("int4") == held
    for p, y in before.items():
        assert torch.equal(matmul(x, tiers.tiers[p]), y)


def test_matryoshka_tiers_share_the_int8_storage(weight: torch.Tensor) -> None:
    m = LinearTiers.build(weight, {"int8", "int4", "int2"}, "matryoshka", 32, True)
    assert m.shared_bytes() >= weight.numel()  # int8 codes (+ scales)
    # the int8 tier is the shared storage itself: nothing of its own before kernels prepare
    assert m.resident_bytes("int8") == 0
    ind = LinearTiers.build(weight, {"int8"}, "independent", 32, True)
    assert ind.shared_bytes() == 0 and ind.resident_bytes("int8") >= weight.numel()


def test_bound_kernel_matches_checked_matmul(weight: torch.Tensor) -> None:
    tiers = LinearTiers.build(weight, {"int8", "int4"}, "independent", 32, False)
    tiers.prepare(torch.bfloat16)
    for tokens in (1, 16, 64):
        x = torch.randn(tokens, 128, dtype=torch.bfloat16)
        for p in ("int8", "int4"):
            packed = tiers.tiers[p]
            path = choose_path_cached(packed, tokens, x.dtype)
            assert torch.equal(bound_kernel(packed, path, x.dtype)(x), matmul(x, packed, path=path))


def test_controller_offloads_tiers_the_step_does_not_use(weight: torch.Tensor) -> None:
    """offload_inactive: tiers no current (or pre-warmed) level maps to are released, and a
    released tier comes back, unchanged, when a step needs it."""
    from types import SimpleNamespace

    from vllm_adaptive.config import parse_adaptive_config
    from vllm_adaptive.precision.controller import PrecisionController
    from vllm_adaptive.precision.linear import GearedLinear
    from vllm_adaptive.precision.policies import build_policy

    cfg = parse_adaptive_config(
        {"precision": {"policy": "gearbx", "offload_inactive": True}}
    ).precision
    controller = PrecisionController(cfg, build_policy(cfg, 32768), [], tokenizer_path=None)
    tiers = LinearTiers.build(weight, {"int4", "int8", "full"}, "independent", 32, True)
    tiers.prepare(torch.bfloat16)
    layer = SimpleNamespace(weight=weight, bias=None)
    geared = GearedLinear(layer, "l0", (*cfg.level_gears, "full"), tiers, None, controller)
    controller.geared = [geared]
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    y_int4 = geared.run(x, "int4")
    held = tiers.resident_bytes("int4")

    controller.offload_inactive({2})  # only high (full) in use: both packed tiers go
    assert tiers.released == {"int4", "int8"}
    assert tiers.resident_bytes("int4") < held
    assert torch.equal(geared.run(x, "int4"), y_int4)  # restored on use
    assert "int4" not in tiers.released and tiers.resident_bytes("int4") == held


def test_uniform_steps_take_the_fast_call_and_it_matches_the_grouped_path(
    weight: torch.Tensor,
) -> None:
    """A step whose rows all run one gear calls that gear's kernel straight from the op
    (``GearedLinear.fast``, set by the controller when the code changes); a token-routed step
    with mixed gears goes back to the grouped path. Both give the same output, through the op
    the compiled graph calls."""
    from types import SimpleNamespace

    import numpy as np

    from vllm_adaptive.config import parse_adaptive_config
    from vllm_adaptive.gears import HIGH, LOW
    from vllm_adaptive.precision.controller import GearStepPlan, PrecisionController
    from vllm_adaptive.precision.linear import GearedLinear
    from vllm_adaptive.precision.policies import build_policy

    cfg = parse_adaptive_config(
        {"precision": {"policy": "gearbx", "gears": ["int4", "int8", "fp16"], "routing": "token"}}
    ).precision
    controller = PrecisionController(cfg, build_policy(cfg, 32768), [], tokenizer_path=None)
    tiers = LinearTiers.build(weight, {"int4", "int8", "fp16", "full"}, "independent", 32, True)
    tiers.prepare(torch.float32)
    full = SimpleNamespace(apply=lambda layer, x, bias=None: x @ layer.weight.t())
    layer = SimpleNamespace(weight=weight, bias=None)
    geared = GearedLinear(layer, "l0", (*cfg.level_gears, "full"), tiers, full, controller)
    controller.geared = [geared]
    x = torch.randn(3, 128)

    index = geared.index

    def op(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.vllm_adaptive.geared_linear(x, index, weight.shape[0])

    for code, precision in ((LOW, "int4"), (HIGH, "fp16"), (3, "full")):
        controller.plan = GearStepPlan(1, np.array([code]), None, None, None)
        controller._set_uniform(code)
        assert geared.fast is not None
        assert torch.equal(op(x), geared.run(x, precision)), precision
    mixed = torch.tensor([LOW, HIGH, LOW])
    controller.plan = GearStepPlan(2, np.array([LOW, HIGH]), mixed, None, None)
    controller._set_uniform(None)
    assert geared.fast is None
    got = op(x)
    torch.testing.assert_close(got[1], geared.run(x[1:2], "fp16")[0])
    torch.testing.assert_close(got[[0, 2]], geared.run(x[[0, 2]], "int4"))

    import gc

    from vllm_adaptive.precision import linear as linear_mod

    assert linear_mod._LINEARS[index] is geared
    del geared, controller
    gc.collect()
    assert index not in linear_mod._LINEARS  # a finished engine's layers are not kept alive
