"""Every packed-weight GEMM path on a CUDA GPU against bf16, inside CUDA graphs and eagerly.

For each shape K x N, token count M and weight format, every path that can run the weight is
checked against the float reference ``F.linear(x.float(), W)`` (max error relative to max
|reference|), then timed two ways:

- ``graph``: ``--calls`` calls captured in one CUDA graph and replayed (vLLM captures decode
  steps, so this is what a served step pays); CUDA events around each replay;
- ``eager``: the same calls launched from Python (host launch overhead included).

The calls rotate over enough copies of the weight (``--rotate-mib`` in all) that each call
streams its weight from HBM rather than L2, as in a forward pass. Paths: ``linear`` (dense
``F.linear`` in the activation dtype: the baseline), ``triton`` (the project's kernel),
``tinygemm`` and ``gemlite`` (the field's, :mod:`vllm_adaptive.kernels.cuda_library`, where
installed). Bandwidth is bytes the kernel must move (weight codes + scales, x, y) over the
median time, also as a fraction of the device-to-device copy bandwidth measured first.

Writes ``gpu-kernels.json`` (device, driver, versions, every cell), ``gpu-kernels.md`` (the
table and the fastest path per format and token count, which is what ``_CUDA_RULES`` in
``kernels/matmul.py`` records) and ``gpu-kernels.png`` into ``--out``.

    vllm-adaptive kernels bench-gpu --out runs/gpu-kernels

Needs a CUDA GPU; exits with status 2 otherwise. Progress goes to stderr, one line per cell.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import importlib.metadata
import importlib.util
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_adaptive.bench.kernels_triton import parse_format
from vllm_adaptive.kernels import cuda_library
from vllm_adaptive.kernels.matryoshka import matryoshka_quantize
from vllm_adaptive.kernels.packed import dequantize, quantize
from vllm_adaptive.kernels.planes import to_planes

SMOL_SHAPES = "576x1536,1536x576,576x576"
LLAMA7B_SHAPES = "4096x4096,4096x11008,11008x4096"
DEFAULT_FORMATS = "int8-row,int4-g128,int4-g32,int4-g128-asym,int2-g32,planes4-g32,planes2-g32"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3}
MAX_COPIES = 64
LINEAR = "linear"
TRITON = "triton"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def copies_for(nbytes: int, rotate_bytes: int) -> int:
    """How many copies of a weight make ``rotate_bytes`` (L2 cannot hold them)."""
    return max(1, min(MAX_COPIES, math.ceil(rotate_bytes / max(nbytes, 1))))


def copy_bandwidth_gbps(device: torch.device, mib: int = 1024, reps: int = 10) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / reps
    return 2 * src.numel() / seconds / 1e9


def _stats(per_call_ms: list[float]) -> dict:
    q = statistics.quantiles(per_call_ms, n=5) if len(per_call_ms) > 1 else per_call_ms * 4
    return {"median_ms": statistics.median(per_call_ms), "p20_ms": q[0], "p80_ms": q[-1]}


def _per_call_ms(launch: Callable[[], None], calls: int, reps: int) -> dict:
    """``reps`` timings (CUDA events) of ``launch``, which issues ``calls`` calls."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return _stats(times)


def _rotate(fns: list[Callable], x: torch.Tensor, calls: int) -> None:
    for i in range(calls):
        fns[i % len(fns)](x)


