"""What one linear of the default model costs on MLX's device here: dense against packed.

Times ``x @ W^T`` and ``mx.quantized_matmul`` (int8 / int4, groups of 32 and 64, MLX's affine
format) for SmolLM2-135M's linear shapes at 1 and 8 tokens, in float32 and bfloat16, plus the LM
head. This is why the MLX bench runs float32 on a CPU: MLX's CPU quantized kernels are on par with
its dense float32 GEMV but many times slower than everything else with bfloat16 activations.

    python docs/experiments/mlx_matmul_cost.py --json docs/data/mlx-cpu-matmul.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SHAPES = {
    "qkv (576->960)": (960, 576),
    "gate/up (576->1536)": (1536, 576),
    "down (1536->576)": (576, 1536),
    "lm head (576->49152)": (49152, 576),
}


def _time(fn, repeats: int) -> float:
    import mlx.core as mx

    mx.eval(fn())
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeats):
            mx.eval(fn())
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best * 1e6


def main() -> int:
    import mlx.core as mx

    from vllm_adaptive.bench.env import cpu_info, versions

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", required=True)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    rows = []
    for dtype in ("float32", "bfloat16"):
        dt = getattr(mx, dtype)
        for name, (n, k) in SHAPES.items():
            w = (mx.random.normal((n, k)) * 0.05).astype(dt)
            for m in (1, 8):
                x = mx.random.normal((m, k)).astype(dt)
                row = {
                    "dtype": dtype,
                    "shape": name,
                    "tokens": m,
                    "dense_us": _time(lambda x=x, w=w: x @ w.T, args.repeats),
                }
                for bits, g in ((8, 32), (4, 32), (4, 64)):
                    wq, s, b = mx.quantize(w, group_size=g, bits=bits)
                    row[f"int{bits}_g{g}_us"] = _time(
                        lambda x=x, q=(wq, s, b), g=g, bits=bits: mx.quantized_matmul(
                            x, *q, group_size=g, bits=bits
                        ),
                        args.repeats,
                    )
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = {
        "device": str(mx.default_device()),
        "cpu": cpu_info(),
        "versions": versions("mlx", "mlx-cpu", "mlx-lm"),
        "rows": rows,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
