"""The fp16 gear's linears as a decode step reads them: every weight of the model once, cold.

A kernel table that calls one linear again and again measures it with its weight in cache; a
served decode step reads 270 MB of fp16 weights (30 layers' qkv / o / gate_up / down and the LM
head of SmolLM2-135M) once, from memory. This times a whole step's worth of linears at 1 to 8
rows on one thread, FBGEMM's fp16 GEMM against the plugin's ``native_fp16`` kernel, the kernels
interleaved per round, and the machine's single-thread read bandwidth for scale.

    .venv/bin/python docs/experiments/fp16_stream.py --rounds 5 --out docs/data/fp16-stream-icx.json
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
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import torch

    from vllm_adaptive.bench.bandwidth import stream_bandwidth
    from vllm_adaptive.bench.machine import cpuinfo
    from vllm_adaptive.kernels.float_linear import Fp16Weight

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    shapes = [s for _ in range(args.layers) for s in LAYER] + [HEAD]
    weights = [Fp16Weight.from_float(torch.randn(s, generator=gen) * 0.02) for s in shapes]
    kernels = ("fbgemm_fp16", "native_fp16")
    calls = {k: [(w.bind(k), w.shape[1]) for w in weights] for k in kernels}
    for w in weights:
        w.weight = w.weight[:0]  # only the kernels' layouts stay resident
    mb = sum(n * k for n, k in shapes) * 2 / 1e6
    xs = {m: {k: torch.randn(m, k, generator=gen) for k in (576, 1536)} for m in args.rows}

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
        row = {"rows": m}
        for kernel in kernels:
            ms = 1e3 * statistics.median(times[kernel][m])
            row[kernel] = {"ms": round(ms, 2), "gb_s": round(mb / ms, 2)}
        row["native_speedup"] = round(row["fbgemm_fp16"]["ms"] / row["native_fp16"]["ms"], 3)
        rows.append(row)
        print(
            f"{m} rows: FBGEMM {row['fbgemm_fp16']['ms']:.1f} ms "
            f"({row['fbgemm_fp16']['gb_s']:.1f} GB/s), native {row['native_fp16']['ms']:.1f} ms "
            f"({row['native_fp16']['gb_s']:.1f} GB/s): {row['native_speedup']:.2f}x"
        )
    print(f"single-thread read bandwidth {bw['read_gbs']:.1f} GB/s (triad {bw['triad_gbs']:.1f})")
    if args.out:
        machine = cpuinfo()
        machine.pop("cpu_flags", None)
        out = {
            "machine": machine | {"torch": torch.__version__, "threads": 1},
            "weights_mb": round(mb, 1),
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
