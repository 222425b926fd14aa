"""Paged attention with the per-slot depth mask (QuickSilver KV skipping, D-LLM KV mask).

- The torch implementation (``vllm_adaptive/kernels/masked_paged_attention.py``) in-process,
  against a float64 dense reference built from the K/V the test drew (never from the cache) on
  random paged caches: shuffled block tables padded with out-of-range ids, NaN / inf in every
  slot a request may not read, a random depth record (stale records on this step's slots too).
- The CPU_ATTN cache layout pinned against vLLM's own ``cpu_attn_reshape_and_cache``, and the
  all-visible mask against vLLM's ``cpu_attention_with_kv_cache``.
- The Triton kernel under Triton's interpreter in a child process
  (``tests/support/triton_masked_interp_cases.py``, once per session), compiled ahead of time
  for sm_90, and on a real GPU (skipped without one).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from tests.support.masked_attention_cases import TOL, dense_reference, make_case, rel_err
from tests.support.triton_masked_interp_cases import SPECIAL, cases
from vllm_adaptive.kernels import native
from vllm_adaptive.kernels.masked_paged_attention import (
    logical_kv,
    masked_paged_attention,
    split_cpu_kv_cache,
)

REPO = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_VLLM = importlib.util.find_spec("vllm") is not None
CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA GPU (real Triton launch and timing); the interpreter tests cover CPU"

# (heads, kv heads, head size, block size): GQA 2, the default model (9/3/64), MHA, MQA, a 7B
# shape (32/8/128), a head size that is not a power of two
SHAPES = [(4, 2, 64, 32), (9, 3, 64, 16), (4, 4, 32, 32), (6, 1, 64, 16), (32, 8, 128, 32),
          (4, 2, 80, 16)]  # fmt: skip
# (query lens, cached lens): decode only; a fresh prompt; chunked prefill after a context;
# a mixed batch (decode rows of different lengths, one exactly a block, and a prefill)
BATCHES = {
    "decode": ((1, 1, 1), (40, 95, 0)),
    "prompt": ((37,), (0,)),
    "chunk": ((20, 9), (64, 33)),
    "mixed": ((1, 12, 1, 1), (31, 50, 128, 3)),
}


def _run(case, **kw):
    """The torch path unless ``native`` says otherwise (the CPU layout's default is the C++
    kernel where it builds; the torch path is what GPUs and the other shapes run)."""
    kw.setdefault("native", False)
    out = torch.full_like(case.query, float("nan"))
    return masked_paged_attention(*case.args(), layout=case.layout, out=out, **kw)


@pytest.fixture(params=["torch", "native"])
def native_path(request) -> bool:
    """The checks below on both CPU paths: the torch one and the C++ kernels."""
    if request.param == "native":
        request.getfixturevalue("native_built")
    return request.param == "native"


# ---------------------------------------------------------------------------------------------
# torch implementation against the dense reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["cpu", "nhd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
@pytest.mark.parametrize("batch", list(BATCHES))
def test_torch_matches_dense_reference(layout, dtype, shape, batch):
    h, kvh, hs, bs = shape
    q_lens, ctx = BATCHES[batch]
    case = make_case(
        zlib.crc32(repr((layout, shape, batch)).encode()) % 1000,
        layout=layout,
        dtype=dtype,
        heads=h,
        kv_heads=kvh,
        head_size=hs,
        block_size=bs,
        query_lens=q_lens,
        ctx_lens=ctx,
    )
    assert case.masked_slots.numel() > 0 or sum(ctx) == 0  # the record really masks something
    y = _run(case)
    assert y.dtype == dtype and torch.isfinite(y).all()  # every element written, no poison
    assert rel_err(y, dense_reference(case)) < TOL[dtype]


@pytest.mark.parametrize("layout", ["cpu", "nhd"])
def test_small_chunks_match(layout):
    """Decode split into one block per online-softmax step, prefill queries one at a time."""
    case = make_case(1, layout=layout, query_lens=(1, 1, 6), ctx_lens=(200, 77, 90))
    ref = _run(case)
    y = _run(case, chunk_elems=1, max_elems=1)
    assert (y - ref).abs().max() < 1e-5
    assert rel_err(y, dense_reference(case)) < 1e-5


@pytest.mark.parametrize("layout", ["cpu", "nhd"])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("window", [1, 7, 40])
def test_sliding_window_matches_dense_reference(layout, batch, window):
    """A window (Gemma 3's local layers) on top of the depth mask: each query sees only its last
    ``window`` positions; small chunks give the same; a window wider than any context is no
    window; and the window changes the output where a context is longer than it."""
    q_lens, ctx = BATCHES[batch]
    case = make_case(window, layout=layout, query_lens=q_lens, ctx_lens=ctx, block_size=16)
    y = _run(case, sliding_window=window)
    assert torch.isfinite(y).all()
    ref = dense_reference(case, sliding_window=window)
    assert rel_err(y, ref) < TOL[torch.float32]
    small = _run(case, sliding_window=window, chunk_elems=1, max_elems=1)
    assert rel_err(small, ref) < TOL[torch.float32]
    wide = max(c + q for c, q in zip(ctx, q_lens, strict=True))
    assert torch.equal(_run(case, sliding_window=wide), _run(case))
    if wide > window:
        assert rel_err(y, dense_reference(case)) > 1e-3


def test_bad_sliding_window_is_refused():
    case = make_case(3)
    for bad in (0, -2):
        with pytest.raises(ValueError, match="sliding_window"):
            _run(case, sliding_window=bad)


def test_masked_and_unused_slots_do_not_matter(native_path):
    """Poison (NaN / inf), finite garbage, or other finite garbage in every slot the request
    may not read: the output is bit-identical."""
    kw = dict(heads=9, kv_heads=3, query_lens=(1, 5, 1), ctx_lens=(70, 40, 3), block_size=16)
    for layout in ("cpu", "nhd"):
        a = _run(make_case(3, layout=layout, poison=True, **kw), native=native_path)
        b = _run(make_case(3, layout=layout, poison=True, stale=50.0, **kw), native=native_path)
        c = _run(make_case(3, layout=layout, poison=False, stale=1e4, **kw), native=native_path)
        assert torch.isfinite(a).all()
        assert torch.equal(a, b) and torch.equal(a, c)


def test_mask_changes_the_output_and_step_records_are_ignored(native_path):
    case = make_case(4, query_lens=(1, 6), ctx_lens=(60, 50))
    masked = _run(case, native=native_path)
    # this step's slots carry stale records: forcing them to 0 or to "all written" changes nothing
    qsl, bs = case.query_start_loc.tolist(), 32
    for r, s in enumerate(case.seq_lens.tolist()):
        ctx = s - (qsl[r + 1] - qsl[r])
        p = torch.arange(ctx, s)
        slots = case.block_table[r, p // bs].long() * bs + p % bs
        for v in (0, 99):
            case.depth_record[slots] = v
            assert torch.equal(_run(case, native=native_path), masked)
    # the same cache with every cached slot visible (and the masked ones filled) differs
    full = make_case(4, query_lens=(1, 6), ctx_lens=(60, 50), record_mode="full")
    assert not torch.allclose(_run(full, native=native_path), masked, atol=1e-3)


def test_layer_index_moves_the_mask(native_path):
    """Raising the record of every slot above the layer makes the mask all-visible; the record
    is compared with ``> layer`` (a slot of depth d holds layers 0 .. d-1)."""
    case = make_case(5, query_lens=(1, 1), ctx_lens=(50, 20), record_mode="full", num_layers=8)
    y_full = _run(case, native=native_path)
    case.depth_record.fill_(4)
    assert torch.equal(
        masked_paged_attention(*case.args()[:-1], 3, native=native_path), y_full
    )  # 4 > 3: visible
    y4 = masked_paged_attention(
        *case.args()[:-1], 4, native=native_path
    )  # 4 > 4 is false: only own slot visible
    v_own = torch.stack([case.v_tokens[r][-1] for r in range(2)])  # [R, KVH, D]
    expect = v_own.repeat_interleave(case.query.shape[1] // v_own.shape[1], dim=1)
    assert torch.allclose(y4, expect, atol=1e-6)


def test_fully_masked_rows_are_zero(native_path):
    kw = dict(query_lens=(1, 4), ctx_lens=(30, 10), mask_step_tokens=True)
    case = make_case(6, record_mode="none_written", **kw)
    y = _run(case, mask_step_tokens=True, native=native_path)
    assert torch.equal(y, torch.zeros_like(y))
    # a random record under mask_step_tokens, request 0 with nothing written: its row is empty,
    # the others as the reference
    case = make_case(7, **kw)
    p = torch.arange(int(case.seq_lens[0]))
    case.depth_record[case.block_table[0, p // 32].long() * 32 + p % 32] = 0
    case.visible[0][:] = False
    ref = dense_reference(case)
    assert (ref[0] == 0).all() and (ref[1:].abs().amax((1, 2)) > 0).all()
    y = _run(case, mask_step_tokens=True, native=native_path)
    assert (y.double() - ref).abs().max() < 1e-5


def test_no_record_is_plain_causal_attention(native_path):
    case = make_case(8, query_lens=(1, 9), ctx_lens=(45, 20), record_mode="full")
    y0 = _run(case, native=native_path)
    case.depth_record = None
    assert torch.allclose(_run(case, native=native_path), y0, atol=1e-6)


def test_rows_subset_leaves_other_rows_untouched(native_path):
    case = make_case(9, query_lens=(1, 3, 1), ctx_lens=(10, 10, 10))
    out = torch.full_like(case.query, 7.0)
    masked_paged_attention(*case.args(), out=out, rows=[1], native=native_path)
    assert (out[0] == 7.0).all() and (out[4] == 7.0).all()
    assert torch.equal(out[1:4], _run(case, native=native_path)[1:4])


def test_bad_inputs_are_refused():
    case = make_case(10)
    with pytest.raises(ValueError, match="depth_record has"):
        masked_paged_attention(*case.args()[:-2], case.depth_record[:-1], 3)
    with pytest.raises(ValueError, match="layout"):
        masked_paged_attention(*case.args(), layout="hnd")
    with pytest.raises(ValueError, match="query tokens but seq_len"):
        bad = case.seq_lens.clone()
        bad[2] = 2
        masked_paged_attention(case.query, case.key_cache, case.value_cache,
                               case.query_start_loc, bad, case.block_table, 0.1)  # fmt: skip
    with pytest.raises(ValueError, match="chunk"):  # the torch path gathers K and V together
        kc = case.key_cache.contiguous()  # a copy, not a chunk of one cache
        masked_paged_attention(case.query, kc, case.value_cache, *case.args()[3:], native=False)


# ---------------------------------------------------------------------------------------------
# vLLM's CPU backend: cache layout and the all-visible mask
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs_hs", [(32, 64), (16, 64), (32, 128), (32, 80)])
def test_cpu_layout_matches_vllm_reshape_and_cache(dtype, bs_hs):
    """vLLM writes K transposed per (block, head) for the vec / vec16 ISAs; ``logical_kv`` reads
    exactly what ``cpu_attn_reshape_and_cache`` wrote."""
    pytest.importorskip("vllm", reason="compares against vLLM's CPU cache op")
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    bs, hs = bs_hs
    isa = _get_attn_isa(dtype, bs, hs)
    if isa not in ("vec", "vec16"):
        pytest.skip(f"ISA {isa}: its K packing is not supported by the torch path")
    nb, kvh = 5, 3
    kv = torch.zeros(nb, kvh, bs, 2 * hs, dtype=dtype)
    kc, vc = split_cpu_kv_cache(kv)
    slots = torch.randperm(nb * bs)[: 2 * bs + 7]
    k = torch.randn(len(slots), kvh, hs).to(dtype)
    v = torch.randn(len(slots), kvh, hs).to(dtype)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
    kl, vl = logical_kv(kc, vc, "cpu")
    b, o = slots // bs, slots % bs
    assert torch.equal(kl[b, :, o], k) and torch.equal(vl[b, :, o], v)


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(9, 3, 64, 32), (32, 8, 128, 32), (4, 2, 64, 16)])
@pytest.mark.parametrize("batch", ["decode", "mixed", "chunk"])
def test_all_visible_matches_vllm_cpu_attention(dtype, shape, batch):
    """With every slot written through every layer the mask is all-visible and the result is
    vLLM's own CPU attention. The free slots hold finite garbage here, not NaN: vLLM's op reads
    the unused tail of a request's last block (weight 0, but 0 * NaN = NaN); vLLM allocates the
    CPU cache zeroed, so that never shows in vLLM itself."""
    h, kvh, hs, bs = shape
    q_lens, ctx = BATCHES[batch]
    case = make_case(11, dtype=dtype, heads=h, kv_heads=kvh, head_size=hs, block_size=bs,
                     query_lens=q_lens, ctx_lens=ctx, record_mode="full", poison=False)  # fmt: skip
    ours = _run(case)
    pytest.importorskip("vllm", reason="compares against vLLM's CPU attention op")
    from vllm_adaptive.attention.stock_cpu import stock_cpu_attention, stock_cpu_scheduler_metadata
    from vllm_adaptive.engine.vllm_api import cpu_attn_isa

    # The case's cache is in the 'vec' layout; on AMX CPUs vLLM would pick 'amx' for bf16 (its
    # own K packing, which the masked backend refuses by name): run vLLM's 'vec' kernel there.
    isa = cpu_attn_isa(dtype, bs, hs)
    isa = "vec" if isa == "amx" else isa
    meta = stock_cpu_scheduler_metadata(
        case.query, case.key_cache, case.query_start_loc, case.seq_lens, isa=isa
    )
    theirs = stock_cpu_attention(
        case.query, case.key_cache, case.value_cache, case.query_start_loc, case.seq_lens,
        case.block_table, case.scale, scheduler_metadata=meta,
    )  # fmt: skip
    ref = dense_reference(case)
    assert rel_err(theirs, ref) < 2 * TOL[dtype]  # the comparison itself is meaningful
    assert rel_err(ours, theirs.double()) < 2 * TOL[dtype]


@pytest.mark.skipif(not HAS_VLLM, reason="compares against vLLM's CPU attention op")
@pytest.mark.parametrize("window", [1, 16, 45])
def test_sliding_window_matches_vllm_cpu_attention(window):
    """The window's edge as vLLM's op draws it (a query at q sees q - W + 1 .. q), all-visible
    record, a mixed batch of decodes and a chunked prefill."""
    from vllm_adaptive.attention.stock_cpu import stock_cpu_attention

    q_lens, ctx = BATCHES["mixed"]
    case = make_case(5, heads=9, kv_heads=3, head_size=64, block_size=16, query_lens=q_lens,
                     ctx_lens=ctx, record_mode="full", poison=False)  # fmt: skip
    theirs = stock_cpu_attention(
        case.query, case.key_cache, case.value_cache, case.query_start_loc, case.seq_lens,
        case.block_table, case.scale, sliding_window=window,
    )  # fmt: skip
    assert rel_err(theirs, dense_reference(case, sliding_window=window)) < 2 * TOL[torch.float32]
    ours = _run(case, sliding_window=window)
    assert rel_err(ours, theirs.double()) < 2 * TOL[torch.float32]


# ---------------------------------------------------------------------------------------------
# Triton module without triton / without a GPU
# ---------------------------------------------------------------------------------------------


def test_triton_module_imports_without_triton(monkeypatch):
    path = REPO / "vllm_adaptive" / "kernels" / "triton_masked_attention.py"
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("_triton_masked_without_triton", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    assert mod.TRITON_AVAILABLE is False and mod.INTERPRETED is False
    case = make_case(12)
    assert not mod.triton_usable(case.query, 32, 64)
    y = mod.masked_attention(*case.args())  # falls back to masked_paged_attention's default
    assert torch.equal(y, _run(case, native=None))
    with pytest.raises(RuntimeError, match="triton is not installed"):
        mod.masked_decode_attention(*case.args(), torch.tensor([0]))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_dispatcher_uses_torch_on_cpu_tensors():
    from vllm_adaptive.kernels import triton_masked_attention as tm

    if tm.INTERPRETED:
        pytest.skip("this session runs triton in interpreter mode")
    case = make_case(13, query_lens=(1, 4, 1))
    assert not tm.triton_usable(case.query, 32, 64)
    assert torch.equal(tm.masked_attention(*case.args()), _run(case, native=None))
    with pytest.raises(RuntimeError, match="CUDA query"):
        tm.masked_decode_attention(*case.args(), torch.tensor([0]))


# ---------------------------------------------------------------------------------------------
# Triton kernel under the interpreter (child process)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interp_results(tmp_path_factory) -> dict:
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    out = tmp_path_factory.mktemp("triton_masked_interp") / "results.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.triton_masked_interp_cases", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    if "skip" in results:
        pytest.skip(results["skip"])
    return results


@pytest.mark.parametrize("case", [c["id"] for c in cases()])
def test_kernel_matches_reference_interpreted(interp_results, case):
    got = interp_results[case]
    assert "error" not in got, got.get("error")
    assert got["finite"], got  # every output element written, no poison read
    assert got["err"] < got["tol"] and got["err_torch"] < got["tol"], got


@pytest.mark.parametrize("check", SPECIAL)
def test_kernel_special_checks_interpreted(interp_results, check):
    got = interp_results[check]
    assert "error" not in got, got.get("error")
    assert got["ok"], got["detail"]


def test_interpreter_cases_cover_every_variant():
    cs = cases()
    assert {c["layout"] for c in cs} == {"cpu", "nhd"}
    assert {(c["splits"], c["dtype"]) for c in cs} >= {
        (s, d) for s in (None, 1, 3) for d in ("float32", "bfloat16", "float16")
    }
    assert {c["heads"] // c["kv_heads"] for c in cs} >= {1, 2, 3, 6}
    assert any(c["head_size"] & (c["head_size"] - 1) for c in cs)  # padded head
    assert {c["block_size"] for c in cs} == {16, 32}


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compilation for an H100 (sm_90): no GPU needed, triton ships ptxas
# ---------------------------------------------------------------------------------------------

# (dtype, G_PAD/G, HEAD, HEAD_PAD, BLOCK, SPLITS, HAS_REC, STEP_VISIBLE): the default model
# (9/3/64, bf16), a 7B shape (32/8/128), fp16 / fp32, splits, no record, mask_step_tokens
AOT_VARIANTS = [
    ("bf16", 3, 64, 64, 16, 1, True, True),
    ("bf16", 4, 128, 128, 16, 8, True, True),
    ("fp16", 4, 128, 128, 32, 1, False, True),
    ("fp32", 2, 80, 128, 16, 4, True, False),
]


def _aot():
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # internal API of this triton version
        pytest.skip(f"triton AOT API unavailable: {e}")
    from vllm_adaptive.kernels import triton_masked_attention as tm

    if tm.INTERPRETED:
        pytest.skip("this session runs triton in interpreter mode")
    return triton, GPUTarget, ASTSource, tm


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("variant", AOT_VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_kernel_compiles_for_sm90(variant):
    triton, GPUTarget, ASTSource, tm = _aot()
    dt, g, head, head_pad, block, splits, has_rec, step_visible = variant
    ptr = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}[dt]
    signature = {"q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "rec_ptr": "*i16", "bt_ptr": "*i32"}
    signature |= {"seq_ptr": "*i32", "qloc_ptr": "*i32", "req_ptr": "*i32", "o_ptr": ptr}
    signature |= {"ml_ptr": "*fp32", "acc_ptr": "*fp32", "layer": "i32", "qk_scale": "fp32"}
    ints = ["BLOCKS_PER_SPLIT", "stride_qt", "stride_qh", "stride_kb", "stride_kh", "stride_ks",
            "stride_kd", "stride_vb", "stride_vh", "stride_vs", "stride_vd", "stride_bt",
            "stride_ot", "stride_oh"]  # fmt: skip
    signature |= {name: "i32" for name in ints}
    constexprs = {
        "NUM_HEADS": g * 8,
        "G": g,
        "G_PAD": 16,
        "HEAD": head,
        "HEAD_PAD": head_pad,
        "BLOCK": block,
        "SPLITS": splits,
        "HAS_REC": has_rec,
        "STEP_VISIBLE": step_visible,
        "UPCAST": dt == "fp32",
    }
    signature |= {name: "constexpr" for name in constexprs}
    src = ASTSource(tm._masked_decode_kernel, signature, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert ".target sm_90" in kernel.asm["ptx"] and kernel.asm.get("cubin")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("dt", ["bf16", "fp32"])
def test_combine_kernel_compiles_for_sm90(dt):
    triton, GPUTarget, ASTSource, tm = _aot()
    ptr = {"fp32": "*fp32", "bf16": "*bf16"}[dt]
    signature = {"ml_ptr": "*fp32", "acc_ptr": "*fp32", "qloc_ptr": "*i32", "req_ptr": "*i32"}
    signature |= {"o_ptr": ptr, "stride_ot": "i32", "stride_oh": "i32"}
    constexprs = {"NUM_HEADS": 32, "HEAD": 128, "HEAD_PAD": 128, "SPLITS": 5, "SPLITS_PAD": 8}
    signature |= {name: "constexpr" for name in constexprs}
    src = ASTSource(tm._combine_kernel, signature, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert ".target sm_90" in kernel.asm["ptx"] and kernel.asm.get("cubin")


# ---------------------------------------------------------------------------------------------
# Real CUDA launches
# ---------------------------------------------------------------------------------------------


def _cuda_case(case):
    for name in ("query", "query_start_loc", "seq_lens", "block_table", "depth_record"):
        setattr(case, name, getattr(case, name).cuda())
    if case.kv_cache is not None:
        case.kv_cache = case.kv_cache.cuda()
        case.key_cache, case.value_cache = split_cpu_kv_cache(case.kv_cache)
    else:
        case.key_cache, case.value_cache = case.key_cache.cuda(), case.value_cache.cuda()
    return case


@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("layout", ["cpu", "nhd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_kernel_matches_reference(layout, dtype):
    from vllm_adaptive.kernels import triton_masked_attention as tm

    for shape in ((9, 3, 64, 16), (32, 8, 128, 16), (4, 2, 80, 32)):
        h, kvh, hs, bs = shape
        for splits in (None, 1, 7):
            case = make_case(14, layout=layout, dtype=dtype, heads=h, kv_heads=kvh,
                             head_size=hs, block_size=bs, query_lens=(1, 1, 9, 1, 1),
                             ctx_lens=(0, 1000, 40, 2 * bs - 1, 333))  # fmt: skip
            ref = dense_reference(case)
            case = _cuda_case(case)
            dec = torch.tensor([0, 1, 3, 4], device="cuda")
            out = torch.full_like(case.query, float("nan"))
            tm.masked_decode_attention(*case.args(), dec, layout=layout, out=out, splits=splits)
            masked_paged_attention(*case.args(), layout=layout, out=out, rows=[2])
            y = out.cpu()
            assert torch.isfinite(y).all(), (shape, splits)  # every element written, no poison
            assert rel_err(y, ref) < TOL[dtype], (shape, splits, rel_err(y, ref))
            y_torch = masked_paged_attention(*case.args(), layout=layout).cpu()
            assert rel_err(y_torch, ref) < TOL[dtype]


@pytest.mark.parametrize("layout", ["cpu", "nhd"])
def test_query_positions_for_fused_rows(layout):
    """Token fusion keeps a subset of a prompt's queries (the last one included): with their
    positions given, each kept query sees keys up to its own position that the record says were
    written at the layer, this step's keys included (the runtime's provisional record)."""
    case = make_case(
        11, layout=layout, query_lens=(1, 12, 5), ctx_lens=(40, 20, 70), mask_step_tokens=True
    )
    keep_local = {0: [0], 1: [0, 3, 4, 8, 11], 2: [1, 4]}
    qsl = case.query_start_loc.tolist()
    rows, pos, qsl_new = [], [], [0]
    for r, s in enumerate(case.seq_lens.tolist()):
        n = qsl[r + 1] - qsl[r]
        ks = keep_local[r]
        rows += [qsl[r] + k for k in ks]
        pos += [s - n + k for k in ks]
        case.visible[r] = case.visible[r][ks]
        qsl_new.append(qsl_new[-1] + len(ks))
    case.query = case.query[rows]
    case.query_start_loc = torch.tensor(qsl_new, dtype=torch.int32)
    qpos = torch.tensor(pos)
    y = _run(case, mask_step_tokens=True, query_positions=qpos)
    assert torch.isfinite(y).all()
    assert rel_err(y, dense_reference(case)) < TOL[torch.float32]
    # the positions matter: the contiguous reading of the same queries differs
    contiguous = _run(case, mask_step_tokens=True)
    assert not torch.allclose(contiguous, y, atol=1e-3)
    with pytest.raises(ValueError, match="mask_step_tokens"):
        _run(case, query_positions=qpos)


# ---------------------------------------------------------------------------------------------
# the native C++ decode kernel (CPU layout), against the reference and the torch path
# ---------------------------------------------------------------------------------------------

HAS_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None


@pytest.fixture(scope="module")
def native_built():
    """The kernel builds wherever a C++ compiler exists (a failed build fails the tests here,
    it is not skipped); only a machine without one skips."""
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler: the native kernel cannot be built here")
    assert native.ensure_built(), native.why_unavailable()


# (query lens, cached lens): decode rows of many lengths, one exactly a block, a one-token row
NATIVE_DECODE = ((1, 1, 1, 1, 1), (40, 95, 0, 128, 300))
# the kernel's query-head groups beyond SHAPES' (2, 3, 4, 6 heads per KV head, head 32 in plain
# loops): one head (head 256), 7 heads in groups of one, 8 in two groups of four (head 96)
NATIVE_SHAPES = [*SHAPES, (2, 2, 256, 32), (7, 1, 64, 32), (8, 1, 96, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", NATIVE_SHAPES, ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
@pytest.mark.parametrize("window", [-1, 1, 45])
def test_native_decode_matches_reference(native_built, dtype, shape, window):
    """Decode rows through the C++ kernel: the dense reference's answer (NaN / inf in every slot
    a request may not read, shuffled tables padded with out-of-range ids), and the torch path's."""
    h, kvh, hs, bs = shape
    q_lens, ctx = NATIVE_DECODE
    case = make_case(
        zlib.crc32(repr((shape, window)).encode()) % 1000,
        dtype=dtype,
        heads=h,
        kv_heads=kvh,
        head_size=hs,
        block_size=bs,
        query_lens=q_lens,
        ctx_lens=ctx,
    )
    assert case.masked_slots.numel() > 0
    y = _run(case, native=True, sliding_window=window)
    assert y.dtype == dtype and torch.isfinite(y).all()
    assert rel_err(y, dense_reference(case, sliding_window=window)) < TOL[dtype]
    torch_path = _run(case, native=False, sliding_window=window)
    assert rel_err(y, torch_path.double()) < max(TOL[dtype], 1e-5)


