"""Packed weight formats, Matryoshka tiers and the matmul dispatcher (fast, no engine)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vllm_adaptive.environment import cpu_flags
from vllm_adaptive.kernels import matmul as mm
from vllm_adaptive.kernels import native
from vllm_adaptive.kernels.matryoshka import (
    MatryoshkaWeight,
    matryoshka_quantize,
    quantize_on_tier_grid,
    slice_codes,
)
from vllm_adaptive.kernels.packed import (
    DoubleQuantizationWarning,
    PackedWeight,
    coarse_grid_fraction,
    code_range,
    dequantize,
    pack_codes,
    quantize,
    storage_range,
    unpack_codes,
)

CKPT = Path.home() / ".cache/vllm-adaptive/models/smollm2-135m-instruct/model.safetensors"
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
GROUPS = (None, 32, 64, 128)


def _weight(n: int = 48, k: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


def _q4_1_grid_weight(n: int = 32, k: int = 256, seed: int = 1) -> torch.Tensor:
    """A weight on a Q4_1-like grid: per 32-block, min + d * q with q in 0..15."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0.0, 15.0  # Q4_1 maps each block's min and max to 0 and 15
    d = torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3
    m = -8 * d + torch.randn(n, k // 32, 1, generator=g) * 1e-3
    return (m + d * q).reshape(n, k)


def _expected_codes(w: torch.Tensor, p: PackedWeight) -> torch.Tensor:
    """Codes recomputed independently from the stored scales (and offsets)."""
    g = p.group_len
    s = p.scales.float().repeat_interleave(g, dim=1)
    lo, hi = code_range(p.bits, symmetric=p.symmetric)
    if p.symmetric:
        return torch.round(w / s).clamp(lo, hi).to(torch.int8)
    o = p.offsets.float().repeat_interleave(g, dim=1)
    return torch.round((w - o) / s).clamp(lo, hi).to(torch.int8)


# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------


def test_int4_nibble_layout_is_low_first_with_offset_8():
    codes = torch.tensor([[1, -2, -8, 7]], dtype=torch.int8)
    data = pack_codes(codes, 4)
    # element 0 -> low nibble (1+8=9), element 1 -> high nibble (-2+8=6)
    assert data.tolist() == [[0x69, 0xF0]]
    assert torch.equal(unpack_codes(data, 4, 4), codes)


def test_int2_layout_is_four_fields_low_first_with_offset_2():
    codes = torch.tensor([[-2, -1, 0, 1, 1, 1, -2, 0]], dtype=torch.int8)
    data = pack_codes(codes, 2)
    assert data.tolist() == [[0b11_10_01_00, 0b10_00_11_11]]
    assert torch.equal(unpack_codes(data, 2, 8), codes)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_pack_unpack_full_storage_range(bits):
    lo, hi = storage_range(bits)
    codes = torch.randint(lo, hi + 1, (16, 64), dtype=torch.int8)
    data = pack_codes(codes, bits)
    assert data.numel() * data.element_size() == codes.numel() * bits // 8
    assert torch.equal(unpack_codes(data, bits, 64), codes)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_round_trip_is_exact(bits, group, symmetric):
    w = _weight()
    p = quantize(w, bits, group, symmetric=symmetric)
    assert p.bits == bits and p.group_size == group and p.symmetric == symmetric
    codes = p.codes()
    expected = _expected_codes(w, p)
    assert torch.equal(codes, expected)
    assert torch.equal(pack_codes(codes, bits), p.data)
    lo, hi = code_range(bits, symmetric)
    assert int(codes.min()) >= lo and int(codes.max()) <= hi
    # dequantize equals the float reference computed from those codes, in every dtype
    s = p.scales.float().repeat_interleave(p.group_len, dim=1)
    ref = codes.float() * s
    if not symmetric:
        ref = ref + p.offsets.float().repeat_interleave(p.group_len, dim=1)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(dequantize(p, dt), ref.to(dt))
    # and it is a quantization of w: error within half a step (+ clamp-free interior)
    err = (dequantize(p) - w).abs()
    assert bool((err <= s / 2 * (1 + 1e-5) + 1e-7).all())


def test_symmetric_int2_is_ternary_and_asymmetric_int4_uses_16_levels():
    w = _weight()
    t = quantize(w, 2, 32).codes()
    assert set(t.unique().tolist()) == {-1, 0, 1}
    a = quantize(w, 4, 32, symmetric=False).codes()
    assert int(a.min()) == -8 and int(a.max()) == 7


def test_bf16_scales_round_trip_is_exact():
    w = _weight()
    p = quantize(w, 4, 32, scale_dtype=torch.bfloat16)
    assert p.scale_dtype == torch.bfloat16
    assert torch.equal(p.codes(), _expected_codes(w, p))


@pytest.mark.parametrize(
    "bits,k,match",
    [(4, 7, "multiple of 2"), (2, 6, "multiple of 4"), (2, 10, "multiple of 4")],
)
def test_unpackable_sizes_raise(bits, k, match):
    with pytest.raises(ValueError, match=match):
        quantize(_weight(8, k), bits)
    with pytest.raises(ValueError, match=match):
        pack_codes(torch.zeros(8, k, dtype=torch.int8), bits)


def test_int8_accepts_odd_k():
    w = _weight(8, 7)
    p = quantize(w, 8)
    assert torch.equal(p.codes(), _expected_codes(w, p))


def test_bad_arguments_raise():
    w = _weight(8, 96)
    with pytest.raises(ValueError, match="must divide the input dimension K=96"):
        quantize(w, 4, 64)
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize(w, 3)
    with pytest.raises(ValueError, match="2-D"):
        quantize(w[0], 8)
    with pytest.raises(ValueError, match=r"int4 codes must lie in \[-8, 7\]"):
        pack_codes(torch.full((2, 4), 9, dtype=torch.int8), 4)
    with pytest.raises(ValueError, match="storage"):
        PackedWeight(
            4, None, torch.zeros(8, 96, dtype=torch.uint8), torch.ones(8, 1), None, (8, 96)
        )


# ---------------------------------------------------------------------------------------------
# Double quantization
# ---------------------------------------------------------------------------------------------


def test_double_quantization_warning_on_grid_aligned_weight():
    w = _q4_1_grid_weight()
    assert coarse_grid_fraction(w) == 1.0
    with pytest.warns(DoubleQuantizationWarning, match="coarse grid"):
        quantize(w, 4, 64)


def test_no_double_quantization_warning_on_random_weight():
    w = _weight()
    assert coarse_grid_fraction(w) == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize(w, 4, 64)
        quantize(w.to(torch.bfloat16), 8)
        matryoshka_quantize(w)


def test_double_quantization_check_can_be_silenced():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize(_q4_1_grid_weight(), 4, 32, check_double_quant=False)


def test_asymmetric_g32_reproduces_a_q4_1_grid_and_symmetric_does_not():
    w = _q4_1_grid_weight()
    a = quantize(w, 4, 32, symmetric=False, check_double_quant=False)
    s = quantize(w, 4, 64, symmetric=True, check_double_quant=False)
    rel = lambda p: float((dequantize(p) - w).norm() / w.norm())  # noqa: E731
    assert rel(a) < 1e-5
    assert rel(s) > 1e-2


# ---------------------------------------------------------------------------------------------
# Matryoshka
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [None, 32, 64])
def test_matryoshka_tiers_are_the_msbs_of_the_int8_codes(group):
    w = _weight()
    m = matryoshka_quantize(w, group)
    q8 = m.base.codes()
    assert torch.equal(q8, quantize(w, 8, group).codes())
    c4 = m.codes(4)
    c2 = m.codes(2)
    assert torch.equal(c4, torch.div(q8, 16, rounding_mode="floor"))
    assert torch.equal(c2, torch.div(q8, 64, rounding_mode="floor"))
    assert torch.equal(c2, torch.div(c4, 4, rounding_mode="floor"))  # tiers nest
    # bit-level: the top nibble of the stored byte is the int4 tier, the top 2 bits the int2 one
    u = m.base.data.view(torch.uint8)
    assert torch.equal((u >> 4).to(torch.int16), (c4.to(torch.int16) & 0xF))
    assert torch.equal((u >> 6).to(torch.int16), (c2.to(torch.int16) & 0x3))
    assert int(c2.min()) == -2  # the full int2 storage range is used
    # reconstruction at bin centres
    s = m.base.scales.float().repeat_interleave(m.base.group_len, dim=1)
    for bits, c in ((4, c4), (2, c2)):
        # bin centre s * (2**(8-r) c + 2**(7-r)), computed as c * scale_r + offset_r with the
        # exact power-of-two multiples scale_r = 2**(8-r) s and offset_r = 2**(7-r) s
        ref = c.float() * (s * 2 ** (8 - bits)) + s * 2 ** (7 - bits)
        assert torch.equal(m.dequantize(bits), ref)
        centre = s * (2 ** (8 - bits) * c.float() + 2 ** (7 - bits))
        assert torch.allclose(m.dequantize(bits), centre, rtol=1e-6, atol=0)
        tier = m.tier(bits)
        assert tier.bits == bits and torch.equal(tier.codes(), c)
        assert torch.equal(dequantize(tier), m.dequantize(bits))
        assert m.tier(bits) is tier  # cached
    assert m.tier(8) is m.base
    assert torch.equal(m.dequantize(8), dequantize(m.base))


