"""`vllm-adaptive kernels measure`: the kernels it times at each activation dtype compute the
product they are named for, and its table shows every kernel any row measured."""

from __future__ import annotations

import torch

from vllm_adaptive.bench.kernels_measure import (
    dense_bf16_kernels,
    markdown,
    reduced_bf16_kernels,
)


def test_bf16_kernels_compute_the_product() -> None:
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 0.05
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1)).bfloat16()
    exact = x.double() @ w.double().t()
    kernels = {**dense_bf16_kernels(w), **reduced_bf16_kernels(w)}
    assert "bf16_linear" in kernels and "int8/int8pack" in kernels
    for name, fn in kernels.items():
        y = fn(x)
        assert y.shape == (3, 64), name
        err = ((y.double() - exact).abs().max() / exact.abs().max()).item()
        assert err < (0.2 if name.startswith("int4") else 0.05), (name, err)


def test_table_has_a_column_for_every_kernel_any_row_measured() -> None:
    result = {
        "rows": [
            {"linear": "a", "k": 1, "n": 2, "tokens": 1, "us": {"x": 1.0}},
            {"linear": "b", "k": 1, "n": 2, "tokens": 1, "us": {"x": 2.0, "y": 3.0}},
        ]
    }
    lines = markdown(result).splitlines()
    assert lines[0] == "| linear | K x N | M | x | y |"
    assert lines[2].endswith("| 1 | - |") and lines[3].endswith("| 2 | 3 |")
