"""Check and time paged attention with the per-slot depth mask at decode shapes.

Decode: one query token per request, ``--batches`` requests of ``--contexts`` cached tokens each
(the query's own token included), on a paged cache whose blocks are shuffled. Shapes
``HxKVxD`` (query heads, KV heads, head size): the default model (9x3x64) and a 7B (32x8x128).

On a CUDA GPU (``--device cuda``, the default when one is present; vLLM's GPU layout
``[num_blocks, block_size, kv_heads, head]``, block size 16, bf16):

- ``triton``: ``masked_decode_attention`` (``vllm_adaptive/kernels/triton_masked_attention.py``),
  checked first against the torch implementation (max error relative to max |reference|), with
  NaN in every unused slot and the output pre-filled with NaN (every element must be written);
- ``torch``: the torch implementation (``masked_paged_attention``) on the GPU;
- ``sdpa``: ``F.scaled_dot_product_attention`` on dense, contiguous K/V (no paging, no mask):
  a lower bound for any paged kernel;
- ``flash``: vLLM's ``flash_attn_with_kvcache`` on the same paged cache without the mask (the
  stock backend's kernel), when ``vllm.vllm_flash_attn`` imports.

Timings with ``triton.testing.do_bench`` (median ms). On CPU (``--device cpu``; vLLM's CPU_ATTN
layout, block size 32): the torch implementation and the native C++ kernel
(``kernels/native.py``, when it builds here) against vLLM's ``cpu_attention_with_kv_cache`` with
the mask all-visible (checked against each other first; the unused slots hold finite garbage
since vLLM's op reads the tail of the last block), and both with ``--masked`` of the cached slots
masked (the native kernel checked against the torch path there); median of ``--repeats``
wall-clock runs taken in turns, one thread unless ``--threads``. Cells with ``batch * context >
--max-tokens`` are skipped.

    vllm-adaptive kernels bench-attention --out docs/data/masked-attention-h100.json
    vllm-adaptive kernels bench-attention --device cpu --contexts 512,2048,8192 \\
        --out docs/data/masked-attention-cpu.json

``--prefill`` (CPU): one request whose ``--contexts`` tokens are all this step's queries (a
prompt's prefill). vLLM's op and both paths with every key visible, then token fusion's step:
a ``--masked`` share of the prompt's rows fused away (their slots hidden at the layer through
the record, the kept queries at their own positions, ``mask_step_tokens``), which vLLM's op
cannot express; its cost is what a fused layer pays against the stock layer.

    vllm-adaptive kernels bench-attention --device cpu --prefill --contexts 512,2048,8000 \
        --masked 0.05 --out docs/data/masked-prefill-cpu.json

Writes JSON (``--out``: device, versions, every cell) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from vllm_adaptive.attention.stock_cpu import stock_cpu_attention, stock_cpu_scheduler_metadata
from vllm_adaptive.kernels.autotune import cpu_info
from vllm_adaptive.kernels.masked_paged_attention import (
    masked_paged_attention,
    split_cpu_kv_cache,
)
from vllm_adaptive.kernels.native import ensure_built

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}
NUM_LAYERS = 30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="vllm-adaptive kernels bench-attention", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--shapes", default="9x3x64,32x8x128")
    p.add_argument("--contexts", default="512,1024,2048,4096,8192")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bf16 / fp32 (cpu)")
    p.add_argument("--block-size", type=int, default=None, help="default: 16 (cuda) / 32 (cpu)")
    p.add_argument("--masked", type=float, default=0.5, help="fraction of cached slots masked")
    p.add_argument("--layer", type=int, default=15)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--cold-mib",
        type=int,
        default=0,
        help="CPU: stream this many MiB (a few times the last-level cache) before each timed "
        "call, so that the KV cache comes from memory (default 0: warm, each call after an "
        "untimed one)",
    )
    p.add_argument(
        "--prefill",
        action="store_true",
        help="CPU: time one prompt's prefill of each context (batches ignored) instead of decode",
    )
    p.add_argument("--max-tokens", type=int, default=1 << 16)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def make_paged(batch, ctx, kvh, hs, bs, dtype, device, layout, masked, layer, seed=0):
    """A decode batch on a shuffled paged cache: every request ``ctx`` tokens (own included).
    Unused slots: NaN on CUDA (must never be read), finite garbage on CPU (vLLM's op reads
    them). The record: every slot all layers, except a random ``masked`` share of the cached
    ones at ``layer`` (the all-visible record is returned too)."""
    g = torch.Generator().manual_seed(seed)
    nblk = -(-ctx // bs)
    nb = batch * nblk + 1
    table = torch.randperm(nb, generator=g)[: batch * nblk].view(batch, nblk).int()
    if layout == "cpu":
        kv_cache = torch.randn(nb, kvh, bs, 2 * hs, generator=g).to(dtype)
        key_cache, value_cache = split_cpu_kv_cache(kv_cache)
    else:
        key_cache = torch.randn(nb, bs, kvh, hs, generator=g).to(dtype)
        value_cache = torch.randn(nb, bs, kvh, hs, generator=g).to(dtype)
        tail = ctx % bs
        if tail:  # poison the unused tail of every request's last block
            last = table[:, -1].long()
            key_cache[last, tail:] = float("nan")
            value_cache[last, tail:] = float("nan")
    full = torch.full((nb * bs,), NUM_LAYERS, dtype=torch.int16)
    rec = full.clone()
    pos = torch.arange(ctx - 1)  # cached positions (the own token is always visible)
    slots = (table[:, pos // bs].long() * bs + pos % bs).flatten()
    pick = torch.rand(slots.numel(), generator=g) < masked
    rec[slots[pick]] = layer  # depth == layer: layer not written
    meta = {
        "query_start_loc": torch.arange(batch + 1, dtype=torch.int32),
        "seq_lens": torch.full((batch,), ctx, dtype=torch.int32),
        "block_table": table,
    }
    dev = {k: v.to(device) for k, v in meta.items()}
    return (key_cache.to(device), value_cache.to(device), dev, full.to(device), rec.to(device))


def _cpu_times(fns: dict, repeats: int, evict: torch.Tensor | None = None) -> dict[str, float]:
    """Median ms of each callable, the callables taking turns (a neighbour's load on a shared
    host then falls on all of them alike). Each timed call follows an untimed one of the same
    callable (warm: none is timed on the caches its predecessor left), or a pass over ``evict``
    (cold: the cache comes from memory, as a served model's 30 layers of KV do)."""
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            if evict is None:
                fn()
            else:
                evict.add_(1.0)
            t0 = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in ts.items()}


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def cpu_cell(args, nh, kvh, hs, batch, ctx, dtype, bs) -> dict:
    kc, vc, meta, full, rec = make_paged(
        batch, ctx, kvh, hs, bs, dtype, "cpu", "cpu", args.masked, args.layer
    )
    q = torch.randn(batch, nh, hs).to(dtype)
    a = (meta["query_start_loc"], meta["seq_lens"], meta["block_table"], hs**-0.5)
    # computed once per step by vLLM's metadata builder, so outside the timing
    sched = stock_cpu_scheduler_metadata(q, kc, a[0], a[1])

    def ours(record, native=False):
        return masked_paged_attention(q, kc, vc, *a, record, args.layer, native=native)

    def stock():
        return stock_cpu_attention(q, kc, vc, *a, scheduler_metadata=sched)

    ref = stock()
    err = rel(ours(full), ref)
    cell = {
        "shape": f"{nh}x{kvh}x{hs}",
        "batch": batch,
        "context": ctx,
        "err_vs_vllm": err,
        "ok": err < TOL[dtype],
    }
    native = ensure_built()
    if native:
        cell["err_native_vs_vllm"] = rel(ours(full, True), ref)
        cell["err_native_vs_torch_masked"] = rel(ours(rec, True), ours(rec))
        cell["ok"] &= (
            max(cell["err_native_vs_vllm"], cell["err_native_vs_torch_masked"]) < TOL[dtype]
        )
    fns = {
        "ms_vllm_cpu_attn": stock,
        "ms_torch_all_visible": lambda: ours(full),
        "ms_torch_masked": lambda: ours(rec),
    }
    if native:
        fns["ms_native_all_visible"] = lambda: ours(full, True)
        fns["ms_native_masked"] = lambda: ours(rec, True)
    evict = torch.zeros(args.cold_mib << 18) if args.cold_mib else None
    cell.update(_cpu_times(fns, args.repeats, evict))
    cell["ratio_torch_vs_vllm"] = cell["ms_torch_all_visible"] / cell["ms_vllm_cpu_attn"]
    if native:
        cell["ratio_native_vs_vllm"] = cell["ms_native_all_visible"] / cell["ms_vllm_cpu_attn"]
        cell["ratio_native_masked_vs_vllm"] = cell["ms_native_masked"] / cell["ms_vllm_cpu_attn"]
    return cell


