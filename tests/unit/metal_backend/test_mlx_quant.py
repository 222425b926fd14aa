"""MLX-packed tiers: the packing layout MLX's kernels read, the three grids, the geared linear.

Unit tier: random weights, no model. Runs on MLX's CPU build (skipped without mlx)."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install '.[mlx]')")
nn = pytest.importorskip("mlx.nn")

from vllm_adaptive.metal_backend.geared import OFF, GearSwitch, MlxGearedLinear  # noqa: E402
from vllm_adaptive.metal_backend.quant import (  # noqa: E402
    check_group_size,
    matryoshka_tiers,
    pack_codes,
    quantize,
    symmetric_codes,
)


def _weight(n: int = 48, k: int = 128, seed: int = 0) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array((0.05 * rng.standard_normal((n, k))).astype(np.float32))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_codes_is_the_layout_mlx_dequantizes(bits: int) -> None:
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 2**bits, size=(8, 64))
    scales = mx.array(rng.uniform(0.5, 2.0, size=(8, 2)).astype(np.float32))
    biases = mx.array(rng.uniform(-1, 1, size=(8, 2)).astype(np.float32))
    got = mx.dequantize(mx.array(pack_codes(q, bits)), scales, biases, group_size=32, bits=bits)
    want = q * np.repeat(np.array(scales), 32, 1) + np.repeat(np.array(biases), 32, 1)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64])
def test_symmetric_tier_is_gearbx_absmax_grid(bits: int, group: int) -> None:
    w = _weight()
    tier = quantize(w, bits, group, "symmetric")
    codes, scale = symmetric_codes(w, bits, group)
    qmax = 2 ** (bits - 1) - 1
    assert codes.min() >= -qmax and codes.max() <= qmax  # int2: ternary
    want = (codes * scale).reshape(w.shape)
    np.testing.assert_allclose(np.array(tier.dequantize()), want, rtol=1e-6, atol=1e-7)
    # the packed matmul is x @ dequantized^T
    x = mx.array(np.random.default_rng(1).standard_normal((3, w.shape[1])).astype(np.float32))
    np.testing.assert_allclose(np.array(tier.matmul(x)), np.array(x) @ want.T, rtol=1e-4, atol=1e-5)


def test_affine_tier_is_mx_quantize() -> None:
    w = _weight()
    tier = quantize(w, 4, 32, "affine")
    wq, s, b = mx.quantize(w, group_size=32, bits=4)
    assert np.array_equal(np.array(tier.wq), np.array(wq))
    assert np.array_equal(np.array(tier.scales), np.array(s))
    groups = np.array(w).reshape(w.shape[0], -1, 32)
    step = (groups.max(-1) - groups.min(-1)).max() / 15  # one level of the coarsest group
    assert np.abs(np.array(tier.dequantize()) - np.array(w)).max() <= step


def test_matryoshka_tiers_are_the_msbs_of_one_int8_code() -> None:
    w = _weight()
    tiers = matryoshka_tiers(w, 32, (8, 4, 2))
    c8, s = symmetric_codes(w, 8, 32)
    for r, tier in tiers.items():
        c = c8 >> (8 - r)
        want = s * 2 ** (8 - r) * c + (s * 2 ** (7 - r) if r < 8 else 0.0)
        np.testing.assert_allclose(
            np.array(tier.dequantize()), want.reshape(w.shape), rtol=1e-6, atol=1e-7
        )
    assert np.array_equal(c8 >> 6, (c8 >> 4) >> 2)  # the tiers nest
    # coarser tiers are coarser approximations of the same weight
    errs = [np.abs(np.array(tiers[r].dequantize()) - np.array(w)).mean() for r in (8, 4, 2)]
    assert errs[0] < errs[1] < errs[2]


def test_group_sizes_mlx_cannot_run_name_the_key() -> None:
    assert check_group_size(64, 576, "adaptive.precision.group_size") == 64
    with pytest.raises(ValueError, match="adaptive.precision.group_size: 256"):
        check_group_size(256, 1024, "adaptive.precision.group_size")
    with pytest.raises(ValueError, match="adaptive.speculative.group_size: 128 does not divide"):
        check_group_size(128, 576, "adaptive.speculative.group_size")


def test_geared_linear_runs_the_precision_of_the_switch_code() -> None:
    lin = nn.Linear(128, 48, bias=True)
    tiers = {
        "int4": quantize(lin.weight, 4, 32, "symmetric"),
        "int8": quantize(lin.weight, 8, 32, "symmetric"),
    }
    switch = GearSwitch()
    g = MlxGearedLinear(lin, ("int4", "int8", "full"), tiers, switch)
    assert g.precisions == ("int4", "int8", "full", "full")
    x = mx.array(np.random.default_rng(2).standard_normal((2, 128)).astype(np.float32))
    for code, want in ((0, tiers["int4"]), (1, tiers["int8"])):
        switch.code = code
        np.testing.assert_allclose(
            np.array(g(x)), np.array(want.matmul(x) + lin.bias), rtol=1e-5, atol=1e-6
        )
    for code in (2, OFF):
        switch.code = code
        assert np.array_equal(np.array(g(x)), np.array(lin(x)))
    with pytest.raises(ValueError, match="no packed tier"):
        MlxGearedLinear(lin, ("int2", "int8", "full"), tiers, switch)