def test_native_decode_special_cases(native_built):
    """Garbage in hidden slots changes nothing (bit-identical); the layer moves the mask;
    mask_step_tokens can hide a row entirely (zeros); no record is plain causal attention; a
    mixed batch sends its prefill rows to the torch path and its decode rows here."""
    kw = dict(heads=9, kv_heads=3, query_lens=(1, 1, 1), ctx_lens=(70, 40, 3), block_size=16)
    a = _run(make_case(3, poison=True, **kw), native=True)
    b = _run(make_case(3, poison=True, stale=50.0, **kw), native=True)
    c = _run(make_case(3, poison=False, stale=1e4, **kw), native=True)
    assert torch.isfinite(a).all() and torch.equal(a, b) and torch.equal(a, c)

    for lyr in (0, 7):
        case = make_case(5, layer=lyr, **kw)
        assert rel_err(_run(case, native=True), dense_reference(case)) < TOL[torch.float32]
    case = make_case(5, poison=False, **kw)
    assert not torch.allclose(
        _run(case, native=True), _run(dataclasses.replace(case, layer=7), native=True)
    )

    hidden = make_case(
        6, record_mode="none_written", mask_step_tokens=True, poison=False, stale=3.0, **kw
    )
    assert torch.equal(_run(hidden, native=True, mask_step_tokens=True), torch.zeros_like(a))

    plain = make_case(7, record_mode="full", **kw)
    y = masked_paged_attention(*plain.args()[:7], None, 0, out=torch.empty_like(plain.query),
                               native=True)  # fmt: skip
    assert rel_err(y, dense_reference(plain)) < TOL[torch.float32]

    mixed = make_case(8, heads=4, kv_heads=2, query_lens=(1, 12, 1), ctx_lens=(31, 50, 128))
    assert rel_err(_run(mixed, native=True), dense_reference(mixed)) < TOL[torch.float32]


