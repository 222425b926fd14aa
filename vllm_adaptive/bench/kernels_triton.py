"""Check and time the Triton packed-weight kernels against bf16 ``F.linear`` on a CUDA GPU.

For each shape K x N (inputs x outputs), token count M and weight format, the kernel
(``vllm_adaptive.kernels.triton_packed``) is first checked against the float reference
``F.linear(x.float(), W_float32)`` on random inputs (max error relative to max |reference|),
then timed with ``triton.testing.do_bench`` (CUDA events, L2 flushed before every repetition, so
weights stream from HBM as in a real forward pass), next to:

- ``linear``: ``F.linear(x, W)`` with W dense in x's dtype (bf16 by default): the baseline;
- ``dequant``: ``F.linear(x, dequantize(W, x.dtype))``, the fallback ``matmul`` uses off CPU
  without triton (``--no-dequant`` skips it).

Formats: ``int{8,4,2}-{row,g<size>}[-asym]`` (:class:`PackedWeight`) and
``planes{8,4,2}-{row,g<size>}`` (a Matryoshka tier read from the bit-plane layout, which loads
0.25 / 0.5 / 1 byte per parameter for tiers 2 / 4 / 8).

Effective bandwidth = bytes the kernel must move (weight codes of the tier + scales + offsets,
x read, y written) / median time. Writes JSON (``--out``) with the device, torch / triton
versions, every cell (median / p20 / p80 ms, errors, bytes, GB/s, the launch config) and prints a
markdown table. ``--sweep`` also times a few alternative block configurations per cell and
records the best.

    vllm-adaptive kernels bench-triton --out docs/data/triton-kernels-h100.json
    vllm-adaptive kernels bench-triton --shapes 4096x4096 --tokens 1 --out /tmp/t.json

Needs a CUDA GPU and triton; exits with status 2 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_adaptive.kernels.matryoshka import matryoshka_quantize
from vllm_adaptive.kernels.packed import dequantize, quantize
from vllm_adaptive.kernels.planes import to_planes

DEFAULT_MODEL_SHAPES = "576x576,576x192,576x1536,1536x576"
LLAMA7B_SHAPES = "4096x4096,4096x11008,11008x4096"
DEFAULT_SHAPES = f"{DEFAULT_MODEL_SHAPES},{LLAMA7B_SHAPES}"
DEFAULT_TOKENS = "1,8,32"
DEFAULT_FORMATS = (
    "int8-g32,int8-row,int4-g32,int4-row,int2-g32,int2-row,planes8-g32,planes4-g32,planes2-g32"
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# max |y - ref| / max |ref|, as in tests/unit/test_triton_kernels.py
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def parse_format(spec: str) -> dict:
    """``int4-g32`` / ``int8-row-asym`` / ``planes2-g32`` -> what to build."""
    parts = spec.split("-")
    kind = "planes" if parts[0].startswith("planes") else "packed"
    digits = parts[0][len("planes") :] if kind == "planes" else parts[0][len("int") :]
    if (
        len(parts) not in (2, 3)
        or not digits.isdigit()
        or (kind == "packed" and parts[0][:3] != "int")
    ):
        raise ValueError(
            f"bad format {spec!r}: want int<bits>-<row|gN>[-asym] or planes<bits>-<row|gN>"
        )
    bits = int(digits)
    if bits not in (8, 4, 2):
        raise ValueError(f"bad format {spec!r}: bits must be 8, 4 or 2")
    group = None if parts[1] == "row" else int(parts[1].lstrip("g"))
    sym = not (len(parts) == 3 and parts[2] == "asym")
    if kind == "planes" and not sym:
        raise ValueError(f"bad format {spec!r}: Matryoshka planes are symmetric")
    return {"kind": kind, "bits": bits, "group": group, "symmetric": sym}


def sweep_configs(tp, m: int, n: int, k: int, group: int | None, device: torch.device) -> list:
    """The default configuration plus a few neighbours (block sizes, split-K)."""
    base = tp.default_config(m, n, k, group or k, group is None, device)
    out = [base]
    if m <= tp.DECODE_MAX_M:
        variants = [
            {"block_n": 32},
            {"block_n": 128},
            {"block_k": 256} if base.block_k == 128 else {"block_k": base.block_k * 2},
            {"split_k": max(1, base.split_k // 2)},
            {"split_k": min(tp.MAX_SPLIT_K * 2, base.split_k * 2)},
            {"num_warps": 8},
        ]
    else:
        variants = [{"block_n": 128}, {"block_m": 16, "block_n": 64}, {"num_stages": 4}]
    for v in variants:
        cfg = dataclasses.replace(base, **v)
        if cfg not in out:
            out.append(cfg)
    return out


def build(tp, w: torch.Tensor, f: dict) -> tuple:
    """(format, fn(x, config=None), float32 reference weight, weight bytes read, PackedWeight)."""
    if f["kind"] == "planes":
        mw = matryoshka_quantize(w, f["group"], check_double_quant=False)
        pl = to_planes(mw)
        bits = f["bits"]

        def fn(x, cfg=None):
            return tp.planes_matmul(x, pl, bits, cfg)

        return f, fn, mw.dequantize(bits), pl.tier_nbytes(bits), None
    p = quantize(w, f["bits"], f["group"], symmetric=f["symmetric"], check_double_quant=False)

    def fn(x, cfg=None):
        return tp.packed_matmul(x, p, cfg)

    return f, fn, dequantize(p), p.nbytes, p


def bench(fn, warmup: int, rep: int, device: torch.device) -> dict:
    if device.type == "cpu":  # interpreter smoke run: wall clock of 3 calls, meaningless
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        return {"median_ms": times[1], "p20_ms": times[0], "p80_ms": times[2]}
    import triton.testing

    q = triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return {"median_ms": q[0], "p20_ms": q[1], "p80_ms": q[2]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="vllm-adaptive kernels bench-triton", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of KxN")
    ap.add_argument("--tokens", default=DEFAULT_TOKENS, help="comma list of M")
    ap.add_argument("--formats", default=DEFAULT_FORMATS)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition budget, ms")
    ap.add_argument("--sweep", action="store_true", help="also time a few other block configs")
    ap.add_argument("--no-dequant", action="store_true", help="skip the dequantize+F.linear path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cpu: a smoke run of this tool under TRITON_INTERPRET=1 (timings meaningless)",
    )
    args = ap.parse_args(argv)

    if args.device == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("kernels bench-triton: --device cpu needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
    elif not torch.cuda.is_available():
        print(
            "kernels bench-triton: no CUDA device (torch.cuda.is_available() is False). This "
            "tool times the Triton kernels on a GPU; run it on a CUDA machine. The kernels' "
            "correctness on CPU is covered by tests/unit/test_triton_kernels.py (Triton "
            "interpreter).",
            file=sys.stderr,
        )
        return 2
    from vllm_adaptive.kernels import triton_packed as tp

    if not tp.TRITON_AVAILABLE:
        print("kernels bench-triton: triton is not installed", file=sys.stderr)
        return 2
    import triton

    dev = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    tokens = [int(t) for t in args.tokens.split(",") if t]
    formats = [(f, parse_format(f)) for f in args.formats.split(",") if f]
    torch.manual_seed(args.seed)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        device_info = {
            "device": torch.cuda.get_device_name(dev),
            "sm_count": props.multi_processor_count,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        }
    else:
        device_info = {"device": "cpu (Triton interpreter smoke run; timings meaningless)"}
    result = {
        "tool": "vllm-adaptive kernels bench-triton",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **device_info,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "dtype": args.dtype,
        "timing": (
            "triton.testing.do_bench: CUDA events, L2 flushed before each repetition"
            if dev.type == "cuda"
            else "wall clock, 3 calls (interpreter smoke run)"
        ),
        "args": vars(args),
        "cells": [],
    }
    failures = 0
    rows = []
    for k, n in shapes:
        w = torch.randn(n, k, device=dev) * 0.02
        w_dense = w.to(dtype)
        built = {name: build(tp, w, f) for name, f in formats}
        for m in tokens:
            x = torch.randn(m, k, device=dev).to(dtype)
            io_bytes = x.numel() * x.element_size() + m * n * x.element_size()
            dense_bytes = w_dense.numel() * w_dense.element_size() + io_bytes
            t_lin = bench(lambda x=x, wd=w_dense: F.linear(x, wd), args.warmup, args.rep, dev)
            base = {"k": k, "n": n, "m": m, "dtype": args.dtype}
            dense_cell = {
                **base,
                "format": f"{args.dtype}-dense",
                "path": "linear",
                **t_lin,
                "bytes": dense_bytes,
                "gbps": dense_bytes / t_lin["median_ms"] / 1e6,
            }
            result["cells"].append(dense_cell)
            for name, (f, fn, w_ref, w_bytes, packed) in built.items():
                ref = F.linear(x.float(), w_ref)
                y = fn(x)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                abs_err = float((y.float() - ref).abs().max())
                rel_err = abs_err / float(ref.abs().max())
                ok = rel_err < TOL[dtype] and y.dtype == dtype
                failures += not ok
                cfg = tp.default_config(m, n, k, f["group"] or k, f["group"] is None, dev)
                t = bench(lambda fn=fn, x=x: fn(x), args.warmup, args.rep, dev)
                nbytes = w_bytes + io_bytes
                cell = {
                    **base,
                    "format": name,
                    "path": "triton",
                    **t,
                    "config": dataclasses.asdict(cfg),
                    "max_abs_err": abs_err,
                    "max_rel_err": rel_err,
                    "ok": ok,
                    "bytes": nbytes,
                    "weight_bytes": w_bytes,
                    "gbps": nbytes / t["median_ms"] / 1e6,
                    "speedup_vs_linear": t_lin["median_ms"] / t["median_ms"],
                }
                if args.sweep:
                    best = (t["median_ms"], dataclasses.asdict(cfg))
                    tried = []
                    for alt in sweep_configs(tp, m, n, k, f["group"], dev)[1:]:
                        ya = fn(x, alt)
                        err_a = float((ya.float() - ref).abs().max()) / float(ref.abs().max())
                        ta = bench(
                            lambda fn=fn, x=x, alt=alt: fn(x, alt), args.warmup, args.rep, dev
                        )
                        tried.append(
                            {"config": dataclasses.asdict(alt), **ta, "max_rel_err": err_a}
                        )
                        failures += not err_a < TOL[dtype]
                        if ta["median_ms"] < best[0]:
                            best = (ta["median_ms"], dataclasses.asdict(alt))
                    cell["sweep"] = tried
                    cell["best_ms"], cell["best_config"] = best
                result["cells"].append(cell)
                dq_ms = None
                if not args.no_dequant and packed is not None:
                    td = bench(
                        lambda x=x, p=packed: F.linear(x, dequantize(p, x.dtype)),
                        args.warmup,
                        args.rep,
                        dev,
                    )
                    dq_ms = td["median_ms"]
                    result["cells"].append({**base, "format": name, "path": "dequant", **td})
                rows.append(
                    (
                        k,
                        n,
                        m,
                        name,
                        t_lin["median_ms"],
                        t["median_ms"],
                        dq_ms,
                        cell["gbps"],
                        rel_err,
                        ok,
                    )
                )
                print(
                    f"{k}x{n} M={m} {name}: triton {t['median_ms'] * 1e3:.1f} us "
                    f"({cell['gbps']:.0f} GB/s), linear {t_lin['median_ms'] * 1e3:.1f} us, "
                    f"err {rel_err:.1e}{'' if ok else '  FAIL'}",
                    flush=True,
                )
            del x
        del built, w, w_dense
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    result["failures"] = failures
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    print(f"\n{result['device']}, {versions}, {args.dtype} activations")
    header = ["K x N", "M", "format", "linear us", "triton us", "dequant us", "triton GB/s"]
    header += ["speedup", "max rel err"]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for k, n, m, name, tl_ms, tt_ms, td_ms, gbps, err, ok in rows:
        dq = "" if td_ms is None else f"{td_ms * 1e3:.1f}"
        print(
            f"| {k}x{n} | {m} | {name} | {tl_ms * 1e3:.1f} | {tt_ms * 1e3:.1f} | {dq} "
            f"| {gbps:.0f} | {tl_ms / tt_ms:.2f}x | {err:.1e}{'' if ok else ' FAIL'} |"
        )
    print(f"\nwrote {args.out}; {failures} correctness failure(s)")
    return 1 if failures else 0