def time_graph(fns: list[Callable], x: torch.Tensor, calls: int, reps: int) -> dict:
    """Per-call time of ``calls`` calls (rotating over ``fns``) captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (autotuning, lazy layouts) outside the capture
        _rotate(fns, x, len(fns))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _rotate(fns, x, calls)
    graph.replay()
    torch.cuda.synchronize()
    return _per_call_ms(graph.replay, calls, reps)


def time_eager(fns: list[Callable], x: torch.Tensor, calls: int, reps: int) -> dict:
    """Per-call time of the same calls launched from Python."""
    _rotate(fns, x, len(fns))
    torch.cuda.synchronize()
    return _per_call_ms(lambda: _rotate(fns, x, calls), calls, reps)


def build_paths(w: torch.Tensor, spec: dict, dtype: torch.dtype, paths: list[str]) -> dict:
    """path -> (fn(x), float32 reference weight, weight bytes) for every path that runs it."""
    from vllm_adaptive.kernels import triton_packed as tp

    out: dict = {}
    if spec["kind"] == "planes":
        mw = matryoshka_quantize(w, spec["group"], check_double_quant=False)
        planes, bits = to_planes(mw), spec["bits"]
        if TRITON in paths:
            out[TRITON] = (
                lambda x: tp.planes_matmul(x, planes, bits),
                mw.dequantize(bits),
                planes.tier_nbytes(bits),
            )
        return out
    packed = quantize(
        w, spec["bits"], spec["group"], symmetric=spec["symmetric"], check_double_quant=False
    )
    ref, nbytes = dequantize(packed), packed.nbytes
    if TRITON in paths:
        out[TRITON] = (lambda x: tp.packed_matmul(x, packed), ref, nbytes)
    for name in cuda_library.KERNELS:
        if name in paths and cuda_library.runnable(name, packed, dtype):
            out[name] = (cuda_library.kernel(name, packed, dtype), ref, nbytes)
    return out


def device_info(device: torch.device) -> dict:
    props = torch.cuda.get_device_properties(device)
    try:
        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout.strip()
    except OSError:
        smi = ""
    versions = {}
    for pkg in ("torch", "triton", "gemlite"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:  # on the path without metadata
            found = importlib.util.find_spec(pkg) is not None
            module = importlib.import_module(pkg) if found else None
            versions[pkg] = getattr(module, "__version__", "?") if found else None
    return {
        "device": torch.cuda.get_device_name(device),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
        "sm_count": props.multi_processor_count,
        "l2_mib": round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "nvidia_smi": smi,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        **versions,
    }


def fastest(cells: list[dict], mode: str = "graph") -> list[dict]:
    """Per (format, M): each correct path's geometric-mean speedup over ``linear`` across the
    shapes, the fastest first."""
    base = {(c["k"], c["n"], c["m"]): c[mode]["median_ms"] for c in cells if c["path"] == LINEAR}
    groups: dict[tuple[str, int], dict[str, list[float]]] = {}
    for c in cells:
        if c["path"] == LINEAR or not c.get("ok"):
            continue
        b = base.get((c["k"], c["n"], c["m"]))
        if b:
            speed = b / c[mode]["median_ms"]
            groups.setdefault((c["format"], c["m"]), {}).setdefault(c["path"], []).append(speed)
    rows = []
    for (fmt, m), by_path in sorted(groups.items()):
        ranked = sorted(
            ((p, math.exp(statistics.fmean(math.log(s) for s in v))) for p, v in by_path.items()),
            key=lambda t: -t[1],
        )
        rows.append({"format": fmt, "m": m, "ranked": ranked})
    return rows


def markdown(result: dict) -> str:
    d = result["device_info"]
    lines = [
        f"# Packed-weight GEMMs on {d['device']}",
        "",
        f"{result['date']}; driver {d['nvidia_smi']}; torch {d['torch']}, triton {d['triton']}, "
        f"gemlite {d['gemlite']}, CUDA {d['cuda']}; {result['dtype']} activations; "
        f"device-to-device copy {result['copy_gbps']:.0f} GB/s (read + write).",
        "",
        "Speedup = bf16 `F.linear` time / path time (>1: faster than bf16). `graph`: calls "
        "replayed from one CUDA graph; `eager`: launched from Python.",
        "",
        "| K x N | M | format | path | graph us | x bf16 | eager us | x bf16 | GB/s | of copy |"
        " err |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = {(c["k"], c["n"], c["m"]): c for c in result["cells"] if c["path"] == LINEAR}
    for c in result["cells"]:
        b = base[(c["k"], c["n"], c["m"])]
        g, e = c["graph"]["median_ms"], c["eager"]["median_ms"]
        bad = "" if c.get("ok", True) else " FAIL"
        lines.append(
            f"| {c['k']}x{c['n']} | {c['m']} | {c['format']} | {c['path']} | {g * 1e3:.1f} "
            f"| {b['graph']['median_ms'] / g:.2f} | {e * 1e3:.1f} "
            f"| {b['eager']['median_ms'] / e:.2f} | {c['gbps']:.0f} | {c['of_copy']:.2f} "
            f"| {c.get('max_rel_err', 0):.1e}{bad} |"
        )
    lines += ["", "## Fastest path per format and token count (graph, geometric mean over shapes)"]
    lines += ["", "| format | M | ranking (x bf16) |", "| --- | --- | --- |"]
    for row in result["fastest"]:
        ranking = ", ".join(f"{p} {s:.2f}x" for p, s in row["ranked"])
        lines.append(f"| {row['format']} | {row['m']} | {ranking} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["fastest"]
    ms = sorted({r["m"] for r in rows})
    fig, axes = plt.subplots(1, len(ms), figsize=(5 * len(ms), 4.5), squeeze=False)
    for ax, m in zip(axes[0], ms, strict=True):
        labels, values = [], []
        for r in rows:
            if r["m"] != m:
                continue
            for p, s in r["ranked"]:
                labels.append(f"{r['format']}\n{p}")
                values.append(s)
        ax.barh(
            range(len(values)), values, color=["tab:green" if v >= 1 else "tab:red" for v in values]
        )
        ax.set_yticks(range(len(values)), labels, fontsize=6)
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_title(f"M = {m} (CUDA graph)")
        ax.set_xlabel("speedup over bf16 F.linear")
    fig.suptitle(f"{result['device_info']['device']}: packed GEMMs, {result['shapes']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="vllm-adaptive kernels bench-gpu", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--shapes", default=f"{LLAMA7B_SHAPES},{SMOL_SHAPES}", help="KxN list")
    ap.add_argument("--tokens", default="1,8,32")
    ap.add_argument("--formats", default=DEFAULT_FORMATS)
    ap.add_argument("--paths", default="triton,tinygemm,gemlite")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--calls", type=int, default=32, help="calls per graph / timed loop")
    ap.add_argument("--reps", type=int, default=20, help="timed replays per cell")
    ap.add_argument("--rotate-mib", type=int, default=256, help="weight copies rotated, MiB")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels bench-gpu: no CUDA device; run it on a GPU machine", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    paths = [p for p in args.paths.split(",") if p]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    tokens = [int(t) for t in args.tokens.split(",") if t]
    formats = [(f, parse_format(f)) for f in args.formats.split(",") if f]
    torch.manual_seed(args.seed)
    info = device_info(dev)
    copy_gbps = copy_bandwidth_gbps(dev)
    _log(
        f"{info['device']}: copy {copy_gbps:.0f} GB/s; torch {info['torch']}, "
        f"triton {info['triton']}, gemlite {info['gemlite']}"
    )
    cells: list[dict] = []
    errors: list[dict] = []
    build_seconds: dict[str, float] = {}
    rotate = args.rotate_mib << 20

    def write() -> dict:
        """The report so far (after every shape, so a run cut short keeps what it measured)."""
        result = {
            "tool": "vllm-adaptive kernels bench-gpu",
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "device_info": info,
            "copy_gbps": copy_gbps,
            "dtype": args.dtype,
            "shapes": args.shapes,
            "args": {k: str(v) for k, v in vars(args).items()},
            "timing": "CUDA events; graph: one replay of --calls calls; eager: a Python loop",
            "build_seconds": build_seconds,
            "cells": cells,
            "errors": errors,
            "fastest": fastest(cells),
            "fastest_eager": fastest(cells, "eager"),
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu-kernels.json").write_text(json.dumps(result, indent=1))
        (args.out / "gpu-kernels.md").write_text(markdown(result))
        return result

    t_start = time.perf_counter()
    for k, n in shapes:
        w = torch.randn(n, k, device=dev) * 0.02
        dense_bytes = n * k * torch.finfo(dtype).bits // 8
        dense = [w.to(dtype) for _ in range(copies_for(dense_bytes, rotate))]
        variants = {LINEAR: ([lambda x, d=d: F.linear(x, d) for d in dense], None, dense_bytes)}
        for name, spec in formats:
            t0 = time.perf_counter()
            first = build_paths(w, spec, dtype, paths)
            for path, (fn, ref, nbytes) in first.items():
                fns = [fn] + [
                    build_paths(w, spec, dtype, [path])[path][0]
                    for _ in range(copies_for(nbytes, rotate) - 1)
                ]
                variants[(name, path)] = (fns, ref, nbytes)
            build_seconds[f"{k}x{n} {name}"] = time.perf_counter() - t0
        for m in tokens:
            x = torch.randn(m, k, device=dev).to(dtype)
            io = (m * k + m * n) * x.element_size()
            for key, (fns, ref, nbytes) in variants.items():
                fmt, path = (f"{args.dtype}-dense", LINEAR) if key == LINEAR else key
                cell = {
                    "k": k,
                    "n": n,
                    "m": m,
                    "format": fmt,
                    "path": path,
                    "copies": len(fns),
                    "weight_bytes": nbytes,
                }
                try:
                    if ref is not None:
                        y = fns[0](x)
                        want = F.linear(x.float(), ref)
                        err = float((y.float() - want).abs().max() / want.abs().max())
                        cell.update(max_rel_err=err, ok=bool(err < TOL[dtype]) and y.dtype == dtype)
                    t0 = time.perf_counter()
                    cell["graph"] = time_graph(fns, x, args.calls, args.reps)
                    cell["capture_s"] = time.perf_counter() - t0
                    cell["eager"] = time_eager(fns, x, args.calls, args.reps)
                except Exception as exc:  # a kernel that cannot run here is a row, not a crash
                    cell.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
                    errors.append(cell)
                    _log(f"{k}x{n} M={m} {fmt} {path}: ERROR {cell['error']}")
                    continue
                cell["gbps"] = (nbytes + io) / cell["graph"]["median_ms"] / 1e6
                cell["of_copy"] = cell["gbps"] / copy_gbps
                cells.append(cell)
                _log(
                    f"[{time.perf_counter() - t_start:6.0f}s] {k}x{n} M={m} {fmt:>16} "
                    f"{path:>8}: graph {cell['graph']['median_ms'] * 1e3:7.1f} us, eager "
                    f"{cell['eager']['median_ms'] * 1e3:7.1f} us, {cell['gbps']:5.0f} GB/s"
                    + ("" if cell.get("ok", True) else f"  WRONG err {cell['max_rel_err']:.1e}")
                )
        del variants, dense, w
        torch.cuda.empty_cache()
        result = write()
    try:
        plot(result, args.out / "gpu-kernels.png")
    except ImportError:
        _log("matplotlib missing: no PNG")
    print(markdown(result))
    wrong = [c for c in cells if c.get("ok") is False]
    return 1 if wrong or errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
