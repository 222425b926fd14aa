"""The GPU kernels on a real CUDA device: the field's kernels (tinygemm, GemLite) against the
float reference, the measured dispatch, and every kernel the plugin adds captured in a CUDA graph
and replayed on new inputs (vLLM captures decode steps).

The GPU tier runs without vLLM (``docs/testing.md``)::

    python -m pytest tests/unit/test_cuda_kernels.py tests/unit/test_triton_kernels.py \\
        tests/unit/test_masked_attention.py -k cuda

Without a GPU every test here skips; the dispatch logic they rely on is checked on CPU in
``tests/unit/test_cuda_dispatch.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.masked_attention_cases import make_case
from vllm_adaptive.kernels import cuda_library
from vllm_adaptive.kernels import matmul as mm
from vllm_adaptive.kernels.matryoshka import matryoshka_quantize
from vllm_adaptive.kernels.packed import dequantize, quantize
from vllm_adaptive.kernels.planes import to_planes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# max |y - ref| / max |ref|. GemLite's fp16 split-K adds partial sums in fp16 atomically.
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 5e-3}
SHAPES = ((512, 1536), (1536, 512), (4096, 256))  # (K, N)


@pytest.fixture(autouse=True, scope="module")
def _gemlite_without_autotuning():
    """GemLite autotunes each new shape and token bucket on its first call (seconds each, minutes
    over this module's cases); correctness does not depend on the tile, so the tests take its
    single default configuration. The bench and serving keep its autotuning."""
    if torch.cuda.is_available() and cuda_library.installed(cuda_library.GEMLITE):
        import gemlite

        gemlite.set_autotune("default")
    yield


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).cuda()


def _formats(w: torch.Tensor) -> dict:
    return {
        "int8-row": quantize(w, 8),
        "int8-g128": quantize(w, 8, 128),
        "int4-g32": quantize(w, 4, 32),
        "int4-g128-asym": quantize(w, 4, 128, symmetric=False),
        "int4-row": quantize(w, 4),
        "int2-g32": quantize(w, 2, 32),
        "int2-g64-asym": quantize(w, 2, 64, symmetric=False),
        "matryoshka-tier4": matryoshka_quantize(w, 32).tier(4),
    }


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("name", list(cuda_library.KERNELS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_library_kernel_matches_reference(name, dtype):
    if not cuda_library.installed(name):
        pytest.skip(f"{name} is not installed (GemLite: the [gpu] extra)")
    ran = 0
    for k, n in SHAPES:
        w = _weight(n, k)
        for fmt, p in _formats(w).items():
            if not cuda_library.runnable(name, p, dtype):
                continue
            for m in (1, 3, 17, 64):
                x = torch.randn(m, k, device="cuda").to(dtype)
                y = mm.matmul(x, p, path=name)
                err = _rel_err(y, F.linear(x.float(), dequantize(p)))
                assert y.dtype == dtype and y.shape == (m, n)
                assert err < TOL[dtype], (name, fmt, k, n, m, err)
                ran += 1
    if name == cuda_library.TINYGEMM and dtype == torch.float16:
        assert ran == 0  # tinygemm takes bf16 only: nothing may claim otherwise
    else:
        assert ran > 0


def test_dispatch_takes_a_library_kernel_where_one_runs():
    w = _weight(1536, 512)
    for fmt, p in _formats(w).items():
        for m in (1, 8, 64):
            path = mm.choose_path(p, m, torch.bfloat16)
            usable = mm.applicable_paths(p, torch.bfloat16, p.device)
            assert path in usable, (fmt, m, path, usable)
            if any(lib in usable for lib in mm.CUDA_LIBRARY_PATHS) and p.bits in (4, 8):
                assert path != mm.DEQUANT, (fmt, m)
            x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
            err = _rel_err(mm.matmul(x, p), F.linear(x.float(), dequantize(p)))
            assert err < TOL[torch.bfloat16], (fmt, m, path, err)


def _replays_like_eager(fn, x: torch.Tensor, tol: float) -> None:
    """Capture ``fn(x)`` in a CUDA graph, refill ``x``, replay: the output must follow."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(x)  # warm-up (autotuning, lazily built layouts) before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x)
    for seed in (1, 2):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        torch.cuda.synchronize()
        want = fn(x)
        assert _rel_err(out, want.float()) < tol, seed


def _graph_kernels() -> dict:
    from vllm_adaptive.kernels import triton_packed as tp

    w = _weight(1536, 512)
    int4, int8 = quantize(w, 4, 32), quantize(w, 8)
    planes = to_planes(matryoshka_quantize(w, 32))
    kernels = {
        "triton-int4-g32": lambda x: tp.packed_matmul(x, int4),
        "triton-int8-row": lambda x: tp.packed_matmul(x, int8),
        "triton-planes-tier2": lambda x: tp.planes_matmul(x, planes, 2),
    }
    for name in cuda_library.KERNELS:
        if cuda_library.installed(name):
            p = int4 if cuda_library.runnable(name, int4, torch.bfloat16) else int8
            kernels[f"{name}-{p.describe()}"] = cuda_library.kernel(name, p, torch.bfloat16)
    return kernels


@pytest.mark.parametrize("m", [1, 8])
def test_every_packed_kernel_replays_in_a_cuda_graph(m):
    for name, fn in _graph_kernels().items():
        x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
        try:
            _replays_like_eager(fn, x, 1e-2)  # split-K atomics: last bits vary between runs
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from exc


def test_masked_decode_attention_replays_in_a_cuda_graph():
    from vllm_adaptive.kernels import triton_masked_attention as tm

    case = make_case(5, layout="nhd", dtype=torch.bfloat16, heads=32, kv_heads=8,
                     head_size=128, block_size=16, query_lens=(1,) * 4,
                     ctx_lens=(700, 31, 2048, 5))  # fmt: skip
    for name in ("query", "query_start_loc", "seq_lens", "block_table", "depth_record"):
        setattr(case, name, getattr(case, name).cuda())
    case.key_cache, case.value_cache = case.key_cache.cuda(), case.value_cache.cuda()
    rows = torch.arange(4, device="cuda", dtype=torch.int32)
    args = case.args()
    query = args[0]

    def fn(q: torch.Tensor) -> torch.Tensor:
        return tm.masked_decode_attention(q, *args[1:], rows, layout="nhd", max_seq_len=2049)

    _replays_like_eager(fn, query, 1e-2)
