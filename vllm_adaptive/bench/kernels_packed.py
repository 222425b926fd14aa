"""Time every matmul path for packed weights against the plain float ``F.linear``.

For each shape K x N (inputs x outputs), token count and activation dtype, and for each weight
format (int8 per-row, int4 / int2 group-wise ...), runs every path
``vllm_adaptive.kernels.matmul.applicable_paths`` lists (forced with ``matmul(..., path=)``,
layouts prepared beforehand, as in serving) plus the dense baselines:

- ``linear``: ``F.linear(x, W)`` with W in x's dtype (what an unquantized model does);
- ``linear_f32`` (bf16 only): ``F.linear(x.float(), W_fp32).to(bf16)``.

Each path is checked once against ``F.linear(x.float(), dequantize(packed))`` before timing.
Writes a JSON of all timings (median, p10, p90, repetitions) and prints a markdown table.

    vllm-adaptive kernels bench-packed --json docs/data/packed-kernels-bench.json   # full grid
    vllm-adaptive kernels bench-packed --shapes 576x1536 --tokens 1,16 --dtypes bf16

Threads default to 1: vLLM runs torch with one thread per worker on the 2-core CI machines.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_adaptive.kernels.matmul import applicable_paths, family, matmul, prepare
from vllm_adaptive.kernels.packed import PackedWeight, dequantize, quantize

DEFAULT_SHAPES = "576x1536,1536x576,576x576,576x192,4096x4096,4096x11008"
DEFAULT_TOKENS = "1,2,4,8,16,32"
DEFAULT_FORMATS = "int8-row,int4-g32,int2-g32"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def parse_format(spec: str) -> dict:
    """``int4-g32``, ``int8-row``, ``int4-g32-asym`` -> quantize() keyword arguments."""
    parts = spec.split("-")
    if len(parts) not in (2, 3) or not parts[0].startswith("int"):
        raise ValueError(f"bad format {spec!r}: want int<bits>-<row|g<size>>[-asym]")
    bits = int(parts[0][3:])
    group = None if parts[1] == "row" else int(parts[1].lstrip("g"))
    sym = not (len(parts) == 3 and parts[2] == "asym")
    return {"bits": bits, "group_size": group, "symmetric": sym}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                keep = ("avx", "fma", "amx", "vnni", "f16c")
                return sorted(f for f in flags if f.startswith(keep))
    except OSError:
        pass
    return []


def clone_packed(p: PackedWeight) -> PackedWeight:
    """An independent copy (own storage, empty prepared cache)."""
    off = None if p.offsets is None else p.offsets.clone()
    return PackedWeight(
        p.bits, p.group_size, p.data.clone(), p.scales.clone(), off, p.shape, p.scheme
    )


def time_fn(fn, min_time: float, min_reps: int, max_reps: int) -> dict:
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    if first < 0.05:
        fn()  # second warm-up for fast calls (allocator, caches)
    times: list[float] = []
    deadline = time.perf_counter() + min_time
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() < deadline):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
    return {
        "median_us": statistics.median(times) * 1e6,
        "p10_us": q[0] * 1e6,
        "p90_us": q[-1] * 1e6,
        "reps": len(times),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="vllm-adaptive kernels bench-packed",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="K x N list (inputs x outputs)")
    ap.add_argument("--tokens", default=DEFAULT_TOKENS)
    ap.add_argument("--dtypes", default="bf16,fp32", help="activation dtypes: bf16,fp32,fp16")
    ap.add_argument("--formats", default=DEFAULT_FORMATS, help="int<bits>-<row|gN>[-asym]")
    ap.add_argument(
        "--skip-paths",
        default="int8pack_f32,int4pack_f32",
        help="paths not to time (default: the float32-activation kernels, measured 6-55x "
        "slower than their bf16 versions on the project's AVX2 CPU); '' times all",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--min-time", type=float, default=0.1, help="seconds per measurement")
    ap.add_argument("--min-reps", type=int, default=3)
    ap.add_argument("--max-reps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cold-mb",
        type=float,
        default=0.0,
        help="if > 0, rotate each call over enough copies of the weight to exceed this many "
        "MiB, so weights come from DRAM as in a real forward pass (L3 here: 32 MiB). "
        "Default 0: one weight, cache-resident when it fits",
    )
    ap.add_argument("--json", default=None, help="write every timing here (JSON)")
    ap.add_argument("--markdown", default=None, help="also write the markdown table here")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    tokens_list = [int(t) for t in args.tokens.split(",")]
    dtypes = [(name, DTYPES[name]) for name in args.dtypes.split(",")]
    formats = [(f, parse_format(f)) for f in args.formats.split(",")]
    skip = {s for s in args.skip_paths.split(",") if s}

    def paths_for(p, dt):
        return [q for q in applicable_paths(p, dt, torch.device("cpu")) if q not in skip]

    meta = {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "logical_cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:] if argv is None else argv,
        "min_time_s": args.min_time,
        "skipped_paths": sorted(skip),
        "cold_mb": args.cold_mb,
    }
    print(
        f"# {meta['cpu']} ({meta['torch_cpu_capability']}), {meta['threads']} thread(s), "
        f"torch {meta['torch']}",
        file=sys.stderr,
    )

    # how many measurements, for progress
    total = 0
    plan = []
    for k, n in shapes:
        for _fname, fkw in formats:
            probe = quantize(torch.zeros(n, k) + 1e-3, check_double_quant=False, **fkw)
            for _dn, dt in dtypes:
                total += len(tokens_list) * len(paths_for(probe, dt))
        for _dn, dt in dtypes:
            total += len(tokens_list) * (2 if dt != torch.float32 else 1)
        plan.append((k, n))

    results: list[dict] = []
    done = 0
    started = time.perf_counter()

    def progress(label: str, r: dict) -> None:
        nonlocal done
        done += 1
        el = time.perf_counter() - started
        print(
            f"[{done}/{total} {el:6.1f}s] {label}: {r['median_us']:.1f} us ({r['reps']} reps)",
            file=sys.stderr,
            flush=True,
        )

    def n_copies(nbytes: int) -> int:
        if args.cold_mb <= 0:
            return 1
        return max(1, math.ceil(args.cold_mb * 2**20 / nbytes))

    def rotating(fns):
        if len(fns) == 1:
            return fns[0]
        it = itertools.cycle(fns)
        return lambda: next(it)()

    def packed_copies(p):
        c = n_copies(p.nbytes)
        return [p] + [clone_packed(p) for _ in range(c - 1)]

    for k, n in plan:
        w32 = torch.randn(n, k) * 0.02
        dense = {}
        for _dn, dt in dtypes:
            wd = w32.to(dt)
            dense[dt] = [wd] + [
                wd.clone() for _ in range(n_copies(wd.numel() * wd.element_size()) - 1)
            ]
        if any(dt != torch.float32 for _dn, dt in dtypes):
            dense.setdefault(
                torch.float32, [w32] + [w32.clone() for _ in range(n_copies(w32.numel() * 4) - 1)]
            )
        packed_by_fmt = {}
        for fname, fkw in formats:
            t0 = time.perf_counter()
            p = quantize(w32, check_double_quant=False, **fkw)
            tq = time.perf_counter() - t0
            packed_by_fmt[fname] = (p, tq, packed_copies(p))
        for dname, dt in dtypes:
            for t in tokens_list:
                x = torch.randn(t, k).to(dt)
                base = {"K": k, "N": n, "tokens": t, "dtype": dname}
                r = time_fn(
                    rotating([lambda x=x, wd=wd: F.linear(x, wd) for wd in dense[dt]]),
                    args.min_time,
                    args.min_reps,
                    args.max_reps,
                )
                results.append({**base, "format": "dense", "path": "linear", **r})
                progress(f"{k}x{n} t={t} {dname} dense linear", r)
                if dt != torch.float32:
                    r = time_fn(
                        rotating(
                            [
                                lambda x=x, w=w: F.linear(x.float(), w).to(x.dtype)
                                for w in dense[torch.float32]
                            ]
                        ),
                        args.min_time,
                        args.min_reps,
                        args.max_reps,
                    )
                    results.append({**base, "format": "dense", "path": "linear_f32", **r})
                    progress(f"{k}x{n} t={t} {dname} dense linear_f32", r)
                for fname, (p, tq, pcopies) in packed_by_fmt.items():
                    ref = F.linear(x.float(), dequantize(p, torch.float32))
                    scale = float(ref.abs().max()) or 1.0
                    for path in paths_for(p, dt):
                        t0 = time.perf_counter()
                        prepare(p, dt, path)
                        tprep = time.perf_counter() - t0
                        y = matmul(x, p, path=path)
                        err = float((y.float() - ref).abs().max()) / scale
                        if err > TOL[dt]:
                            raise SystemExit(
                                f"{fname} {path} {dname} {k}x{n} t={t}: "
                                f"relative error {err:.2e} > {TOL[dt]:.0e}"
                            )
                        for pc in pcopies:
                            prepare(pc, dt, path)
                        r = time_fn(
                            rotating(
                                [
                                    lambda x=x, pc=pc, path=path: matmul(x, pc, path=path)
                                    for pc in pcopies
                                ]
                            ),
                            args.min_time,
                            args.min_reps,
                            args.max_reps,
                        )
                        results.append(
                            {
                                **base,
                                "format": fname,
                                "family": family(p),
                                "path": path,
                                "rel_err": err,
                                "prepare_s": tprep,
                                "quantize_s": tq,
                                "copies": len(pcopies),
                                **r,
                            }
                        )
                        progress(f"{k}x{n} t={t} {dname} {fname} {path}", r)
    meta["wall_s"] = time.perf_counter() - started
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    md = markdown(meta, results)
    print(md)
    if args.markdown:
        Path(args.markdown).write_text(md)
    return 0


def markdown(meta: dict, results: list[dict]) -> str:
    """One table per (activation dtype, format): median microseconds per path."""
    cold = meta.get("cold_mb", 0)
    where = (
        f"weights rotated over > {cold:g} MiB of copies (DRAM-resident)"
        if cold
        else "one weight per shape (cache-resident when it fits in L3)"
    )
    lines = [
        f"CPU: {meta['cpu']} ({meta['torch_cpu_capability']}), threads: {meta['threads']}, "
        f"torch {meta['torch']}, {meta['date']}; {where}. Median microseconds per call; "
        "`best/linear` = the dense `F.linear` time in the activation dtype divided by the best "
        "packed path's time (>1: packed is faster).",
        "",
    ]
    index: dict[tuple, float] = {}
    for r in results:
        index[(r["K"], r["N"], r["tokens"], r["dtype"], r["format"], r["path"])] = r["median_us"]
    dtypes = list(dict.fromkeys(r["dtype"] for r in results))
    formats = list(dict.fromkeys(r["format"] for r in results if r["format"] != "dense"))
    shapes = list(dict.fromkeys((r["K"], r["N"]) for r in results))
    tokens = sorted({r["tokens"] for r in results})
    for dname in dtypes:
        for fname in formats:
            paths = list(
                dict.fromkeys(
                    r["path"] for r in results if r["dtype"] == dname and r["format"] == fname
                )
            )
            dense_paths = ["linear"] + (["linear_f32"] if dname != "fp32" else [])
            lines.append(f"### {fname}, {dname} activations")
            lines.append("")
            head = ["K x N", "tokens", *dense_paths, *paths, "best", "best/linear"]
            lines.append("| " + " | ".join(head) + " |")
            lines.append("|" + " --- |" * len(head))
            for k, n in shapes:
                for t in tokens:
                    row = [f"{k}x{n}", str(t)]
                    for dp in dense_paths:
                        v = index.get((k, n, t, dname, "dense", dp))
                        row.append("-" if v is None else f"{v:.0f}")
                    vals = {}
                    for p in paths:
                        v = index.get((k, n, t, dname, fname, p))
                        vals[p] = v
                        row.append("-" if v is None else f"{v:.0f}")
                    got = {p: v for p, v in vals.items() if v is not None}
                    lin = index.get((k, n, t, dname, "dense", "linear"))
                    if got and lin:
                        best = min(got, key=got.get)
                        row += [best, f"{lin / got[best]:.2f}x"]
                    else:
                        row += ["-", "-"]
                    lines.append("| " + " | ".join(row) + " |")
            lines.append("")
    return "\n".join(lines)