def test_matryoshka_costs_int8_memory_only():
    w = _weight(64, 512)
    m = matryoshka_quantize(w, 32)
    direct = quantize(w, 8, 32)
    assert m.nbytes == direct.nbytes
    # one byte per parameter plus one float32 scale per group of 32, for all three tiers
    assert m.nbytes == w.numel() + (w.numel() // 32) * 4
    m.tier(4)
    m.drop_tiers()
    assert not m.tiers


def test_sliced_tier_is_within_one_code_of_direct_same_grid():
    w = _weight(64, 512)
    m = matryoshka_quantize(w, 32)
    for bits in (4, 2):
        direct = quantize_on_tier_grid(w, m, bits).codes()
        diff = (direct.to(torch.int16) - m.codes(bits).to(torch.int16)).abs()
        assert int(diff.max()) <= 1
        assert float((diff == 0).float().mean()) > 0.9
    with pytest.raises(ValueError):
        MatryoshkaWeight(quantize(w, 4, 32))


def test_slice_codes_rejects_bad_input():
    with pytest.raises(ValueError, match="tiers"):
        slice_codes(torch.zeros(2, 2, dtype=torch.int8), 3)
    with pytest.raises(ValueError, match="int8"):
        slice_codes(torch.zeros(2, 2, dtype=torch.int32), 4)


# ---------------------------------------------------------------------------------------------
# matmul
# ---------------------------------------------------------------------------------------------


def _formats(w: torch.Tensor) -> dict[str, PackedWeight]:
    m = matryoshka_quantize(w, 32)
    return {
        "int8-row": quantize(w, 8),
        "int8-g32": quantize(w, 8, 32),
        "int4-row": quantize(w, 4),
        "int4-g32": quantize(w, 4, 32),
        "int4-g32-asym": quantize(w, 4, 32, symmetric=False),
        "int4-g128": quantize(w, 4, 128),
        "int2-g32": quantize(w, 2, 32),
        "int2-g64-asym": quantize(w, 2, 64, symmetric=False),
        "mat4-g32": m.tier(4),
        "mat2-g32": m.tier(2),
        "int4-g16": quantize(w, 4, 16),  # no native kernel: dequant only
    }


def _check_matmul(x: torch.Tensor, p: PackedWeight, path: str | None) -> str:
    ref = F.linear(x.float(), dequantize(p, torch.float32))
    y = mm.matmul(x, p, path=path)
    assert y.dtype == x.dtype and y.shape == ref.shape
    err = float((y.float() - ref).abs().max() / ref.abs().max())
    assert err < TOL[x.dtype], (p.describe(), path, x.dtype, err)
    return path or mm.choose_path(p, x.shape[0], x.dtype, x.device)


def test_every_path_agrees_with_the_float_reference():
    w = _weight(48, 256)
    covered = set()
    for name, p in _formats(w).items():
        for dt in (torch.float32, torch.bfloat16):
            paths = mm.applicable_paths(p, dt, torch.device("cpu"))
            if name.startswith(("int8-row",)):
                assert mm.INT8PACK in paths
            if name.startswith(("int4-g32", "int4-row", "int2", "mat")):
                assert mm.INT4PACK in paths
            if name in ("int8-g32", "int4-g16"):
                assert not {mm.INT8PACK, mm.INT4PACK} & set(paths)
            for tokens in (1, 5):
                x = torch.randn(tokens, 256).to(dt)
                for path in paths:
                    covered.add(_check_matmul(x, p, path))
                covered.add(_check_matmul(x, p, None))  # whatever the dispatcher picks
    unbuilt = set() if native.int4_linear_ops() is not None else {mm.NATIVE_INT4}
    assert covered == set(mm.PATHS) - unbuilt


def test_dispatcher_choices_are_applicable_and_agree():
    w = _weight(48, 256)
    for p in _formats(w).values():
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            for tokens in (1, 2, 3, 4, 8, 16, 32, 64, 256):
                path = mm.choose_path(p, tokens, dt, "cpu")
                assert path in mm.applicable_paths(p, dt, torch.device("cpu"))
    x = torch.randn(3, 256, dtype=torch.float16)
    ref = F.linear(x.float(), dequantize(quantize(w, 4, 32)))
    y = mm.matmul(x, quantize(w, 4, 32))
    assert float((y.float() - ref).abs().max() / ref.abs().max()) < 5e-3


def test_matmul_prepares_layouts_once():
    w = _weight(48, 256)
    p = quantize(w, 4, 32)
    x = torch.randn(2, 256)
    mm.matmul(x, p, path=mm.INT4PACK)
    prepared = dict(p.prepared)
    assert prepared
    mm.matmul(x, p, path=mm.INT4PACK)
    assert all(p.prepared[k] is v for k, v in prepared.items())


def test_matmul_shapes_and_errors():
    w = _weight(48, 256)
    p = quantize(w, 8)
    x = torch.randn(2, 3, 256)
    y = mm.matmul(x, p)
    assert y.shape == (2, 3, 48)
    assert torch.allclose(y, F.linear(x, dequantize(p)), rtol=1e-4, atol=1e-5)
    assert mm.matmul(torch.randn(0, 256), p).shape == (0, 48)
    with pytest.raises(ValueError, match="K=256"):
        mm.matmul(torch.randn(2, 255), p)
    with pytest.raises(ValueError, match="cannot run"):
        mm.matmul(torch.randn(2, 256), p, path=mm.INT4PACK)
    with pytest.raises(ValueError, match="float"):
        mm.matmul(torch.ones(2, 256, dtype=torch.int32), p)


def test_non_cpu_devices_fall_back_to_dequantize_then_matmul():
    p = quantize(_weight(48, 256), 4, 32)
    for dev in ("cuda", "mps", "meta"):
        # CUDA with a GPU and triton takes the Triton kernel (tests/unit/test_triton_kernels.py)
        want = [mm.TRITON, mm.DEQUANT] if mm.triton_usable(dev) else [mm.DEQUANT]
        assert mm.choose_path(p, 1, torch.bfloat16, dev) == want[0]
        assert mm.applicable_paths(p, torch.bfloat16, torch.device(dev)) == want
    # meta tensors run the fallback end to end
    pm = p.to("meta")
    y = mm.matmul(torch.randn(3, 256, device="meta"), pm)
    assert y.shape == (3, 48) and y.device.type == "meta"


def _rule_path(fam: str, dtype: torch.dtype, tokens: int) -> str:
    for max_tokens, path in mm.cpu_rules(fam, dtype):
        if tokens <= max_tokens:
            return path
    raise AssertionError("rules must end with an unbounded entry")


def test_dispatch_follows_the_measured_table():
    w = _weight(48, 256)
    fams = {
        mm.FAMILY_INT8_ROW: quantize(w, 8),
        mm.FAMILY_INT8_GROUP: quantize(w, 8, 32),
        mm.FAMILY_INT4PACK: quantize(w, 4, 32),
        mm.FAMILY_DEQUANT: quantize(w, 8, 32, symmetric=False),
    }
    for (fam, dt), rules in mm._CPU_RULES.items():
        assert rules[-1][0] == float("inf")
        assert [r[0] for r in rules] == sorted(r[0] for r in rules)
        p = fams[fam]
        assert mm.family(p) == fam
        for tokens in (1, 2, 4, 8, 16, 32, 64):
            assert mm.choose_path(p, tokens, dt, "cpu") == _rule_path(fam, dt, tokens)


#: bf16 4-bit weights beyond 48 rows: the native kernel where it builds (2-3x dequant_f32)
_INT4_LARGE = mm.NATIVE_INT4 if native.int4_linear_ops() is not None else mm.DEQUANT_F32


@pytest.mark.parametrize(
    "make,small,large",
    [
        # bf16: the packed kernels win at decode sizes; at 64 tokens float32 dequantize-and-
        # matmul for int8, the native 4-bit kernel for the int4pack family
        (lambda w: quantize(w, 8), mm.INT8PACK, mm.DEQUANT_F32),
        (lambda w: quantize(w, 4, 32), mm.INT4PACK, "int4-large"),
        (lambda w: quantize(w, 2, 64, symmetric=False), mm.INT4PACK, "int4-large"),
        (lambda w: matryoshka_quantize(w, 32).tier(4), mm.INT4PACK, "int4-large"),
    ],
)
def test_dispatch_differs_between_one_token_and_many(make, small, large):
    large = _INT4_LARGE if large == "int4-large" else large
    p = make(_weight(48, 256))
    assert mm.choose_path(p, 1, torch.bfloat16, "cpu") == small
    assert mm.choose_path(p, 64, torch.bfloat16, "cpu") == large
    # and the switch happens where the table puts it (16 tokens int8, 48 int4)
    limit = 16 if p.bits == 8 else 48
    assert mm.choose_path(p, limit, torch.bfloat16, "cpu") == small
    assert mm.choose_path(p, limit + 1, torch.bfloat16, "cpu") == large


def test_float32_activations_never_take_the_float32_kernels():
    # measured 6-55x slower than the bf16 kernels on the project's AVX2 CPU; 4-bit weights take
    # the plugin's native kernel where it is built (faster than dequant_f32 at 1-512 tokens)
    w = _weight(48, 256)
    for p in (quantize(w, 8), quantize(w, 4, 32), quantize(w, 8, 32)):
        for tokens in (1, 8, 64, 512):
            want = mm.DEQUANT_F32
            if p.bits == 4 and native.int4_linear_ops():
                want = mm.NATIVE_INT4
            if p.bits == 8 and p.group_size is not None and native.int8_linear_ops():
                want = mm.NATIVE_INT8  # grouped int8: the plugin's kernel reads its scales
            assert mm.choose_path(p, tokens, torch.float32, "cpu") == want


@pytest.mark.parametrize("n, k", [(45, 64), (1, 32), (97, 1536), (192, 320)])
def test_native_int4_kernel_computes_the_grid_at_any_shape(n: int, k: int) -> None:
    """The C++ 4-bit kernel (``native_int4``) against the float64 product of the dequantized
    weight: symmetric, asymmetric, int2 and per-row grids, output widths that are not whole
    blocks of 32 and row counts around the row groups (8 on AVX512, 2 on AVX2)."""
    if shutil.which("c++") is None or not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("no C++ compiler or no AVX2 / FMA: the native kernels cannot run here")
    ops = native.int4_linear_ops()
    assert ops is not None, native.why_unavailable()
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    for p in (
        quantize(w, 4, 32),
        quantize(w, 4, 32, symmetric=False),
        quantize(w, 2, 32, symmetric=False),
        quantize(w, 4, None),
    ):
        layout = ops[0](p.codes(), p.scales.float(), None if p.offsets is None else p.offsets)
        ref_w = dequantize(p, torch.float64)
        for m in (1, 2, 3, 8, 9, 19):
            x = torch.randn(m, k, generator=g)
            y = ops[1](x, *layout, n)
            ref = x.double() @ ref_w.t()
            assert y.shape == (m, n)
            assert float((y.double() - ref).abs().max() / ref.abs().max()) < 1e-5, (p.describe(), m)
            # bf16 rows (the vdpbf16ps loop where the CPU has AVX512-BF16): float32 out, the
            # same sums of exact products
            xb = x.bfloat16()
            yb = ops[1](xb, *layout, n)
            refb = xb.double() @ ref_w.t()
            assert yb.shape == (m, n) and yb.dtype == torch.float32
            err = float((yb.double() - refb).abs().max() / refb.abs().max())
            assert err < 1e-5, (p.describe(), m, err)
    with pytest.raises(RuntimeError, match=r"codes must lie in \[-8, 7\]"):
        ops[0](torch.full((n, k), 9, dtype=torch.int8), torch.ones(n, 1), None)


@pytest.mark.parametrize("n, k", [(45, 64), (1, 32), (97, 1536), (192, 320)])
def test_native_int8_kernel_computes_the_grid_at_any_shape(n: int, k: int) -> None:
    """The C++ int8 kernel (``native_int8``) against the float64 product of the dequantized
    weight: per-row and grouped scales (float32 and GGUF Q8_0's float16), output widths that are
    not whole blocks of 32, row counts around the row groups, float32 and bf16 rows."""
    if shutil.which("c++") is None or not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("no C++ compiler or no AVX2 / FMA: the native kernels cannot run here")
    assert native.int8_linear_ops() is not None, native.why_unavailable()
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    for p in (
        quantize(w, 8),
        quantize(w, 8, 32),
        quantize(w, 8, 32, scale_dtype=torch.float16),
    ):
        assert mm.NATIVE_INT8 in mm.applicable_paths(p, torch.bfloat16, torch.device("cpu"))
        ref_w = dequantize(p, torch.float64)
        for m in (1, 2, 3, 8, 9, 19):
            x = torch.randn(m, k, generator=g)
            ref = x.double() @ ref_w.t()
            y = mm.matmul(x, p, path=mm.NATIVE_INT8)
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert float((y.double() - ref).abs().max() / ref.abs().max()) < 1e-5, (p.describe(), m)
            yb = mm.matmul(x.bfloat16(), p, path=mm.NATIVE_INT8)
            refb = x.bfloat16().double() @ ref_w.t()
            assert yb.dtype == torch.bfloat16
            assert float((yb.double() - refb).abs().max() / refb.abs().max()) < 1e-2


@pytest.mark.parametrize("n, k", [(45, 64), (97, 1536), (192, 320)])
def test_bf16_rows_on_amx_tiles_sum_what_the_dot_product_loops_sum(n: int, k: int) -> None:
    """Where the CPU has AMX-BF16, the int8 and 4-bit kernels run bf16 rows from a few on on AMX
    tiles (the codes made bf16 pairs per 32 k, up to 32 rows per read, missing rows zero-padded):
    the same exact products as their vdpbf16ps loops, summed in another order, for per-row and
    grouped scales, 4-bit offsets, and row counts around the 16-row tiles."""
    if shutil.which("c++") is None or not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("no C++ compiler or no AVX2 / FMA: the native kernels cannot run here")
    if native.amx_rows() < 0:
        pytest.skip("no AMX-BF16 on this CPU (or the kernel may not use it)")
    pack8, run8 = native.int8_linear_ops()
    pack4, run4 = native.int4_linear_ops()
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    cases = []
    for p in (quantize(w, 8), quantize(w, 8, 32)):
        layout = pack8(p.codes(), p.scales.float().t().contiguous())
        cases.append((p, lambda x, layout=layout: run8(x, *layout, n)))
    for p in (quantize(w, 4, 32), quantize(w, 4, 32, symmetric=False), quantize(w, 4, None)):
        layout = pack4(p.codes(), p.scales.float(), None if p.offsets is None else p.offsets)
        cases.append((p, lambda x, layout=layout: run4(x, *layout, n)))
    before = native.amx_rows()
    try:
        for p, run in cases:
            ref_w = dequantize(p, torch.float64)
            for m in (2, 3, 8, 16, 17, 32, 33, 50):
                x = torch.randn(m, k, generator=g).bfloat16()
                native.amx_rows(2)
                tiles = run(x)
                native.amx_rows(0)
                loop = run(x)
                ref = x.double() @ ref_w.t()
                scale = float(ref.abs().max())
                assert tiles.shape == (m, n) and tiles.dtype == torch.float32
                assert float((tiles.double() - ref).abs().max()) / scale < 1e-5, (p.describe(), m)
                assert float((tiles - loop).abs().max()) / scale < 1e-5, (p.describe(), m)
    finally:
        native.amx_rows(before)


# ---------------------------------------------------------------------------------------------
# A real layer from the default model
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_layer() -> torch.Tensor:
    if not CKPT.exists():
        pytest.skip(f"default model checkpoint absent ({CKPT}); prepare it with model_zoo")
    from safetensors import safe_open

    with safe_open(str(CKPT), "pt") as f:
        return f.get_tensor("model.layers.0.mlp.gate_proj.weight").float()


def test_real_layer_is_flagged_and_grid_aligned(real_layer):
    with pytest.warns(DoubleQuantizationWarning):
        quantize(real_layer, 4, 64)
    a = quantize(real_layer, 4, 32, symmetric=False, check_double_quant=False)
    s = quantize(real_layer, 4, 64, check_double_quant=False)
    rel = lambda p: float((dequantize(p) - real_layer).norm() / real_layer.norm())  # noqa: E731
    assert rel(a) < 0.01  # the Q4_1 grid it came from
    assert rel(s) > 0.05


def test_grouped_int8_tier_returns_the_q8_0_embedding_exactly() -> None:
    """The default model's embedding (its tied LM head) was dequantized from GGUF's Q8_0 (int8
    codes, one float16 scale per 32 inputs): the grouped int8 tier gives it back to the bit, so
    the int8 head is the checkpoint's own head; a per-row int8 tier does not."""
    from vllm_adaptive.precision.tiers import LinearTiers

    if not CKPT.exists():
        pytest.skip(f"default model checkpoint absent ({CKPT}); prepare it with model_zoo")
    from safetensors import safe_open

    with safe_open(str(CKPT), "pt") as f:
        head = f.get_slice("model.embed_tokens.weight")[:4096]
    assert head.dtype == torch.bfloat16
    grouped = LinearTiers.build(head, {"int8"}, "independent", 32, True, int8_group_size=32)
    per_row = LinearTiers.build(head, {"int8"}, "independent", 32, True)
    tier = grouped.tiers["int8"]
    assert tier.group_size == 32 and tier.scales.dtype == torch.float16
    assert mm.family(tier) == mm.FAMILY_INT8_GROUP
    assert torch.equal(dequantize(tier, torch.float32).bfloat16(), head)
    assert per_row.tiers["int8"].group_size is None
    assert not torch.equal(dequantize(per_row.tiers["int8"], torch.float32).bfloat16(), head)


def test_real_layer_matmul_paths(real_layer):
    m = matryoshka_quantize(real_layer, check_double_quant=False)
    fmts = [
        quantize(real_layer, 4, 32, symmetric=False, check_double_quant=False),
        m.base,
        m.tier(4),
        m.tier(2),
    ]
    for p in fmts:
        for dt in (torch.float32, torch.bfloat16):
            x = torch.randn(4, real_layer.shape[1]).to(dt)
            for path in mm.applicable_paths(p, dt, torch.device("cpu")):
                _check_matmul(x, p, path)


@pytest.mark.parametrize(
    "scale_dtype,floor", [(torch.float32, 1e-8), (torch.bfloat16, 1e-8), (torch.float16, 1e-4)]
)
@pytest.mark.parametrize("symmetric", [True, False])
def test_all_zero_rows_use_the_gearbx_scale_floor(scale_dtype, floor, symmetric):
    w = _weight(16, 64)
    w[3] = 0.0
    p = quantize(w, 4, 32, symmetric=symmetric, scale_dtype=scale_dtype)
    assert torch.equal(p.scales[3], torch.full((2,), floor, dtype=scale_dtype))
    d = dequantize(p)
    assert bool(torch.isfinite(d).all())
    assert float(d[3].abs().max()) <= floor * 8


def test_native_int4_dispatch_is_measured_on_the_machine(tmp_path, monkeypatch) -> None:
    """A float32 4-bit weight times ``native_int4`` against ``dequant_f32`` per token-count
    bucket (cached like the float formats' table); calls follow the measurement, and row
    counts past twice the last bucket (prefill) the static rules. Autotuning off keeps them."""
    from vllm_adaptive.kernels import autotune
    from vllm_adaptive.kernels.weights import autotune_weight, kernel_name

    if native.int4_linear_ops() is None:
        pytest.skip("the native kernels do not build here: the static rules apply")
    monkeypatch.setattr(autotune, "CELL_SECONDS", 0.005)
    monkeypatch.delenv("ADAPTIVE_AUTOTUNE", raising=False)
    table = autotune.DispatchTable(tmp_path / "t.json")
    monkeypatch.setattr(autotune, "_TABLE", table)
    p = quantize(_weight(64, 256), 4, 32, symmetric=False)
    autotune_weight(p, 8, torch.float32)
    (key,) = table.entries
    assert key == "int4-g32-asymmetric:64x256"
    best = table.measured_bests(key)
    assert sorted(best) == [1, 2, 4, 8] and set(best.values()) <= {mm.NATIVE_INT4, mm.DEQUANT_F32}
    for rows, bucket in ((1, 1), (3, 2), (7, 4), (15, 8)):
        assert kernel_name(p, rows, torch.float32) == best[bucket], rows
    assert kernel_name(p, 16, torch.float32) == mm.cpu_rules(mm.family(p), torch.float32)[-1][1]
    x = torch.randn(3, 256)
    torch.testing.assert_close(mm.matmul(x, p), F.linear(x, dequantize(p)), rtol=1e-4, atol=1e-5)
    monkeypatch.setenv("ADAPTIVE_AUTOTUNE", "off")
    q = quantize(_weight(32, 256), 4, 32, symmetric=False)
    autotune_weight(q, 8, torch.float32)
    assert kernel_name(q, 1, torch.float32) == mm.NATIVE_INT4  # the static rule


def test_bf16_int4_dispatch_times_torch_and_native_kernels(tmp_path, monkeypatch) -> None:
    """A bf16 engine's 4-bit weight times torch's int4pack kernel against ``native_int4`` (its
    rows cast to float32 and back) under a key of its own dtype, so a float32 engine's timings of
    the same shape never stand in for it; both paths compute the grid."""
    from vllm_adaptive.kernels import autotune
    from vllm_adaptive.kernels.weights import autotune_weight, kernel_name

    if native.int4_linear_ops() is None:
        pytest.skip("the native kernels do not build here: the static rules apply")
    monkeypatch.setattr(autotune, "CELL_SECONDS", 0.005)
    monkeypatch.delenv("ADAPTIVE_AUTOTUNE", raising=False)
    table = autotune.DispatchTable(tmp_path / "t.json")
    monkeypatch.setattr(autotune, "_TABLE", table)
    p = quantize(_weight(64, 256), 4, 32, symmetric=False)
    autotune_weight(p, 8, torch.float32)
    autotune_weight(p, 8, torch.bfloat16)
    assert sorted(table.entries) == [
        "int4-g32-asymmetric:64x256",
        "int4-g32-asymmetric:64x256:bfloat16",
    ]
    best = table.measured_bests("int4-g32-asymmetric:64x256:bfloat16")
    assert sorted(best) == [1, 2, 4, 8] and set(best.values()) <= {mm.INT4PACK, mm.NATIVE_INT4}
    for rows, bucket in ((1, 1), (3, 2), (15, 8)):
        assert kernel_name(p, rows, torch.bfloat16) == best[bucket], rows
    x = torch.randn(3, 256).to(torch.bfloat16)
    ref = F.linear(x.float(), dequantize(p))
    for path in (mm.INT4PACK, mm.NATIVE_INT4):
        y = mm.bound_kernel(p, path, torch.bfloat16)(x)
        assert y.dtype == torch.bfloat16
        assert float((y.float() - ref).abs().max() / ref.abs().max()) < 2e-2, path
