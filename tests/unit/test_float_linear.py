"""fp16 and W8A8 linears for float32 activations (kernels/float_linear.py) and the measured
kernel dispatch (kernels/autotune.py), on this machine's kernels (AVX2 or AVX512: every kernel
that exists here is checked against the plain-torch reference)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from vllm_adaptive.environment import cpu_flags
from vllm_adaptive.kernels import autotune, native
from vllm_adaptive.kernels.float_linear import (
    Fp16Weight,
    W8A8Weight,
    W8A16Weight,
    amx_int8_available,
    nested_w8a8_w8a16,
    quantize_per_token,
    smoothing_factors,
    unrepresentable_in_fp16,
)

N, K = 192, 320


def _w(seed: int = 0) -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.02


def _x(m: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, K, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("m", [1, 3, 17])
def test_fp16_kernels_compute_the_fp16_weight_product(m: int) -> None:
    w, x = _w(), _x(m)
    f = Fp16Weight.from_float(w)
    ref = x.double() @ w.half().double().t()
    for name in {*f.kernels(), "reference"}:
        y = f.bind(name)(x)
        assert y.dtype == torch.float32 and y.shape == (m, N)
        assert (y.double() - ref).abs().max() < 1e-5, name
    # and not the float32 weight's product (the test would not see a kernel ignoring fp16)
    assert (x.double() @ w.double().t() - ref).abs().max() > 1e-6


def _native_fp16():
    """The C++ fp16 linear; it builds wherever a compiler and F16C / FMA exist (a failed build
    fails here, it is not skipped)."""
    if shutil.which("c++") is None or not {"f16c", "fma"} <= cpu_flags():
        pytest.skip("no C++ compiler or no F16C / FMA: the native fp16 kernel cannot run here")
    ops = native.fp16_linear_ops()
    assert ops is not None, native.why_unavailable()
    return ops


@pytest.mark.parametrize("n, k", [(192, 320), (45, 64), (1, 16), (97, 1536)])
def test_native_fp16_kernel_computes_the_fp16_product_at_any_shape(n: int, k: int) -> None:
    """Output columns that are not a whole block of 32, row counts around the kernel's row
    groups (8 on AVX512, 2 on AVX2), K from one vector to the down projection's."""
    pack, lin = _native_fp16()
    g = torch.Generator().manual_seed(n * k)
    w = (torch.randn(n, k, generator=g) * 0.05).half()
    packed = pack(w)
    assert packed.shape == ((n + 31) // 32, k, 32)
    for m in (1, 2, 3, 5, 8, 9, 16, 19):
        x = torch.randn(m, k, generator=g)
        ref = x.double() @ w.double().t()
        y = lin(x, packed, n)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5, (m, n, k)
    assert lin(torch.empty(0, k), packed, n).shape == (0, n)


def test_native_fp16_kernel_refuses_what_it_was_not_packed_for() -> None:
    pack, lin = _native_fp16()
    packed = pack(torch.randn(40, 64).half())
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        lin(torch.randn(2, 32), packed, 40)
    with pytest.raises(RuntimeError, match="out_features 70 does not match 2 blocks"):
        lin(torch.randn(2, 64), packed, 70)
    with pytest.raises(RuntimeError, match="float32"):
        lin(torch.randn(2, 64).double(), packed, 40)
    with pytest.raises(RuntimeError, match="2-D float16"):
        pack(torch.randn(40, 64))


def test_kernels_build_command_builds_ahead_of_the_engine(capsys) -> None:
    """`vllm-adaptive kernels build` (what serve.sh runs before vLLM) leaves the build an engine
    then only loads; turned off, it says so and builds nothing."""
    from vllm_adaptive.cli import main

    _native_fp16()
    assert main(["kernels", "build"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["built"] is True and report["why_not"] is None
    assert native.is_cached()
    env = {**os.environ, native.NATIVE_KERNELS: "off"}
    off = subprocess.run(
        [sys.executable, "-m", "vllm_adaptive.cli", "kernels", "build"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(off.stdout)
    assert report == {**report, "built": False, "why_not": "ADAPTIVE_NATIVE_KERNELS=off"}


def test_fp16_representability_is_counted() -> None:
    w = torch.tensor([[1.0, 1.0 + 2**-12, 1e-9, 1e6]])
    got = unrepresentable_in_fp16(w)
    assert got == {"values": 4, "inexact": 3, "flushed_to_zero": 1, "overflow": 1}
    # bf16 values (8 significant bits) fit fp16's 11, except below fp16's normal range (2^-14),
    # where fp16 keeps fewer bits
    bf16 = _w().bfloat16().float()
    inexact = bf16.half().float() != bf16
    assert 0 < unrepresentable_in_fp16(bf16)["inexact"] == int(inexact.sum()) < 1e-3 * bf16.numel()
    assert bf16[inexact].abs().max() < 2**-14


@pytest.mark.parametrize("m", [1, 5, 33])
def test_w8a8_kernels_match_the_per_token_reference(m: int) -> None:
    w, x = _w(), _x(m)
    q = W8A8Weight.from_float(w)
    ref = torch.nn.functional.linear(quantize_per_token(x), q.dequantize())
    exact = x @ w.t()
    for name in {*q.kernels(), "reference"}:
        y = q.bind(name)(x)
        assert y.shape == (m, N)
        # oneDNN and the reference round activations the same way; FBGEMM asymmetrically
        tol = 3e-2 if name == "fbgemm_rows" else 1e-4
        assert ((y - ref).abs().max() / ref.abs().max()) < tol, name
        assert ((y - exact).abs().max() / exact.abs().max()) < 0.05, name


def test_w8a8_scales_are_per_token() -> None:
    """A row with a huge activation does not coarsen the other rows (one scale per call would)."""
    w, x = _w(), _x(4)
    x[2] *= 1000.0
    q = W8A8Weight.from_float(w)
    for name in q.kernels():
        fn = q.bind(name)
        batched = fn(x)
        for i in (0, 1, 3):
            alone = fn(x[i : i + 1])
            assert torch.allclose(batched[i], alone[0], rtol=1e-4, atol=1e-5), (name, i)


def test_smoothing_keeps_the_product_and_tames_an_outlier_channel() -> None:
    w, x = _w(), _x(16)
    x[:, 7] *= 80.0  # an outlier input channel, as LLM activations have
    exact = x @ w.t()
    s = smoothing_factors(x.abs().amax(0), w, alpha=0.5)
    smoothed = W8A8Weight.from_float(w, s)
    plain = W8A8Weight.from_float(w)
    # unquantized, the smoothed weight times the unsmoothed activation is the same product
    assert torch.allclose((x / s) @ (w * s).t(), exact, rtol=1e-4, atol=1e-4)
    for name in smoothed.kernels():
        err_s = (smoothed.bind(name)(x) - exact).abs().mean()
        err_p = (plain.bind(name)(x) - exact).abs().mean()
        assert err_s < 0.5 * err_p, (name, float(err_s), float(err_p))
    with pytest.raises(ValueError, match="K=320"):
        W8A8Weight.from_float(w, torch.ones(5))


@pytest.mark.parametrize("m", [1, 4, 17])
def test_w8a16_is_the_int8_weight_times_two_activation_planes(m: int) -> None:
    """Two per-token int8 planes carry the activations: the product's error is the int8
    weight's alone (W8A8's activation error is gone), on every kernel this machine has."""
    w, x = _w(), _x(m)
    w16 = W8A16Weight.from_float(w)
    codes = w16.base.dequantize().double()
    q1 = quantize_per_token(x)
    planes = q1 + quantize_per_token(x - q1)
    exact_weight_only = x.double() @ codes.t()
    for name in {*w16.kernels(), "reference"} - {"native_int8"}:
        y = w16.bind(name)(x)
        assert y.shape == (m, N)
        torch.testing.assert_close(y.double(), planes.double() @ codes.t(), atol=1e-4, rtol=1e-4)
        err16 = (y.double() - exact_weight_only).abs().max()
        err8 = (w16.base.bind("reference")(x).double() - exact_weight_only).abs().max()
        assert err16 < err8 / 20, (name, err16, err8)


def _native_int8():
    """The C++ weight-only int8 linear; it builds wherever a compiler and AVX2 / FMA exist."""
    if shutil.which("c++") is None or not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("no C++ compiler or no AVX2 / FMA: the native int8 kernel cannot run here")
    ops = native.int8_linear_ops()
    assert ops is not None, native.why_unavailable()
    return ops


@pytest.mark.parametrize(
    "n, k, groups",
    [(192, 320, 1), (45, 64, 1), (1, 16, 1), (97, 1536, 12), (33, 66, 1), (40, 99, 3)],
)
def test_native_int8_kernel_computes_the_weight_only_product(n: int, k: int, groups: int) -> None:
    """The int8 codes times their scales (one per column, or per column and group of K) times
    float32 activations, with no rounding of the activations: output widths that are not whole
    blocks of 32, row counts around the row groups (8 on AVX512, 2 on AVX2). bf16 rows give the
    same product of their values in float32 (the vdpbf16ps loop where the CPU has AVX512-BF16
    and K's chunks are even; else cast up: odd groups, one row)."""
    pack, lin = _native_int8()
    g = torch.Generator().manual_seed(n * k + groups)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(groups, n, generator=g) * 0.01 + 1e-3
    packed, padded = pack(codes, scales[0] if groups == 1 else scales)
    assert packed.shape == ((n + 31) // 32, k, 32) and padded.shape == (groups, packed.numel() // k)
    w = (codes.double().reshape(n, groups, -1) * scales.double().t()[:, :, None]).reshape(n, k)
    for m in (1, 2, 3, 5, 8, 9, 16, 19):
        x = torch.randn(m, k, generator=g)
        ref = x.double() @ w.t()
        y = lin(x, packed, padded, n)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5, (m, n, k)
        xb = x.bfloat16()
        yb, refb = lin(xb, packed, padded, n), xb.double() @ w.t()
        assert yb.shape == (m, n) and yb.dtype == torch.float32
        assert ((yb.double() - refb).abs().max() / refb.abs().max()).item() < 1e-5, (m, n, k)
    assert lin(torch.empty(0, k), packed, padded, n).shape == (0, n)
    with pytest.raises(RuntimeError, match=f"x has 8 features, the weight {k}"):
        lin(torch.randn(2, 8), packed, padded, n)
    with pytest.raises(RuntimeError, match="scale groups do not divide"):
        pack(codes, torch.rand(7, n))


@pytest.mark.parametrize("m", [1, 4, 17])
def test_w8a16_native_kernel_has_only_the_weights_error(m: int) -> None:
    """W8A16's ``native_int8`` kernel runs the float32 activations on the int8 codes as they
    are: the weight-only int8 product, closer to it than the two activation planes get."""
    _native_int8()
    w, x = _w(), _x(m)
    w16 = W8A16Weight.from_float(w)
    assert "native_int8" in w16.kernels()
    exact_weight_only = x.double() @ w16.base.dequantize().double().t()
    y = w16.bind("native_int8")(x)
    assert y.shape == (m, N) and y.dtype == torch.float32
    err = (y.double() - exact_weight_only).abs().max()
    err_planes = (w16.bind("reference")(x).double() - exact_weight_only).abs().max()
    assert err < 1e-5 and err < err_planes, (float(err), float(err_planes))
    assert w16.resident_bytes() >= w16.nbytes + N * K  # the packed codes are counted


needs_amx = pytest.mark.skipif(
    not amx_int8_available(), reason="no AMX int8 GEMM on this CPU (vLLM's sgl kernel)"
)


@needs_amx
@pytest.mark.parametrize("m", [1, 5, 33])
def test_w8a8_on_amx_takes_bf16_and_matches_the_per_token_reference(m: int) -> None:
    w, x = _w(), _x(m).bfloat16()
    q = W8A8Weight.from_float(w)
    y = q.amx_call()(x)
    assert y.dtype == torch.bfloat16 and y.shape == (m, N)
    ref = torch.nn.functional.linear(quantize_per_token(x.float()), q.dequantize())
    # the kernel rounds the product to bf16 (8 significant bits)
    assert ((y.float() - ref).abs().max() / ref.abs().max()) < 1e-2


@needs_amx
@pytest.mark.parametrize("m", [1, 4, 17])
def test_w8a16_on_amx_has_only_the_weights_error(m: int) -> None:
    w, x = _w(), _x(m)
    x[:, 7] *= 50.0  # an outlier channel coarsens a one-plane quantization of every row
    x = x.bfloat16()
    w16 = W8A16Weight.from_float(w)
    y = w16.amx_call()(x).double()
    weight_only = x.double() @ w16.base.dequantize().double().t()
    w8a8 = w16.base.amx_call()(x).double()
    err16 = (y - weight_only).abs().max()
    err8 = (w8a8 - weight_only).abs().max()
    # what is left is the bf16 rounding of the two halves' outputs (8 significant bits each)
    assert err16 < 2 * 2**-8 * weight_only.abs().max(), float(err16)
    assert err16 < err8 / 4, (float(err16), float(err8))


@needs_amx
def test_linear_runs_bf16_rows_on_amx_and_float32_rows_on_the_float32_kernels() -> None:
    from vllm_adaptive.kernels.weights import half_call, linear

    w = _w()
    for weight in (W8A8Weight.from_float(w), W8A16Weight.from_float(w)):
        x = _x(3).bfloat16()
        assert half_call(weight) is not None
        torch.testing.assert_close(linear(weight, x), weight.amx_call()(x), rtol=0, atol=0)
        x32 = _x(3)
        assert linear(weight, x32).dtype == torch.float32
    assert half_call(Fp16Weight.from_float(w)) is None


def test_half_activations_fall_back_to_float32_kernels_where_amx_cannot_run() -> None:
    """Any machine: a shape without whole AMX tiles (N = 24) still multiplies bf16 rows."""
    from vllm_adaptive.kernels.weights import linear

    w = torch.randn(24, K, generator=torch.Generator().manual_seed(3)) * 0.02
    q = W8A8Weight.from_float(w)
    assert q.amx_call() is None
    x = _x(2).bfloat16()
    y = linear(q, x)
    assert y.dtype == torch.bfloat16
    ref = torch.nn.functional.linear(quantize_per_token(x.float()), q.dequantize())
    assert ((y.float() - ref).abs().max() / ref.abs().max()) < 3e-2


def test_nested_w8a8_w8a16_rows_equal_each_gear_alone() -> None:
    """A mixed batch on shared codes (one GEMM): W8A8 rows and W8A16 rows each get what their
    own gear computes for them alone."""
    w, x = _w(), _x(9)
    low = W8A8Weight.from_float(w)
    w16 = W8A16Weight(base=low, shared=True)
    high = torch.tensor([1, 4, 8])
    y = nested_w8a8_w8a16(w16, x, high)
    kernel = w16.kernels()[0]
    expect = low.bind("onednn" if kernel == "onednn" else "reference")(x)
    expect[high] = w16.bind(kernel)(x[high])
    torch.testing.assert_close(y, expect, atol=1e-5, rtol=1e-5)
    assert w16.nbytes == 0  # the codes are the W8A8 tier's


def test_unknown_kernels_are_refused() -> None:
    with pytest.raises(ValueError, match="no kernel 'nope'"):
        Fp16Weight.from_float(_w()).bind("nope")
    with pytest.raises(ValueError, match="no kernel 'nope'"):
        W8A8Weight.from_float(_w()).bind("nope")


# -- dispatch --------------------------------------------------------------------------------


def _slow(x: torch.Tensor) -> torch.Tensor:
    time.sleep(0.002 * x.shape[0] ** 0.5)
    return x


def _fast_for_one(x: torch.Tensor) -> torch.Tensor:
    time.sleep(0.0005 if x.shape[0] == 1 else 0.02)
    return x


def test_autotune_picks_the_fastest_kernel_per_bucket_and_caches_it(tmp_path, monkeypatch):
    monkeypatch.setattr(autotune, "CELL_SECONDS", 0.01)
    monkeypatch.delenv("ADAPTIVE_AUTOTUNE", raising=False)
    table = autotune.DispatchTable(tmp_path / "t.json")
    table.ensure("fmt:4x8", {"slow": _slow, "fast1": _fast_for_one}, 8, max_tokens=4)
    assert table.choose("fmt:4x8", 1, "x") == "fast1"
    assert table.choose("fmt:4x8", 4, "x") == "slow"
    assert table.choose("fmt:4x8", 3, "x") == table.choose("fmt:4x8", 2, "x")  # bucket <= m
    assert table.choose("fmt:4x8", 500, "x") == "slow"  # past the last bucket: the last one
    assert table.choose("other:1x1", 1, "default") == "default"
    table.save()
    data = json.loads((tmp_path / "t.json").read_text())
    # the machine and the build of the C++ kernels: changed kernels are measured again
    assert data["machine"] == autotune.table_key()
    assert data["machine"]["cpu"] == autotune.cpu_info()["cpu"]
    assert "native_kernels" in data["machine"]
    assert data["entries"]["fmt:4x8"]["buckets"]["1"]["us"]["slow"] > 0
    again = autotune.DispatchTable(tmp_path / "t.json")
    again.entries = data["entries"]
    calls = []
    again.ensure("fmt:4x8", {"slow": calls.append, "fast1": calls.append}, 8)
    assert calls == []  # known key, same kernels: nothing is measured again


def test_autotune_off_takes_the_first_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPTIVE_AUTOTUNE", "off")
    table = autotune.DispatchTable(tmp_path / "t.json")
    table.ensure("fmt:4x8", {"slow": _slow, "fast1": _fast_for_one}, 8)
    assert table.choose("fmt:4x8", 1, "x") == "slow"


def test_cpu_info_names_the_isa() -> None:
    info = autotune.cpu_info()
    assert info["cpu"] and info["torch"] == torch.__version__
    assert isinstance(info["isa"], list)
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert "avx2" in info["isa"]


def test_bound_kernels_outlive_their_weight_object() -> None:
    """A bound W8A8 kernel keeps its native oneDNN handler alive (a freed handler segfaults,
    so this runs in a child process)."""
    import subprocess
    import sys

    code = (
        "import gc, torch\n"
        "from vllm_adaptive.kernels.float_linear import W8A8Weight\n"
        "q = W8A8Weight.from_float(torch.randn(64, 128) * 0.02)\n"
        "fns = [q.bind(k) for k in q.kernels()]\n"
        "del q; gc.collect()\n"
        "x = torch.randn(3, 128)\n"
        "print([tuple(fn(x).shape) for fn in fns])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "(3, 64)" in proc.stdout
