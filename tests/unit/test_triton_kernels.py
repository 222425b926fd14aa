"""Bit-plane Matryoshka layout and the Triton packed-weight kernels.

- The plane layout (``vllm_adaptive/kernels/planes.py``) is checked in-process, exactly.
- The Triton kernels run on CPU tensors through Triton's interpreter in a child process
  (``tests/support/triton_interp_cases.py``, once per session): ``TRITON_INTERPRET=1`` is read
  when a kernel is decorated, so setting it here would change triton for the whole pytest session
  (vLLM imports triton too). Each case becomes one test below.
- Real CUDA launches (correctness and timing against bf16 ``F.linear``) skip without a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.support.triton_interp_cases import SPECIAL, cases
from vllm_adaptive.kernels import matmul as mm
from vllm_adaptive.kernels.matryoshka import MatryoshkaWeight, matryoshka_quantize
from vllm_adaptive.kernels.packed import PackedWeight, dequantize, quantize
from vllm_adaptive.kernels.planes import MatryoshkaPlanes, to_planes

REPO = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA GPU (real Triton launch and timing); the interpreter tests cover CPU"


def _weight(n: int = 48, k: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


def _full_range_matryoshka(n: int = 8, k: int = 512, group: int | None = 64) -> MatryoshkaWeight:
    """Every int8 code -128..127 (the quantizer itself never emits -128)."""
    codes = (torch.arange(n * k) % 256 - 128).to(torch.int8).view(n, k)
    codes = codes[:, torch.randperm(k, generator=torch.Generator().manual_seed(0))].contiguous()
    groups = 1 if group is None else k // group
    scales = torch.rand(n, groups, generator=torch.Generator().manual_seed(1)) * 1e-3 + 1e-4
    return MatryoshkaWeight(PackedWeight(8, group, codes, scales, None, (n, k)))


# ---------------------------------------------------------------------------------------------
# Plane layout (CPU, exact)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [None, 32, 64])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_planes_round_trip_is_exact(group, scale_dtype):
    m = matryoshka_quantize(_weight(), group, scale_dtype=scale_dtype)
    p = to_planes(m)
    for bits in (8, 4, 2):
        assert torch.equal(p.codes(bits), m.codes(bits)), bits
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            assert torch.equal(p.dequantize(bits, dt), m.dequantize(bits, dt)), (bits, dt)
    back = p.to_weight()
    assert torch.equal(back.base.data, m.base.data) and back.base.scales is m.base.scales


@pytest.mark.parametrize("group", [None, 64])
def test_planes_full_code_range_and_bit_fields(group):
    m = _full_range_matryoshka(group=group)
    p = to_planes(m)
    q = m.base.data
    assert int(q.min()) == -128 and int(q.max()) == 127
    for bits in (8, 4, 2):
        assert torch.equal(p.codes(bits), m.codes(bits))
        assert torch.equal(p.dequantize(bits), m.dequantize(bits))
    # field by field: A = (bits 7-6) ^ 2 (= c2 + 2), B = bits 5-4, C = bits 3-0, little end first
    u = q.view(torch.uint8).to(torch.int32)
    n, k = m.shape
    a = torch.stack([(p.a.to(torch.int32) >> (2 * i)) & 3 for i in range(4)], -1).view(n, k)
    b = torch.stack([(p.b.to(torch.int32) >> (2 * i)) & 3 for i in range(4)], -1).view(n, k)
    c = torch.stack([(p.c.to(torch.int32) >> (4 * i)) & 15 for i in range(2)], -1).view(n, k)
    assert torch.equal(a, ((u >> 6) & 3) ^ 2)
    assert torch.equal(a - 2, m.codes(2).to(torch.int32))
    assert torch.equal(b, (u >> 4) & 3)
    assert torch.equal(c, u & 15)


def test_plane_a_is_the_int2_tier_storage():
    m = matryoshka_quantize(_weight(), 32)
    p = to_planes(m)
    assert torch.equal(p.a, m.tier(2).data)
    t2 = p.int2_tier()
    assert t2.data.data_ptr() == p.a.data_ptr()  # shared, not copied
    assert torch.equal(dequantize(t2), m.dequantize(2))


def test_planes_cost_the_int8_memory_and_tiers_read_their_bits():
    n, k = 64, 512
    m = matryoshka_quantize(_weight(n, k), 32)
    p = to_planes(m)
    scale_bytes = m.base.scales.numel() * 4
    assert p.nbytes == m.nbytes == n * k + scale_bytes
    assert p.a.numel() == p.b.numel() == n * k // 4 and p.c.numel() == n * k // 2
    assert p.tier_nbytes(2) == n * k // 4 + scale_bytes
    assert p.tier_nbytes(4) == n * k // 2 + scale_bytes
    assert p.tier_nbytes(8) == n * k + scale_bytes


def test_planes_reject_bad_input():
    with pytest.raises(ValueError, match="multiple of 4"):
        to_planes(matryoshka_quantize(_weight(8, 6)))
    p = to_planes(matryoshka_quantize(_weight(8, 64)))
    with pytest.raises(ValueError, match="tiers"):
        p.codes(3)
    with pytest.raises(ValueError, match="plane C"):
        MatryoshkaPlanes(p.a, p.b, p.a, p.scales, None, p.shape)
    with pytest.raises(ValueError, match="must divide"):
        MatryoshkaPlanes(p.a, p.b, p.c, p.scales, 48, p.shape)


# ---------------------------------------------------------------------------------------------
# matmul dispatch with the triton path
# ---------------------------------------------------------------------------------------------


def test_cpu_dispatch_is_unchanged_and_never_offers_triton():
    p = quantize(_weight(), 4, 32)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert mm.TRITON not in mm.applicable_paths(p, dt, torch.device("cpu"))
        assert mm.choose_path(p, 1, dt, "cpu") != mm.TRITON
    assert mm.TRITON not in mm.PATHS and mm.TRITON in mm.ALL_PATHS
    with pytest.raises(ValueError, match="cannot run"):
        mm.matmul(torch.randn(2, 256), p, path=mm.TRITON)


def test_triton_is_picked_on_cuda_when_usable(monkeypatch):
    monkeypatch.setattr(mm, "triton_usable", lambda d: torch.device(d).type == "cuda")
    w = _weight()
    for p in (quantize(w, 8), quantize(w, 4, 32, symmetric=False), quantize(w, 2, 16)):
        for dt in (torch.float16, torch.bfloat16, torch.float32):
            for tokens in (1, 17, 64):
                assert mm.choose_path(p, tokens, dt, "cuda") == mm.TRITON
            assert mm.applicable_paths(p, dt, torch.device("cuda")) == [mm.TRITON, mm.DEQUANT]
        assert mm.choose_path(p, 1, torch.float64, "cuda") == mm.DEQUANT  # not a kernel dtype
        for dev in ("mps", "meta"):
            assert mm.choose_path(p, 1, torch.bfloat16, dev) == mm.DEQUANT
            assert mm.applicable_paths(p, torch.bfloat16, torch.device(dev)) == [mm.DEQUANT]


def test_triton_is_not_usable_without_a_gpu():
    if CUDA:
        pytest.skip("a GPU is present")
    assert not mm.triton_usable("cuda") and not mm.triton_usable("cpu")


def test_matmul_planes_dequant_path_on_cpu():
    m = matryoshka_quantize(_weight(), 32)
    p = to_planes(m)
    x = torch.randn(2, 3, 256)
    for bits in (8, 4, 2):
        y = mm.matmul_planes(x, p, bits)
        assert y.shape == (2, 3, 48)
        assert torch.allclose(y, F.linear(x, m.dequantize(bits)), rtol=1e-5, atol=1e-6)
    assert mm.matmul_planes(torch.randn(0, 256), p, 4).shape == (0, 48)
    with pytest.raises(ValueError, match="cannot run"):
        mm.matmul_planes(x, p, 4, path=mm.TRITON)
    with pytest.raises(ValueError, match="K=256"):
        mm.matmul_planes(torch.randn(2, 128), p, 4)


def test_module_imports_without_triton(monkeypatch):
    path = REPO / "vllm_adaptive" / "kernels" / "triton_packed.py"
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("_triton_packed_without_triton", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # dataclasses look their module up
    spec.loader.exec_module(mod)
    assert mod.TRITON_AVAILABLE is False and mod.INTERPRETED is False
    with pytest.raises(RuntimeError, match="triton is not installed"):
        mod.packed_matmul(torch.randn(1, 256), quantize(_weight(), 4, 32))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernels_refuse_cpu_tensors_without_the_interpreter():
    from vllm_adaptive.kernels import triton_packed as tp

    if tp.INTERPRETED:
        pytest.skip("this session runs triton in interpreter mode")
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        tp.packed_matmul(torch.randn(1, 256), quantize(_weight(), 4, 32))


# ---------------------------------------------------------------------------------------------
# Kernels under the Triton interpreter (child process)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interp_results(tmp_path_factory) -> dict:
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    out = tmp_path_factory.mktemp("triton_interp") / "results.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.triton_interp_cases", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    if "skip" in results:
        pytest.skip(results["skip"])
    return results


@pytest.mark.parametrize("case", [c["id"] for c in cases()])
def test_kernel_matches_float_reference_interpreted(interp_results, case):
    got = interp_results[case]
    assert "error" not in got, got.get("error")
    assert got["err"] < got["tol"], got


@pytest.mark.parametrize("check", SPECIAL)
def test_kernel_special_checks_interpreted(interp_results, check):
    got = interp_results[check]
    assert "error" not in got, got.get("error")
    assert got["ok"], got["detail"]


def test_interpreter_cases_cover_every_variant():
    cs = cases()
    packed = {(c["bits"], c["symmetric"], c["group"] is None) for c in cs if c["kind"] == "packed"}
    assert packed == {(b, s, r) for b in (8, 4, 2) for s in (True, False) for r in (True, False)}
    assert {c["bits"] for c in cs if c["kind"] == "planes"} == {8, 4, 2}
    assert {1, 3, 17, 64} <= {c["m"] for c in cs}
    assert {c["dtype"] for c in cs} == {"float32", "bfloat16", "float16"}
    assert any(c["k"] % 64 for c in cs) and any(c["n"] % 64 for c in cs)


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compilation for an H100 (sm_90): no GPU needed, triton ships ptxas
# ---------------------------------------------------------------------------------------------

# (x dtype, FMT, HAS_OFFSET, BLOCK_SCALES, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K): every format and
# both scale paths, decode (split-K, atomics) and GEMM tiles, fp32 (ieee dot) and fp16 / bf16
AOT_VARIANTS = [
    ("bf16", 0, False, True, 1, 64, 64, 64),
    ("bf16", 1, True, True, 4, 16, 64, 32),
    ("fp16", 2, True, False, 2, 16, 64, 128),
    ("bf16", 3, False, True, 4, 16, 64, 32),
    ("fp32", 4, False, False, 1, 32, 64, 64),
    ("fp16", 5, False, False, 2, 16, 64, 128),
]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("variant", AOT_VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_kernel_compiles_for_sm90(variant):
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # internal API of this triton version
        pytest.skip(f"triton AOT API unavailable: {e}")
    from vllm_adaptive.kernels import triton_packed as tp

    if tp.INTERPRETED:
        pytest.skip("this session runs triton in interpreter mode")
    xdt, fmt, has_off, block_scales, split, bm, bn, bk = variant
    ptr = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}
    w = "*i8" if fmt == tp.FMT_INT8 else "*u8"
    signature = {"x_ptr": ptr[xdt], "w0_ptr": w, "w1_ptr": w, "w2_ptr": w, "s_ptr": "*fp32"}
    signature |= {"o_ptr": "*fp32", "y_ptr": "*fp32" if split > 1 else ptr[xdt]}
    ints = ["M", "N", "K", "G", "BLOCKS_PER_SPLIT", "stride_xm", "stride_w0", "stride_w1"]
    signature |= {name: "i32" for name in ints + ["stride_w2", "stride_s", "stride_ym"]}
    constexprs = {
        "FMT": fmt,
        "HAS_OFFSET": has_off,
        "BLOCK_SCALES": block_scales,
        "UPCAST": xdt == "fp32",
        "SPLIT_K": split,
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "BLOCK_K": bk,
    }
    signature |= {name: "constexpr" for name in constexprs}
    src = ASTSource(tp._packed_mm_kernel, signature, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert ".target sm_90" in kernel.asm["ptx"]
    assert kernel.asm.get("cubin")


# ---------------------------------------------------------------------------------------------
# Real CUDA launches
# ---------------------------------------------------------------------------------------------


def _cuda_formats(w: torch.Tensor) -> dict:
    m = matryoshka_quantize(w, 32)
    g = 128 if w.shape[1] % 128 == 0 else 64  # a group must divide K (576 = 9 * 64)
    return {
        "int8-row": quantize(w, 8),
        "int8-g32-asym": quantize(w, 8, 32, symmetric=False),
        "int4-g32": quantize(w, 4, 32),
        f"int4-g{g}-asym": quantize(w, 4, g, symmetric=False),
        "int2-g32": quantize(w, 2, 32),
        "int2-row-asym": quantize(w, 2, None, symmetric=False),
        "int4-g48": quantize(w, 4, 48),
        "mat-tier4": m.tier(4),
        "planes": to_planes(m),
    }


@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("k", "n"), [(576, 1536), (1536, 576), (384, 200)])
def test_cuda_kernels_match_reference(k, n, dt):
    """One test per shape and dtype: each compiles its own kernels (minutes in all on an H100),
    so workers share them out."""
    from vllm_adaptive.kernels import triton_packed as tp

    tol = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}
    w = _weight(n, k).cuda()
    for name, p in _cuda_formats(w).items():
        for mrows in (1, 3, 17, 64):
            x = torch.randn(mrows, k, device="cuda").to(dt)
            if isinstance(p, MatryoshkaPlanes):
                ys = [(b, tp.planes_matmul(x, p, b), p.dequantize(b)) for b in (8, 4, 2)]
            else:
                ys = [(p.bits, mm.matmul(x, p, path=mm.TRITON), dequantize(p))]
            for bits, y, wf in ys:
                ref = F.linear(x.float(), wf)
                err = float((y.float() - ref).abs().max() / ref.abs().max())
                assert y.dtype == dt and err < tol[dt], (name, bits, mrows, err)
