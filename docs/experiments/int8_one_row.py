"""The int8 g32 kernel at one row, where a decode step at one request spends most of its weight
time: the default model's 30 layers and its LM head (151 MB of codes and scales) with the
weights cold, as bf16 rows (the vdpbf16ps loop) and float32 rows, one thread; the same number of
calls with one layer's weights cache-resident (the loop's compute alone) and with a tiny layer
(the calls' own cost). Compare with `docs/experiments/stream_probe.c` (what one core streams).

    PYTHONPATH=. .venv/bin/python docs/experiments/int8_one_row.py
"""

from __future__ import annotations

import statistics
import time

import torch

from vllm_adaptive.kernels import native
from vllm_adaptive.kernels.packed import quantize

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def median_ms(fn, repeats: int, before=None) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    native.amx_rows(0)  # one row runs the loop anyway; keep 2+ rows off the tiles too
    pack, run = native.int8_linear_ops()
    g = torch.Generator().manual_seed(0)
    layers = []
    for n, k in SHAPES:
        p = quantize(torch.randn(n, k, generator=g) * 0.05, 8, 32)
        layers.append((pack(p.codes(), p.scales.float().t().contiguous()), n, k))
    nbytes = sum(t.numel() * t.element_size() for layout, _, _ in layers for t in layout)
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    print(f"{len(layers)} calls, {nbytes / 1e6:.1f} MB of codes and scales")
    for dtype in (torch.bfloat16, torch.float32):
        x = {k: torch.randn(1, k, generator=g).to(dtype) for k in (576, 1536)}

        def step(ls=layers, x=x):
            for layout, n, k in ls:
                run(x[k], *layout, n)

        cold = median_ms(step, 9, before=lambda: flush.add_(1))
        hot = median_ms(lambda: step(layers[:4] * 30 + layers[:1]), 20)
        print(
            f"{str(dtype).removeprefix('torch.'):>8} rows: cold {cold:5.2f} ms "
            f"({nbytes / cold / 1e6:4.1f} GB/s); the same calls on cache-resident weights "
            f"{hot:5.2f} ms"
        )
    p = quantize(torch.randn(32, 64, generator=g), 8, 32)
    tiny, xs = pack(p.codes(), p.scales.float().t().contiguous()), torch.randn(1, 64).bfloat16()
    calls = median_ms(lambda: [run(xs, *tiny, 32) for _ in layers], 20)
    print(f"{len(layers)} calls of a 32 x 64 layer: {calls:.2f} ms")


if __name__ == "__main__":
    main()