def prefill_cell(args, nh, kvh, hs, batch, ctx, dtype, bs) -> dict:
    """One prompt of ``ctx`` tokens, every one a query of this step (``batch`` is ignored)."""
    kc, vc, meta, full, _ = make_paged(1, ctx, kvh, hs, bs, dtype, "cpu", "cpu", 0.0, args.layer)
    meta["query_start_loc"] = torch.tensor([0, ctx], dtype=torch.int32)
    q = torch.randn(ctx, nh, hs).to(dtype)
    a = (meta["query_start_loc"], meta["seq_lens"], meta["block_table"], hs**-0.5)
    sched = stock_cpu_scheduler_metadata(q, kc, a[0], a[1])
    # token fusion's step: a --masked share of the rows fused away (never the last), their
    # slots not written at this layer; the kept queries at their positions
    g = torch.Generator().manual_seed(ctx)
    fused = torch.rand(ctx, generator=g) < args.masked
    fused[-1] = False
    keep = (~fused).nonzero().flatten()
    rec = full.clone()
    pos = torch.arange(ctx)
    table = meta["block_table"][0].long()
    rec[table[pos[fused] // bs] * bs + pos[fused] % bs] = args.layer
    qf = q[keep].contiguous()
    af = (torch.tensor([0, keep.numel()], dtype=torch.int32), *a[1:])

    def ours(native=False):
        return masked_paged_attention(q, kc, vc, *a, full, args.layer, native=native)

    def fused_step(native=False):
        return masked_paged_attention(qf, kc, vc, *af, rec, args.layer, native=native,
                                      mask_step_tokens=True, query_positions=keep)  # fmt: skip

    def stock():
        return stock_cpu_attention(q, kc, vc, *a, scheduler_metadata=sched)

    ref = stock()
    cell = {
        "shape": f"{nh}x{kvh}x{hs}",
        "batch": 1,
        "context": ctx,
        "fused_rows": int(fused.sum()),
        "err_vs_vllm": rel(ours(), ref),
    }
    cell["ok"] = cell["err_vs_vllm"] < TOL[dtype]
    fns = {
        "ms_vllm_cpu_attn": stock,
        "ms_torch_all_visible": ours,
        "ms_torch_fused": fused_step,
    }
    if ensure_built():
        cell["err_native_vs_vllm"] = rel(ours(True), ref)
        cell["err_native_vs_torch_fused"] = rel(fused_step(True), fused_step())
        cell["ok"] &= (
            max(cell["err_native_vs_vllm"], cell["err_native_vs_torch_fused"]) < TOL[dtype]
        )
        fns["ms_native_all_visible"] = lambda: ours(True)
        fns["ms_native_fused"] = lambda: fused_step(True)
    evict = torch.zeros(args.cold_mib << 18) if args.cold_mib else None
    cell.update(_cpu_times(fns, args.repeats, evict))
    for k in ("torch_all_visible", "torch_fused", "native_all_visible", "native_fused"):
        if f"ms_{k}" in cell:
            cell[f"ratio_{k}_vs_vllm"] = cell[f"ms_{k}"] / cell["ms_vllm_cpu_attn"]
    return cell


def cuda_cell(args, nh, kvh, hs, batch, ctx, dtype, bs) -> dict:
    import torch.nn.functional as F
    import triton.testing

    from vllm_adaptive.kernels import triton_masked_attention as tm

    kc, vc, meta, full, rec = make_paged(
        batch, ctx, kvh, hs, bs, dtype, "cuda", "nhd", args.masked, args.layer
    )
    q = torch.randn(batch, nh, hs, device="cuda").to(dtype)
    a = (meta["query_start_loc"], meta["seq_lens"], meta["block_table"], hs**-0.5)
    rows = torch.arange(batch, device="cuda", dtype=torch.int32)

    def tri(record, out=None):
        return tm.masked_decode_attention(
            q, kc, vc, *a, record, args.layer, rows, layout="nhd", out=out, max_seq_len=ctx
        )

    def torch_path():
        return masked_paged_attention(q, kc, vc, *a, rec, args.layer, layout="nhd")

    out = tri(rec, torch.full_like(q, float("nan")))
    written = bool(torch.isfinite(out).all())
    err = rel(out, torch_path())
    cell = {
        "shape": f"{nh}x{kvh}x{hs}",
        "batch": batch,
        "context": ctx,
        "err_vs_torch": err,
        "all_written_no_poison": written,
        "ok": written and err < TOL[dtype],
        "splits": tm.default_splits(batch, kvh, -(-ctx // bs), q.device),
        "visible_fraction": float((rec[meta["block_table"].long()] > args.layer).float().mean()),
        "ms_triton_masked": triton.testing.do_bench(lambda: tri(rec)),
        "ms_triton_all_visible": triton.testing.do_bench(lambda: tri(full)),
        "ms_torch_masked": triton.testing.do_bench(torch_path),
    }
    qd = q.view(batch, nh, 1, hs).contiguous()
    kd = torch.randn(batch, kvh, ctx, hs, device="cuda", dtype=dtype)
    vd = torch.randn(batch, kvh, ctx, hs, device="cuda", dtype=dtype)
    cell["ms_sdpa_dense"] = triton.testing.do_bench(
        lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)
    )
    try:
        from vllm_adaptive.engine.vllm_api import flash_attn_with_kvcache

        q4 = q.view(batch, 1, nh, hs)
        cell["ms_flash_paged_no_mask"] = triton.testing.do_bench(
            lambda: flash_attn_with_kvcache(
                q4, kc, vc, cache_seqlens=a[1], block_table=a[2], softmax_scale=a[3], causal=True
            )
        )
    except Exception as e:  # not a vLLM CUDA build, or another flash-attn API
        cell["flash_error"] = repr(e)[:200]
    cell["ratio_triton_vs_sdpa"] = cell["ms_triton_masked"] / cell["ms_sdpa_dense"]
    kv_bytes = 2 * batch * ctx * kvh * hs * q.element_size()  # K and V, every slot
    cell["gbps_triton_all_visible"] = kv_bytes / cell["ms_triton_all_visible"] / 1e6
    return cell


def run(cell_fn, args, shapes, contexts, batches, dtype, bs) -> list[dict]:
    cells = []
    for nh, kvh, hs in shapes:
        for batch in batches:
            for ctx in contexts:
                if batch * ctx > args.max_tokens:
                    continue
                cell = cell_fn(args, nh, kvh, hs, batch, ctx, dtype, bs)
                cells.append(cell)
                print(json.dumps(cell), flush=True)
    return cells


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype or ("bf16" if device == "cuda" else "fp32")]
    bs = args.block_size or (16 if device == "cuda" else 32)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    t0 = time.time()
    if device == "cpu":
        torch.set_num_threads(args.threads)
    if args.prefill and device != "cpu":
        print("--prefill times the CPU kernels only", file=sys.stderr)
        return 2
    if args.prefill:
        batches = [1]
    cell_fn = cuda_cell if device == "cuda" else (prefill_cell if args.prefill else cpu_cell)
    cells = run(cell_fn, args, shapes, contexts, batches, dtype, bs)
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device == "cuda" else cpu_info()["cpu"],
        "cpu": cpu_info() if device == "cpu" else None,
        "torch": torch.__version__,
        "dtype": str(dtype),
        "block_size": bs,
        "threads": args.threads if device == "cpu" else None,
        "cold_mib": args.cold_mib if device == "cpu" else None,
        "masked_fraction": args.masked,
        "mode": "prefill" if args.prefill else "decode",
        "layer": args.layer,
        "seconds": round(time.time() - t0, 1),
        "argv": sys.argv[1:] if argv is None else argv,
    }
    try:
        from vllm_adaptive.engine import vllm_api

        info["vllm"] = vllm_api.version()
    except Exception:
        pass
    if device == "cuda":
        import triton

        info["triton"] = triton.__version__
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"info": info, "cells": cells}, indent=1))
    keys = [k for k in cells[0] if k.startswith("ms_") or k.startswith("err")] if cells else []
    print("\n| shape | batch | context | " + " | ".join(keys) + " |")
    print("|" + " --- |" * (3 + len(keys)))
    for c in cells:
        vals = " | ".join(f"{c[k]:.3g}" if k in c else "-" for k in keys)
        print(f"| {c['shape']} | {c['batch']} | {c['context']} | {vals} |")
    bad = [c for c in cells if not c["ok"]]
    if bad:
        print(f"{len(bad)} cells failed the check", file=sys.stderr)
        return 1
    return 0
