"""A whole decode step's linears (the default model's 30 layers and its LM head, weights cold)
on the int8 g32 and 4-bit g32 kernels' AMX tiles and their vdpbf16ps loops, and torch's bf16
GEMM on the unpacked weight (not vLLM's prepacked oneDNN handle), one thread, at 1-64 rows:
where the tiles start paying.

    PYTHONPATH=. .venv/bin/python docs/experiments/amx_step.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from vllm_adaptive.kernels import native
from vllm_adaptive.kernels.autotune import cpu_info
from vllm_adaptive.kernels.packed import quantize

LAYERS = 30
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)
ROWS = (1, 2, 3, 4, 8, 16, 32, 64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    default_rows = native.amx_rows()
    assert default_rows >= 0, "no AMX-BF16 here"
    pack, run = native.int8_linear_ops()
    pack4, run4 = native.int4_linear_ops()
    g = torch.Generator().manual_seed(0)
    weights = []  # (bf16 weight, int8 layout, 4-bit layout, n) in a step's order
    shapes = [s for _ in range(LAYERS) for s in SHAPES.values()] + [HEAD]
    for n, k in shapes:
        w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
        p = quantize(w.float(), 8, 32)
        p4 = quantize(w.float(), 4, 32, symmetric=False)
        layout4 = pack4(p4.codes(), p4.scales.float(), p4.offsets.float())
        weights.append((w, pack(p.codes(), p.scales.float().t().contiguous()), layout4, n))
    flush = torch.empty(64 << 20, dtype=torch.uint8)

    def step(path: str, x: dict[int, torch.Tensor]) -> None:
        for w, layout, layout4, n in weights:
            xi = x[w.shape[1]]
            if path == "bf16":
                F.linear(xi, w)
            elif path.startswith("int4"):
                run4(xi, *layout4, n)
            else:
                run(xi, *layout, n)

    out = {
        "machine": cpu_info(),
        "note": "bf16: torch's F.linear on unpacked bf16 weights, "
        "not vLLM's prepacked oneDNN handle",
        "ms": {},
    }
    for m in ROWS:
        x = {k: torch.randn(m, k, generator=g).bfloat16() for k in (576, 1536)}
        row = {}
        for path in ("bf16", "loop", "amx", "int4 loop", "int4 amx"):
            native.amx_rows(1 if path.endswith("amx") else 0)
            step(path, x)
            times = []
            for _ in range(args.repeats):
                flush.add_(1)  # evict the weights (a step reads them from memory)
                t0 = time.perf_counter()
                step(path, x)
                times.append((time.perf_counter() - t0) * 1e3)
            row[path] = statistics.median(times)
        native.amx_rows(default_rows)
        out["ms"][m] = row
        print(
            f"rows {m:>2}: bf16 {row['bf16']:6.1f} ms  int8 loop {row['loop']:6.1f}  "
            f"int8 amx {row['amx']:6.1f}  int4 loop {row['int4 loop']:6.1f}  "
            f"int4 amx {row['int4 amx']:6.1f}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
