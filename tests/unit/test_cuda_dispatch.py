"""The CUDA dispatch's logic, checked without a GPU: what each library kernel claims to run, how
the measured order resolves against what is installed, and the GPU bench's report."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_adaptive.bench import kernels_gpu
from vllm_adaptive.kernels import cuda_library
from vllm_adaptive.kernels import matmul as mm
from vllm_adaptive.kernels.packed import quantize

W = torch.randn(256, 512) * 0.05


@pytest.mark.parametrize(
    ("packed", "dtype", "why"),
    [
        (quantize(W, 4, 32), torch.bfloat16, None),
        (quantize(W, 4, 128, symmetric=False), torch.bfloat16, None),
        (quantize(W, 2, 64), torch.bfloat16, None),
        (quantize(W, 4), torch.bfloat16, None),  # per-row: the scale repeated over g256
        (quantize(W, 4, 32), torch.float16, "bf16 activations"),
        (quantize(W, 8), torch.bfloat16, "4-bit codes"),
        (quantize(W, 4, 16), torch.bfloat16, "groups are"),
        (quantize(torch.randn(12, 512), 4, 32), torch.bfloat16, "N % 8"),
    ],
)
def test_tinygemm_says_what_it_runs(packed, dtype, why):
    got = cuda_library.KERNELS[cuda_library.TINYGEMM].supports(packed, dtype)
    assert got is None if why is None else why in got


@pytest.mark.parametrize(
    ("packed", "dtype", "why"),
    [
        (quantize(W, 8), torch.bfloat16, None),
        (quantize(W, 8), torch.float16, None),
        (quantize(W, 4, 64, symmetric=False), torch.float16, None),
        (quantize(W, 2, 32), torch.bfloat16, None),
        (quantize(W, 8), torch.float32, "fp16 / bf16"),
        (quantize(W, 4), torch.bfloat16, "need a group"),
        (quantize(W, 8, None, symmetric=False), torch.bfloat16, "need a group"),
        (quantize(W, 4, 16), torch.bfloat16, "groups here"),
        (quantize(torch.randn(256, 96), 4, 32), torch.bfloat16, "K % 128"),
    ],
)
def test_gemlite_says_what_it_runs(packed, dtype, why):
    got = cuda_library.KERNELS[cuda_library.GEMLITE].supports(packed, dtype)
    assert got is None if why is None else why in got


def test_measured_order_resolves_against_what_runs():
    every = [cuda_library.TINYGEMM, cuda_library.GEMLITE, mm.TRITON, mm.DEQUANT]
    for (bits, dtype), rules in mm._CUDA_RULES.items():
        got = mm.resolve_cuda_rules(bits, dtype, every)
        assert [t for t, _ in got] == [t for t, _ in rules]
        for (_, prefs), (_, path) in zip(rules, got, strict=True):
            assert path == prefs[0]  # everything runs: the measured winner
        for _, path in mm.resolve_cuda_rules(bits, dtype, [mm.TRITON, mm.DEQUANT]):
            assert path == mm.TRITON  # the measured order's next usable kernel
        assert mm.resolve_cuda_rules(bits, dtype, [mm.DEQUANT]) == tuple(
            (t, mm.DEQUANT) for t, _ in rules
        )
    # unmeasured combinations take the best usable fallback
    assert mm.resolve_cuda_rules(8, torch.float32, [mm.TRITON, mm.DEQUANT])[0][1] == mm.TRITON


def test_every_rule_names_registered_kernels():
    known = set(mm.CUDA_LIBRARY_PATHS) | {mm.TRITON}
    for rules in mm._CUDA_RULES.values():
        assert rules[-1][0] == float("inf")
        for _, prefs in rules:
            assert prefs and set(prefs) <= known


def test_cpu_weights_never_take_a_cuda_kernel():
    p = quantize(W, 4, 32)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        paths = mm.applicable_paths(p, dt, torch.device("cpu"))
        assert not set(paths) & set(mm.CUDA_LIBRARY_PATHS)
    with pytest.raises(ValueError, match="cannot run"):
        mm.matmul(torch.randn(2, 512, dtype=torch.bfloat16), p, path=cuda_library.TINYGEMM)


def _cell(k, n, m, fmt, path, ms, ok=True):
    t = {"median_ms": ms, "p20_ms": ms, "p80_ms": ms}
    return {"k": k, "n": n, "m": m, "format": fmt, "path": path, "graph": t, "eager": t,
            "ok": ok, "max_rel_err": 1e-3, "gbps": 1000.0, "of_copy": 0.3}  # fmt: skip


def test_bench_report_ranks_paths_by_speedup_over_bf16(tmp_path):
    cells = [
        _cell(4096, 4096, 1, "bf16-dense", "linear", 0.04),
        _cell(4096, 4096, 1, "int4-g128", "tinygemm", 0.016),
        _cell(4096, 4096, 1, "int4-g128", "triton", 0.08),
        _cell(4096, 4096, 1, "int4-g128", "gemlite", 0.001, ok=False),  # wrong: never ranked
        _cell(4096, 11008, 1, "bf16-dense", "linear", 0.1),
        _cell(4096, 11008, 1, "int4-g128", "tinygemm", 0.04),
        _cell(4096, 11008, 1, "int4-g128", "triton", 0.2),
    ]
    rows = kernels_gpu.fastest(cells)
    assert len(rows) == 1 and rows[0]["format"] == "int4-g128"
    ranked = rows[0]["ranked"]
    assert [p for p, _ in ranked] == ["tinygemm", "triton"]
    assert ranked[0][1] == pytest.approx(2.5) and ranked[1][1] == pytest.approx(0.5)
    result = {
        "date": "d", "device_info": {"device": "GPU", "nvidia_smi": "1", "torch": "t",
                                     "triton": "3", "gemlite": None, "cuda": "13"},
        "copy_gbps": 3000.0, "dtype": "bf16", "shapes": "4096x4096", "cells": cells,
        "fastest": rows,
    }  # fmt: skip
    md = kernels_gpu.markdown(result)
    assert "| int4-g128 | 1 | tinygemm 2.50x, triton 0.50x |" in md
    assert "FAIL" in md  # the wrong kernel is shown as such
    kernels_gpu.plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
    json.dumps(result)


def test_weight_copies_outgrow_l2():
    assert kernels_gpu.copies_for(90 << 20, 256 << 20) == 3
    assert kernels_gpu.copies_for(1 << 10, 256 << 20) == kernels_gpu.MAX_COPIES
    assert kernels_gpu.copies_for(1 << 30, 256 << 20) == 1


def test_bench_without_a_gpu_exits_2(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert kernels_gpu.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_prepare_builds_a_library_kernel_once(monkeypatch):
    """Layouts are built when the weights load (``prepare``), cached on the weight, not at the
    first call; a kernel that cannot run the weight is refused by name."""
    built = []

    def build(packed, dtype):
        built.append(dtype)
        return lambda x: x

    fake = cuda_library.CudaKernel(
        cuda_library.TINYGEMM, lambda: True, lambda p, d: None if p.bits == 4 else "4-bit", build
    )
    monkeypatch.setitem(cuda_library.KERNELS, cuda_library.TINYGEMM, fake)
    p = quantize(W, 4, 32)
    mm.prepare(p, torch.bfloat16, cuda_library.TINYGEMM)
    mm.prepare(p, torch.bfloat16, cuda_library.TINYGEMM)
    assert built == [torch.bfloat16]
    assert (
        cuda_library.kernel(cuda_library.TINYGEMM, p, torch.bfloat16)
        is p.prepared[("cuda-kernel", cuda_library.TINYGEMM, torch.bfloat16)]
    )
    with pytest.raises(ValueError, match="tinygemm cannot run int8 per-row .*: 4-bit"):
        mm.prepare(quantize(W, 8), torch.bfloat16, cuda_library.TINYGEMM)
