"""Precisions a gear can name, and the three policy levels that map onto them.

A policy outputs a *level*: 0 (low: cheapest), 1 (mid) or 2 (high: most precise), as GEARBX's
low / mid / high gears. Which precision a level means is configuration: GEARBX uses
(int4, int8, full), QuickSilver (int2, int4, int8); a layer group may map the levels its own way.

Precisions:

- ``full``: the layer's own float weight (vLLM's linear, exactly);
- ``fp16``: the weight rounded to float16, float32 activations (FBGEMM's fp16 GEMM);
- ``int8``: int8 weights, float activations (weight-only); on CPUs where the plugin's C++
  kernels run, in groups of ``group_size`` inputs with float16 scales (GGUF's Q8_0), else per row;
- ``w8a8``: int8 weights and int8 activations with one scale per token, optionally smoothed
  (SmoothQuant); the fast int8 path for float32 activations;
- ``w8a16``: the same int8 weights (never smoothed) with activations as two int8 planes per
  token (about 16-bit): weight-only int8 quality on the int8 GEMM, at twice its rows;
- ``int4`` / ``int2``: packed 4- and 2-bit weights, float activations (weight-only).
"""

from __future__ import annotations

from typing import Literal

Precision = Literal["full", "fp16", "w8a16", "int8", "w8a8", "int4", "int2"]
PRECISIONS: tuple[str, ...] = (
    "int2",
    "int4",
    "w8a8",
    "int8",
    "w8a16",
    "fp16",
    "full",
)  # cheapest first
BITS: dict[str, int] = {"int8": 8, "int4": 4, "int2": 2}  # packed integer weights
FLOAT_ACTIVATION_PRECISIONS = ("fp16", "w8a8", "w8a16")  # kernels in kernels/float_linear.py

LOW, MID, HIGH = 0, 1, 2
LEVEL_NAMES = ("low", "mid", "high")

GEARBX_GEARS: tuple[str, str, str] = ("int4", "int8", "full")  # bf16 / fp16 activations
#: float32 activations: weight-only int4 / int8 kernels need bf16 activations to be fast on CPU,
#: W8A8 and fp16 weights have fast float32 kernels (kernels/float_linear.py). The high gear is
#: fp16, not the float32 weight: through `vllm serve` on an AVX2 EPYC its text was identical to
#: stock float32's on every request at 1, 8 and 32 concurrent, at 1.2-1.7x the speed
#: (docs/results.md), so a full-precision high gear only cost time.
GEARBX_GEARS_F32: tuple[str, str, str] = ("w8a8", "fp16", "fp16")
#: float32 activations on a CPU without an int8 dot product (no VNNI, no AMX: AVX2 only): every
#: level fp16. There the W8A8 low gear buys nothing: through `vllm serve` on an AVX2 EPYC
#: (2026-11-27) GEARBX with it ran at 0.94x / 0.97x / 0.95x of the fixed fp16 gear at 1 / 8 / 32
#: requests and changed the text of 1 request in 8 (docs/results.md); oneDNN's and FBGEMM's int8
#: GEMMs saturate without VNNI. One gear at every level means no routing and no entropy pass.
GEARBX_GEARS_F32_NO_INT8_DOT: tuple[str, str, str] = ("fp16", "fp16", "fp16")
#: bf16 / fp16 activations on a CPU with AMX where the plugin's C++ kernels do not run (no
#: compiler, ``ADAPTIVE_NATIVE_KERNELS=off``): the low gear is W8A8 on vLLM's AMX int8 GEMM, a
#: third to a half of stock's bf16 GEMM at 1-32 tokens, mid and high the bf16 weight. Where the
#: kernels run, AMX CPUs take :data:`GEARBX_GEARS_BF16_DOT`: their int8 and 4-bit kernels run
#: bf16 rows on AMX tiles from 3 rows, and through `vllm serve` on an AMX Xeon (2026-12-07,
#: docs/results.md) GEARBX with those gears read 1.21x / 0.96x / 0.88x stock bf16 at 1 / 8 / 32
#: requests, perplexity +0.00%, against 0.94x / 0.93x / 0.90x for these (lossy: W8A8).
GEARBX_GEARS_AMX: tuple[str, str, str] = ("w8a8", "full", "full")
#: bf16 / fp16 activations on a CPU with AVX512-BF16 (no AMX) where the plugin's C++ kernels
#: run: the high gear is int8 in groups of 32 (GGUF's Q8_0), not the bf16 weight, as fp16 is on
#: float32 engines: the native int8 kernel reads half of bf16's bytes, on the bf16 dot product
#: from 2 rows. On an AVX512-BF16 EPYC (2026-12-02, in-process against stock bf16, every gear
#: routed in C++) GEARBX with it read 1.37x / 1.17x at batch 1 / 8 against 1.17x / 0.93x with
#: the full high gear (the fixed int8 gear 1.31x / 1.07x), perplexity +0.00%, teacher-forced
#: agreement 1.000; free-running greedy text 0.70 of stock bf16's, as the fixed int8 gear's
#: (bf16 sums in another order round differently), against 1.00 with the full high gear.
GEARBX_GEARS_BF16_DOT: tuple[str, str, str] = ("int4", "int8", "int8")
#: bf16 / fp16 activations where the plugin's kernels run the bf16 dot product and the
#: checkpoint's weights already lie on a 4-bit grid (a Q4_1 GGUF source, as the default model's:
#: ``kernels.packed.coarse_grid_fraction``): int4 on that grid (asymmetric, groups of 32) gives
#: the weights back, so no other gear is more faithful, and it is the fastest. Through `vllm
#: serve` on an AMX Xeon (2026-12-07, 3 ABBA rounds, docs/results.md) the fixed int4 gear read
#: 1.80x / 1.19x stock bf16 at 1 / 8 requests against the int8 gear's 1.42x / 1.14x, so routing
#: to int8 (:data:`GEARBX_GEARS_BF16_DOT`) only cost time: one gear at every level, no entropy
#: pass.
GEARBX_GEARS_4BIT_GRID: tuple[str, str, str] = ("int4", "int4", "int4")
#: The LM head with those gears: int8 in groups of 32 with float16 scales, GGUF's Q8_0, which
#: such a checkpoint's head usually came from (the default model's tied embedding comes back to
#: the bit); half of bf16's bytes. In the same run: 1.98x / 1.25x stock bf16 with it, against
#: the int4 gear's 1.80x / 1.19x with the bf16 head.
GEARBX_HEAD_4BIT_GRID: tuple[str, str, str] = ("int8", "int8", "int8")
QUICKSILVER_GEARS: tuple[str, str, str] = ("int2", "int4", "int8")


def precision_rank(precision: str) -> int:
    """Order of precisions from cheapest (0) to full (3)."""
    return PRECISIONS.index(precision)