def test_native_decode_refuses_bad_input(native_built):
    case = make_case(9, query_lens=(1, 1), ctx_lens=(40, 70))
    bad = case.block_table.clone()
    bad[1, 0] = case.key_cache.shape[0] + 5  # a block the cache does not have
    with pytest.raises(RuntimeError, match="outside the cache"):
        _run(dataclasses.replace(case, block_table=bad), native=True)
    short = case.block_table[:, :1].contiguous()  # too few blocks for the sequence
    with pytest.raises(RuntimeError, match="needs more blocks"):
        _run(dataclasses.replace(case, block_table=short), native=True)


# the prefill kernel's shapes: head sizes 64 / 128 / 256, block sizes a multiple of 16; blocks
# larger than the kernel's 32-slot chunk (vLLM's CPU default 128; 48, chunks of 16) are packed
NATIVE_PREFILL_SHAPES = [s for s in NATIVE_SHAPES if s[2] in (64, 128, 256)] + [
    (9, 3, 64, 128),
    (4, 2, 128, 48),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", NATIVE_PREFILL_SHAPES, ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("window", [-1, 1, 45])
def test_native_prefill_matches_reference(native_built, dtype, shape, batch, window):
    """Prompt, chunked-prefill and mixed steps through the C++ prefill kernel: the dense
    reference's answer (poisoned hidden slots, shuffled padded tables) and the torch path's."""
    h, kvh, hs, bs = shape
    q_lens, ctx = BATCHES[batch]
    case = make_case(
        zlib.crc32(repr((shape, batch, window)).encode()) % 1000,
        dtype=dtype,
        heads=h,
        kv_heads=kvh,
        head_size=hs,
        block_size=bs,
        query_lens=tuple(q * 9 if q > 1 else q for q in q_lens),  # tiles of 16 and their tails
        ctx_lens=ctx,
    )
    y = _run(case, native=True, sliding_window=window)
    assert y.dtype == dtype and torch.isfinite(y).all()
    assert rel_err(y, dense_reference(case, sliding_window=window)) < TOL[dtype]
    torch_path = _run(case, native=False, sliding_window=window)
    assert rel_err(y, torch_path.double()) < max(TOL[dtype], 1e-5)


def _fused(case):
    """Token fusion's step: a subset of each request's queries (the last one kept) at their
    positions, with the record deciding this step's keys too (``mask_step_tokens``)."""
    keep_local = {0: [0], 1: [0, 3, 4, 8, 11, 20, 37], 2: [1, 4]}
    qsl = case.query_start_loc.tolist()
    rows, pos, qsl_new = [], [], [0]
    for r, s in enumerate(case.seq_lens.tolist()):
        n = qsl[r + 1] - qsl[r]
        ks = [k for k in keep_local[r] if k < n - 1] + [n - 1]
        rows += [qsl[r] + k for k in ks]
        pos += [s - n + k for k in ks]
        case.visible[r] = case.visible[r][ks]
        qsl_new.append(qsl_new[-1] + len(ks))
    case.query = case.query[rows]
    case.query_start_loc = torch.tensor(qsl_new, dtype=torch.int32)
    return case, torch.tensor(pos)


@pytest.mark.parametrize("layout", ["cpu", "nhd"])
def test_query_positions_for_fused_rows_on_every_path(native_built, layout):
    """The fused step on the C++ kernel (CPU layout) and on the torch path: the reference's
    answer; the positions matter (the contiguous reading differs); out-of-order positions are
    refused."""
    case = make_case(
        12, layout=layout, query_lens=(1, 40, 5), ctx_lens=(40, 20, 70), mask_step_tokens=True
    )
    case, qpos = _fused(case)
    ref = dense_reference(case)
    for native_flag in (True, False):
        y = _run(case, mask_step_tokens=True, query_positions=qpos, native=native_flag)
        assert torch.isfinite(y).all()
        assert rel_err(y, ref) < TOL[torch.float32]
    contiguous = _run(case, mask_step_tokens=True, native=True)
    assert not torch.allclose(contiguous, y, atol=1e-3)
    if layout == "cpu":
        backwards = qpos.clone()
        backwards[1], backwards[2] = qpos[2], qpos[1]
        with pytest.raises(RuntimeError, match="ascend"):
            _run(case, mask_step_tokens=True, query_positions=backwards, native=True)


def test_native_off_is_refused_when_demanded(monkeypatch):
    """ADAPTIVE_NATIVE_KERNELS=off: the default path falls back to torch (same answer), and a
    caller that demands the native kernel gets an error naming the variable."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv(native.NATIVE_KERNELS, "off")
    case = make_case(10, query_lens=(1, 1), ctx_lens=(40, 70))
    assert rel_err(_run(case), dense_reference(case)) < TOL[torch.float32]
    with pytest.raises(RuntimeError, match=native.NATIVE_KERNELS):
        _run(case, native=True)
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv(native.NATIVE_KERNELS, "sometimes")
    with pytest.raises(ValueError, match="'on' or 'off'"):
        native.ensure_built()
