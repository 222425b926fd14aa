"""A gear's linears as a decode step reads them: every weight of the model once, cold.

A kernel table that calls one linear again and again measures it with its weight in cache; a
served decode step reads 270 MB of fp16 weights (30 layers' qkv / o / gate_up / down and the LM
head of SmolLM2-135M) once, from memory. This times a whole step's worth of linears at 1 to 8
rows on one thread, per ``format:kernel`` (by default FBGEMM's fp16 GEMM against the plugin's
``native_fp16`` kernel; ``w8a16:native_int8`` / ``w8a16:onednn`` for int8 weights,
``int4:native_int4`` for 4-bit group-32 asymmetric ones, the default model's grid,
``int8g:native_int8`` for the int8 gear's symmetric group-32 tier;
``dense:linear`` is F.linear on the weight in the activations' dtype, ``dense:onednn`` stock
vLLM's own CPU GEMM on CPUs without AMX), the kernels
interleaved per round, and the machine's single-thread read bandwidth for scale. Speed-ups are
over the first kernel named. ``--dtype bfloat16`` times a bf16 engine's step: packed formats
take bf16 rows on their bf16 paths (``int4:int4pack``, ``int4:native_int4``), float32-only
kernels get their rows cast to float32 and back, as the plugin's geared linear does.

    .venv/bin/python docs/experiments/fp16_stream.py --rounds 5 --out docs/data/fp16-stream-icx.json
    .venv/bin/python docs/experiments/fp16_stream.py --kernels fp16:native_fp16 \
        w8a16:native_int8 w8a16:onednn int4:native_int4 --out docs/data/lowbit-stream-icx.json
    .venv/bin/python docs/experiments/fp16_stream.py --dtype bfloat16 --kernels dense:linear \
        int4:int4pack int4:native_int4 w8a16:native_int8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

#: (out_features, in_features) of one SmolLM2-135M decoder layer's linears, then its LM head
LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))
HEAD = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per kernel, row count, round")
    ap.add_argument(
        "--kernels",
        nargs="+",
        default=["fp16:fbgemm_fp16", "fp16:native_fp16"],
        help="format:kernel pairs, the first is the reference of the speed-ups",
    )
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import torch

    from vllm_adaptive.bench.bandwidth import stream_bandwidth
    from vllm_adaptive.bench.machine import cpuinfo
    from vllm_adaptive.engine import kernel_ops
    from vllm_adaptive.kernels.matmul import bound_kernel
    from vllm_adaptive.kernels.packed import quantize
    from vllm_adaptive.kernels.weights import quantize_weight

    kernel_ops.provide()  # vLLM's oneDNN int8 GEMM for w8a16:onednn
    import torch.nn.functional as F
    from vllm import _custom_ops as vllm_ops

    torch.set_num_threads(1)
    act = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    shapes = [s for _ in range(args.layers) for s in LAYER] + [HEAD]
    kernels = list(args.kernels)
    formats = sorted({k.split(":")[0] for k in kernels})
    calls: dict[str, list] = {k: [] for k in kernels}
    for shape in shapes:
        w32 = torch.randn(shape, generator=gen) * 0.02
        for fmt in formats:
            if fmt == "dense":
                w = w32.to(act)
                for k in kernels:
                    if k == "dense:linear":
                        calls[k].append((lambda x, w=w: F.linear(x, w), shape[1]))
                    elif k == "dense:onednn":  # stock vLLM's CPU GEMM without AMX
                        h = vllm_ops.create_onednn_mm(w.t(), 32)
                        calls[k].append((lambda x, h=h: vllm_ops.onednn_mm(h, x, None), shape[1]))
                continue
            if fmt == "int8g":  # the int8 gear's tier: symmetric in groups of 32 (Q8_0)
                w = quantize(w32, 8, 32, symmetric=True, check_double_quant=False)
            else:
                w = quantize_weight(w32, fmt, 32, symmetric=False)  # int4: the Q4_1 grid
            for k in kernels:
                if k.startswith(fmt + ":"):
                    name = k.split(":")[1]
                    if not hasattr(w, "bind"):  # a packed weight: its path for these rows
                        fn = bound_kernel(w, name, act)
                    elif act == torch.float32:
                        fn = w.bind(name)
                    else:  # float32-only kernels on a bf16 engine: rows cast in and out
                        fn = (lambda f: lambda x: f(x.float()).to(act))(w.bind(name))
                    calls[k].append((fn, shape[1]))
    params = sum(n * k for n, k in shapes)
    # int4: codes, float32 scale and offset; dense: the activations' dtype
    per_param = {"fp16": 2.0, "int4": 0.5 + 8 / 32, "int8g": 1 + 2 / 32, "dense": act.itemsize}
    mb = {k: params * per_param.get(k.split(":")[0], 1.0) / 1e6 for k in kernels}
    xs = {m: {k: torch.randn(m, k, generator=gen).to(act) for k in (576, 1536)} for m in args.rows}

    def step(kernel: str, m: int) -> float:
        t0 = time.perf_counter()
        for fn, k in calls[kernel]:
            fn(xs[m][k])
        return time.perf_counter() - t0

    times: dict[str, dict[int, list[float]]] = {k: {m: [] for m in args.rows} for k in kernels}
    for r in range(args.rounds):
        order = kernels if r % 2 == 0 else kernels[::-1]
        for m in args.rows:
            for kernel in order:
                step(kernel, m)  # warm-up: page faults, lazily packed layouts
                times[kernel][m] += [step(kernel, m) for _ in range(args.steps)]
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    bw = stream_bandwidth()
    rows = []
    for m in args.rows:
        row: dict = {"rows": m}
        for kernel in kernels:
            ms = 1e3 * statistics.median(times[kernel][m])
            row[kernel] = {"ms": round(ms, 2), "gb_s": round(mb[kernel] / ms, 2)}
        for kernel in kernels[1:]:
            row[kernel]["speedup"] = round(row[kernels[0]]["ms"] / row[kernel]["ms"], 3)
        rows.append(row)
        print(
            f"{m} rows: "
            + ", ".join(
                f"{k} {row[k]['ms']:.1f} ms ({row[k]['gb_s']:.1f} GB/s"
                + (f", {row[k]['speedup']:.2f}x" if "speedup" in row[k] else "")
                + ")"
                for k in kernels
            )
        )
    print(f"single-thread read bandwidth {bw['read_gbs']:.1f} GB/s (triad {bw['triad_gbs']:.1f})")
    if args.out:
        machine = cpuinfo()
        machine.pop("cpu_flags", None)
        out = {
            "machine": machine | {"torch": torch.__version__, "threads": 1},
            "activations": args.dtype,
            "weights_mb": {k: round(v, 1) for k, v in mb.items()},
            "layers": args.layers,
            "rounds": args.rounds,
            "steps_per_cell": args.rounds * args.steps,
            "bandwidth": bw,
            "rows": rows,
        }
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
