"""``matmul(x, packed)``: ``x @ W^T`` for a :class:`PackedWeight`, on the fastest correct path.

Paths (names are what :func:`choose_path` returns and what ``path=`` forces):

- ``int8pack``: ``aten._weight_int8pack_mm`` (int8 codes, one scale per output row), in x's dtype.
  Needs bits=8, per-row, symmetric.
- ``int8pack_f32``: the same kernel on ``x.float()`` with float32 scales, cast back.
- ``int4pack``: ``aten._weight_int4pack_mm_for_cpu`` on the layout made by
  ``aten._convert_weight_to_int4pack_for_cpu``; it computes ``(q - 8) * scale + zero`` per group
  of 32/64/128/256 inputs, which covers int4 and int2 codes (int2 codes are int4 codes in
  [-2, 1]), symmetric (zero = 0), asymmetric (zero = offset) and the Matryoshka tiers
  (zero = half a step); per-row scales are repeated over the largest such group dividing K.
  Needs bits 4 or 2, N a multiple of 16 and K a multiple of 32. Scales must be in x's dtype.
- ``int4pack_f32``: the same on ``x.float()``, cast back.
- ``native_int4``: the plugin's C++ kernel for float32 and bf16 activations (bf16 rows on
  AVX512-BF16's dot product where the CPU has it) (``csrc/int4_linear.cpp``):
  the int4 / int2 codes with their group scales and offsets streamed once for up to 8 rows
  (a decode step's), an L1-resident block re-read for more (a prompt's). Needs the native
  kernels built (AVX2 / FMA); where they are not, its rules fall back to ``dequant_f32``.
- ``native_int8``: the plugin's C++ kernel for int8 codes with one scale per output row or per
  group of K (``csrc/int8_linear.cpp``), float32 and bf16 rows (bf16 on AVX512-BF16's dot
  product where the CPU has it, else cast in and out), the codes streamed once for up to 8
  rows. Symmetric int8 only; needs the native kernels built.
- ``dequant``: ``F.linear(x, dequantize(packed, x.dtype))``: always correct, any device; the
  reference and the fallback.
- ``triton``: the project's Triton kernel (:mod:`vllm_adaptive.kernels.triton_packed`), reading
  the packed storage directly (every format: int8 / int4 / int2, symmetric or asymmetric, per-row
  or group-wise), fp16 / bf16 / fp32 activations. CUDA devices only, when triton is installed and
  ``torch.cuda.is_available()``.
- ``tinygemm``, ``gemlite``: the field's kernels on CUDA (torch's int4 tinygemm, GemLite),
  registered in :mod:`vllm_adaptive.kernels.cuda_library` with what each can run.
- ``dequant_f32``: float32 compute, the weight dequantized in row chunks of at most
  ``DEQUANT_CHUNK_BYTES`` into a reused float32 buffer, each chunk multiplied (``torch.mm``) as
  soon as it is made; the result is cast to x's dtype. Chunking is what makes it usable on large
  matrices: a whole 4096 x 4096 float32 weight is a fresh 64 MiB allocation per call, which
  glibc serves with mmap, and the page faults alone cost ~50 ms here.

For float32 activations ``int8pack_f32`` / ``int4pack_f32`` are the plain kernels and are not
listed separately. (On this machine the float32 versions of both kernels are 6-55x slower than
their bf16 versions, so neither the ``_f32`` kernel paths for bf16 activations nor the kernels
themselves for float32 activations are ever picked: see ``docs/packed-kernels.md``.)
Kernel layouts (int8 scales in the activation dtype, the int4pack weight and its
scale-and-zero tensor) are prepared once and cached in ``packed.prepared``.

Dispatch on CPU comes from ``_CPU_RULES`` below, measured with
``vllm-adaptive kernels bench-packed`` on this project's CPU (numbers in
``docs/packed-kernels.md`` and cited next to the rules). Anything the table does not cover
(other activation dtypes, weights no native kernel accepts) takes the slow-but-correct
``dequant`` path. CUDA devices follow ``_CUDA_RULES``, measured on an H100 with
``vllm-adaptive kernels bench-gpu`` (every cell inside CUDA graphs): per weight width and token
count, the kernels in the order they won; the first one installed that can run the weight is
taken, then ``triton``, then ``dequant``. Every other device takes ``dequant``.
``PATHS`` lists the CPU paths; ``ALL_PATHS`` adds the CUDA ones.

:func:`matmul_planes` is the entry point for a Matryoshka tier in the bit-plane layout
(:class:`~vllm_adaptive.kernels.planes.MatryoshkaPlanes`): ``triton`` on CUDA, ``dequant``
elsewhere.
"""

from __future__ import annotations

import importlib.util
import threading

import torch
import torch.nn.functional as F

from vllm_adaptive.kernels import cuda_library, int4pack_layout, native
from vllm_adaptive.kernels.cuda_library import GEMLITE, TINYGEMM
from vllm_adaptive.kernels.packed import PackedWeight, dequantize, unpack_codes
from vllm_adaptive.kernels.planes import MatryoshkaPlanes

INT8PACK = "int8pack"
INT8PACK_F32 = "int8pack_f32"
INT4PACK = "int4pack"
INT4PACK_F32 = "int4pack_f32"
DEQUANT = "dequant"
DEQUANT_F32 = "dequant_f32"
NATIVE_INT4 = "native_int4"
NATIVE_INT8 = "native_int8"
TRITON = "triton"
PATHS = (
    INT8PACK,
    INT8PACK_F32,
    INT4PACK,
    INT4PACK_F32,
    DEQUANT,
    DEQUANT_F32,
    NATIVE_INT4,
    NATIVE_INT8,
)
CUDA_LIBRARY_PATHS = tuple(cuda_library.KERNELS)  # tinygemm, gemlite
ALL_PATHS = PATHS + (TRITON, *CUDA_LIBRARY_PATHS)
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Weight families, each with its own candidate kernels.
FAMILY_INT8_ROW = "int8-row"  # bits 8, per-row, symmetric: int8pack
FAMILY_INT8_GROUP = "int8-group"  # bits 8, groups of K, symmetric: native_int8
FAMILY_INT4PACK = "int4pack"  # bits 4 or 2, N % 16 == 0, K % 32 == 0: int4pack
FAMILY_DEQUANT = "dequant-only"  # everything else (asymmetric int8, odd shapes)

INT4PACK_GROUPS = int4pack_layout.GROUPS  # what _weight_int4pack_mm_for_cpu accepts

# dequant_f32 chunk: float32 bytes per chunk of rows (at least 16 rows).
DEQUANT_CHUNK_BYTES = 4 << 20

_INF = float("inf")

# ---------------------------------------------------------------------------------------------
# The measured dispatch table (CPU).
# (family, activation dtype) -> ((max_tokens, path), ...): the first rule with tokens <= max_tokens
# wins. Measured with `vllm-adaptive kernels bench-packed` on the project's CI CPU (AMD EPYC,
# AVX2 only, no AVX512 / AVX512-BF16), torch 2.13.0+cpu, 1 thread, 2026-11-21; raw data in
# docs/data/, the full tables in docs/packed-kernels.md. "warm": one weight per shape
# (cache-resident when it fits); "cold": calls rotated over 256 MiB of weight copies
# (DRAM-resident, as in a real forward pass).
# Times are medians in microseconds, shapes K x N, random weights (kernel speed does not depend on
# the values).
#
# bf16, int8 per-row: int8pack up to 16 tokens, then float32 dequantize-and-matmul.
#   1 token, warm: int8pack 99 / 95 / 46 / 24 vs dense bf16 F.linear 214 / 189 / 82 / 28 for
#   576x1536 / 1536x576 / 576x576 / 576x192, and 1535 vs 3488 at 4096x4096.
#   16 tokens is a tie: warm 778 vs dequant_f32 769 (576x1536), 686 vs 793 (1536x576); cold 942 vs
#   854, 823 vs 811. 32 tokens, warm: dequant_f32 wins 5 of 6 shapes (1370 vs 1604 at 576x1536,
#   19.6 ms vs 32.1 ms at 4096x4096; only 576x192 keeps int8pack, 188 vs 226). 48-128 tokens:
#   dequant_f32 on every shape (64 tokens, 576x1536: 2352 vs 3352).
# bf16, int4 / int2 (int4pack family): int4pack up to 48 tokens, then dequant_f32.
#   int4pack wins every shape at 1-48 tokens, warm and cold (1 token: 162 vs bf16 dense 214 at
#   576x1536, 2535 vs 3488 at 4096x4096; 48 tokens: 2601 vs dequant_f32 2891). At 64 tokens
#   dequant_f32 wins 4 of 5 shapes warm (3462 vs 3569 at 576x1536) and 3 of 4 cold.
#   Since 2026-12-01 beyond 48 tokens the plugin's native_int4 kernel (rows cast to float32) where
#   it is built: on an AVX512-BF16 EPYC a whole step's 4-bit linears, cold, one thread, at 48 /
#   100 rows: native_int4 72 / 147 ms, int4pack 92 / 189, dequant_f32 279 / 479 (oneDNN's bf16
#   GEMM on the float weight: 40 / 71, which the geared linear runs there from 16 rows on:
#   ``GearedLinear.full_from``). Engines time int4pack against native_int4 up to 64 tokens.
# int8 in groups of K (symmetric, float16 scales: GGUF's Q8_0), bf16 and float32: the plugin's
#   native_int8 kernel where it is built, else dequant_f32. 2026-12-02 on the AVX512-BF16 EPYC,
#   one thread, the LM head of SmolLM2 (49152x576, streamed from memory), ms a call at 1 / 8
#   rows: native_int8 g32 0.87 / 2.40 (per-row scales 0.74 / 2.05), torch's int8pack per-row
#   1.5 / 3.7, bf16 F.linear 3.51 / 4.21 (oneDNN's GEMM, what stock runs:
#   1.9 at one row in a profiled server step). Per-row int8 weights time int8pack against
#   native_int8 at engine start (bf16; float32: native_int8 against dequant_f32).
#   From 2 bf16 rows native_int8 runs AVX512-BF16's dot product where the CPU has it: a whole
#   step's grouped int8 linears (SmolLM2, cold, one thread, same CPU) 6.2 / 6.8 / 8.9 ms at 2 / 4
#   / 8 rows against 6.5 / 7.7 / 11.4 on the float32 loop; at one row the float32 loop's fewer
#   conversions per code keep it (5.9 against 6.2).
# bf16, other weights (no native kernel): dequant_f32 always; bf16 dequant pays the bf16 GEMM,
#   which this CPU runs without native bf16 (dense bf16 F.linear grows ~linearly with tokens:
#   214 us at 1 token, 6.9 ms at 32, 576x1536).
# float32, every family: dequant_f32 always. The float32 versions of _weight_int8pack_mm and
#   _weight_int4pack_mm_for_cpu are 6-55x slower than their bf16 versions here (576x1536, 1 token:
#   int8pack 960 vs 99 in bf16, int4pack 2007 vs 162) and never win. dequant_f32 and plain
#   dequant trade places on the small matrices (mostly within ~15%, single cells up to 1.8x either
#   way, at the noise level of this VM), and dequant_f32 is 4-20x faster on the large ones
#   (4096x4096 int8, 1 token: 4.8 ms vs 93.7 ms), where from 4 tokens on it often beats even the
#   dense float32 F.linear (4096x11008: 24.7 vs 41.0 ms at 4 tokens, 48.3 vs 86.1 ms at 32;
#   4096x4096: 7.6 vs 8.4 ms at 4 tokens but 18.9 vs 13.0 ms at 8).
# float32, int4 / int2 (int4pack family), 2026-11-29 on an Ice Lake Xeon (AVX512, one thread):
#   the plugin's native_int4 kernel where it is built (else dequant_f32) at every token count:
#   3072x576 g32, warm, ms a call at 16 / 64 / 128 / 512 tokens: native 0.7 / 2.3 / 5.6 / 25.2
#   against dequant_f32 9.6 / 13.7 / 13.5 / 30.9 (which dequantizes the weight every call).
#   Engines measure it again on their machine up to 64 tokens (weights.autotune_weight), beyond
#   that this rule stands. docs/float32-kernels.md, "Weight-only int8 and 4-bit weights".
# ---------------------------------------------------------------------------------------------

_CPU_RULES: dict[tuple[str, torch.dtype], tuple[tuple[float, str], ...]] = {
    (FAMILY_INT8_ROW, torch.bfloat16): ((16, INT8PACK), (_INF, DEQUANT_F32)),
    (FAMILY_INT8_GROUP, torch.bfloat16): ((_INF, NATIVE_INT8),),
    (FAMILY_INT4PACK, torch.bfloat16): ((48, INT4PACK), (_INF, NATIVE_INT4)),
    (FAMILY_DEQUANT, torch.bfloat16): ((_INF, DEQUANT_F32),),
    (FAMILY_INT8_ROW, torch.float32): ((_INF, DEQUANT_F32),),
    (FAMILY_INT8_GROUP, torch.float32): ((_INF, NATIVE_INT8),),
    (FAMILY_INT4PACK, torch.float32): ((_INF, NATIVE_INT4),),
    (FAMILY_DEQUANT, torch.float32): ((_INF, DEQUANT_F32),),
}


# ---------------------------------------------------------------------------------------------
# The measured dispatch table (CUDA).
# (bits, activation dtype) -> ((max_tokens, (kernels, fastest first)), ...): the first rule with
# tokens <= max_tokens gives the order; the first kernel in it that is installed and runs the
# weight is taken, else ``triton``, else ``dequant``. Kernel names are those of
# ``cuda_library.KERNELS`` (a production kernel such as Marlin is one more entry there and here).
# Measured with `vllm-adaptive kernels bench-gpu` on an NVIDIA H100 80GB HBM3 (torch 2.11+cu130,
# triton 3.6, GemLite 0.6.0), bf16 activations, every call inside a CUDA graph, weights streamed
# from HBM; 2026-11-27, docs/gpu-kernels.md, raw data docs/data/gpu-kernels-h100.json.
# Speedups over bf16 F.linear, geometric mean over 4096x4096 / 4096x11008 (/ 11008x4096 at 1
# token):
#   int8 per-row: GemLite 1.81x / 1.18x / 1.03x at 1 / 8 / 32 tokens, the project's Triton
#     kernel 1.15x / 1.14x / 0.72x.
#   int4 (g32, g128): tinygemm 1.93-2.32x at 1 token and 1.08-1.18x at 8, but 0.35x at 32, where
#     GemLite's GEMM is 0.55-0.75x and Triton 0.32-0.36x: no int4 kernel beats bf16 from ~16
#     tokens on.
#   int2 (g32): tinygemm 1.92x / 1.08x at 1 / 8, GemLite 0.49x at 32 (tinygemm 0.35x).
#   fp16 activations: tinygemm takes bf16 only; GemLite, then Triton (not timed in fp16).
_CUDA_RULES: dict[tuple[int, torch.dtype], tuple[tuple[float, tuple[str, ...]], ...]] = {
    (8, torch.bfloat16): ((_INF, (GEMLITE, TRITON)),),
    (8, torch.float16): ((_INF, (GEMLITE, TRITON)),),
    (4, torch.bfloat16): ((8, (TINYGEMM, GEMLITE, TRITON)), (_INF, (GEMLITE, TINYGEMM, TRITON))),
    (4, torch.float16): ((_INF, (GEMLITE, TRITON)),),
    (2, torch.bfloat16): ((8, (TINYGEMM, GEMLITE, TRITON)), (_INF, (GEMLITE, TINYGEMM, TRITON))),
    (2, torch.float16): ((_INF, (GEMLITE, TRITON)),),
}


def int4pack_group(packed: PackedWeight) -> int | None:
    """Group length the int4pack kernel runs ``packed`` with, or None if it cannot."""
    n, k = packed.shape
    if packed.bits not in (4, 2) or n % 16 or k % 32:
        return None
    return int4pack_layout.kernel_group(packed)


def family(packed: PackedWeight) -> str:
    """Which kernel family a weight belongs to (on CPU)."""
    if packed.bits == 8 and packed.symmetric:
        return FAMILY_INT8_ROW if packed.group_size is None else FAMILY_INT8_GROUP
    if int4pack_group(packed) is not None:
        return FAMILY_INT4PACK
    return FAMILY_DEQUANT


def triton_usable(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on ``device``: CUDA, a GPU present, triton installed.

    triton is only imported (through :mod:`vllm_adaptive.kernels.triton_packed`) when the other
    two conditions hold, so CPU dispatch never pays for it.
    """
    device = torch.device(device)
    if not cuda_usable(device):
        return False
    if importlib.util.find_spec("triton") is None:
        return False
    from vllm_adaptive.kernels import triton_packed

    return triton_packed.TRITON_AVAILABLE


def cuda_usable(device: torch.device | str) -> bool:
    """A CUDA device with a GPU present."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def _off_cpu_paths(packed: PackedWeight | None, dtype: torch.dtype, device: torch.device) -> list:
    """Every correct path off CPU: the library kernels that run the weight, triton, dequant."""
    paths: list[str] = []
    if packed is not None and packed.device.type == "cuda" and cuda_usable(device):
        paths += [n for n in CUDA_LIBRARY_PATHS if cuda_library.runnable(n, packed, dtype)]
    if dtype in TRITON_DTYPES and triton_usable(device):
        paths.append(TRITON)
    return paths + [DEQUANT]


def _cuda_rules(packed: PackedWeight, dtype: torch.dtype) -> tuple[tuple[float, str], ...]:
    """``_CUDA_RULES`` resolved for this weight: (max_tokens, path), cached on the weight."""
    key = ("cuda-rules", dtype)
    got = packed.prepared.get(key)
    if got is None:
        usable = _off_cpu_paths(packed, dtype, packed.device)
        got = packed.prepared[key] = resolve_cuda_rules(packed.bits, dtype, usable)
    return got


def resolve_cuda_rules(
    bits: int, dtype: torch.dtype, usable: list[str]
) -> tuple[tuple[float, str], ...]:
    """Per token range, the first kernel of the measured order among ``usable`` (the paths that
    run the weight here, best fallback first among the rest)."""
    rules = _CUDA_RULES.get((bits, dtype), ((_INF, ()),))
    return tuple(
        (max_tokens, next((p for p in prefs if p in usable), usable[0]))
        for max_tokens, prefs in rules
    )


def applicable_paths(packed: PackedWeight, dtype: torch.dtype, device: torch.device) -> list[str]:
    """Every path that computes ``x @ W^T`` correctly for this weight, dtype and device."""
    if torch.device(device).type != "cpu":
        return _off_cpu_paths(packed, dtype, torch.device(device))
    fam = family(packed)
    paths: list[str] = []
    if fam == FAMILY_INT8_ROW:
        paths += [INT8PACK, INT8PACK_F32]
    if fam in (FAMILY_INT8_ROW, FAMILY_INT8_GROUP) and native.int8_linear_ops() is not None:
        paths.append(NATIVE_INT8)
    if fam == FAMILY_INT4PACK:
        paths += [INT4PACK, INT4PACK_F32]
        if native.int4_linear_ops() is not None:
            paths.append(NATIVE_INT4)
    paths += [DEQUANT, DEQUANT_F32]
    if dtype == torch.float32:
        paths = [p for p in paths if p not in (INT8PACK_F32, INT4PACK_F32)]
    elif dtype not in (torch.bfloat16, torch.float16):
        # the native kernels take f32/f16/bf16 activations only
        paths = [DEQUANT]
    return paths


def choose_path(
    packed: PackedWeight,
    tokens: int,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> str:
    """The path :func:`matmul` takes for ``tokens`` rows of ``dtype`` activations."""
    device = torch.device(device) if device is not None else packed.device
    if device.type != "cpu":
        if not cuda_usable(device) or packed.device.type != "cuda":
            return _off_cpu_paths(packed, dtype, device)[0]
        for max_tokens, path in _cuda_rules(packed, dtype):
            if tokens <= max_tokens:
                return path
        return DEQUANT
    for max_tokens, path in cpu_rules(family(packed), dtype):  # unmeasured dtype: dequant
        if tokens <= max_tokens:
            return path
    return DEQUANT


def dispatch_paths(packed: PackedWeight, dtype: torch.dtype) -> list[str]:
    """The paths :func:`choose_path` can pick for this weight and dtype at any token count:
    the layouts worth preparing (preparing every applicable path wastes memory)."""
    if packed.device.type != "cpu":
        if not cuda_usable(packed.device):
            return [DEQUANT]
        return list(dict.fromkeys(path for _, path in _cuda_rules(packed, dtype)))
    return list(dict.fromkeys(path for _, path in cpu_rules(family(packed), dtype)))


def choose_path_cached(packed: PackedWeight, tokens: int, dtype: torch.dtype) -> str:
    """:func:`choose_path` with the weight's CPU rules cached on it (hot loops)."""
    if packed.device.type != "cpu":
        return choose_path(packed, tokens, dtype)
    key = ("rules", dtype)
    rules = packed.prepared.get(key)
    if rules is None:
        rules = packed.prepared[key] = cpu_rules(family(packed), dtype)
    for max_tokens, path in rules:
        if tokens <= max_tokens:
            return path
    return DEQUANT


def bound_kernel(packed: PackedWeight, path: str, dtype: torch.dtype):
    """``x -> x @ W^T`` on ``path`` for 2-D contiguous ``x`` of ``dtype`` on the weight's device,
    with the prepared layouts bound: no checks and no lookups, for per-layer hot loops whose
    caller guarantees shapes (the geared linear). Cached on the weight; released with it."""
    key = ("bound", path, dtype)
    fn = packed.prepared.get(key)
    if fn is None:
        if path == INT8PACK:
            op, w, sc = torch.ops.aten._weight_int8pack_mm, packed.data, _int8_scales(packed, dtype)

            def fn(x: torch.Tensor) -> torch.Tensor:
                return op(x, w, sc)
        elif path in CUDA_LIBRARY_PATHS:
            fn = cuda_library.kernel(path, packed, dtype)
        elif path == INT4PACK:
            op = torch.ops.aten._weight_int4pack_mm_for_cpu
            w, g = _int4_weight(packed), int4pack_group(packed)
            sz = _int4_scale_zeros(packed, dtype)

            def fn(x: torch.Tensor) -> torch.Tensor:
                return op(x, w, g, sz)
        elif path == NATIVE_INT8:
            op, (w8, sc), n = _native_int8_op(), _native_int8_layout(packed), packed.shape[0]
            if dtype == torch.float32:

                def fn(x: torch.Tensor) -> torch.Tensor:
                    return op(x, w8, sc, n)
            else:
                cast = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32

                def fn(x: torch.Tensor) -> torch.Tensor:
                    return op(x.to(cast), w8, sc, n).to(dtype)
        elif path == NATIVE_INT4:
            op, (w4, sc, off), n = _native_int4_op(), _native_int4_layout(packed), packed.shape[0]
            if dtype == torch.float32:

                def fn(x: torch.Tensor) -> torch.Tensor:
                    return op(x, w4, sc, off, n)
            elif dtype == torch.bfloat16:  # the kernel's bf16 dot-product loop, float32 out

                def fn(x: torch.Tensor) -> torch.Tensor:
                    return op(x, w4, sc, off, n).to(dtype)
            else:  # fp16 rows: the float32 kernel, rows cast in and out

                def fn(x: torch.Tensor) -> torch.Tensor:
                    return op(x.float(), w4, sc, off, n).to(dtype)
        else:

            def fn(x: torch.Tensor) -> torch.Tensor:
                return _run(path, x, packed)

        packed.prepared[key] = fn
    return fn


# ---------------------------------------------------------------------------------------------
# Prepared layouts (cached on the PackedWeight)
# ---------------------------------------------------------------------------------------------


def cpu_rules(fam: str, dtype: torch.dtype) -> tuple[tuple[float, str], ...]:
    """``_CPU_RULES`` for a family and dtype (unmeasured: ``dequant``), the native kernel's rules
    falling back to ``dequant_f32`` where the plugin's C++ kernels do not run."""
    rules = _CPU_RULES.get((fam, dtype), ((_INF, DEQUANT),))
    if any(p == NATIVE_INT4 for _, p in rules) and native.int4_linear_ops() is None:
        rules = tuple((t, DEQUANT_F32 if p == NATIVE_INT4 else p) for t, p in rules)
    if any(p == NATIVE_INT8 for _, p in rules) and native.int8_linear_ops() is None:
        rules = tuple((t, DEQUANT_F32 if p == NATIVE_INT8 else p) for t, p in rules)
    return rules


def measured_candidates(packed: PackedWeight, dtype: torch.dtype) -> tuple[str, ...]:
    """The paths dispatch times on this machine for this weight and activation dtype (the
    plugin's native kernel against the library path it replaces); empty where the static rules
    stand."""
    if packed.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return ()
    fam = family(packed)
    if fam == FAMILY_INT8_ROW and native.int8_linear_ops() is not None:
        return (NATIVE_INT8, DEQUANT_F32) if dtype == torch.float32 else (INT8PACK, NATIVE_INT8)
    if fam != FAMILY_INT4PACK or native.int4_linear_ops() is None:
        return ()
    if dtype == torch.float32:
        return (NATIVE_INT4, DEQUANT_F32)
    return (INT4PACK, NATIVE_INT4)


def use_measured_rules(packed: PackedWeight, dtype: torch.dtype, best: dict[int, str]) -> None:
    """Dispatch this weight by measurement: ``best`` maps each measured token-count bucket to
    its fastest path; a call takes the largest bucket at or below its token count, and counts
    beyond twice the last bucket follow the static rules (prefill rows)."""
    buckets = sorted(best)
    rules = [(nxt - 1, best[b]) for b, nxt in zip(buckets, buckets[1:], strict=False)]
    rules.append((2 * buckets[-1] - 1, best[buckets[-1]]))
    static = cpu_rules(family(packed), dtype)
    packed.prepared[("rules", dtype)] = (*rules, (_INF, static[-1][1]))


def _cached(packed: PackedWeight, key: tuple, build):
    """``packed.prepared[key]``, built once by ``build()``."""
    got = packed.prepared.get(key)
    if got is None:
        got = packed.prepared[key] = build()
    return got


def _int8_scales(packed: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    return _cached(
        packed, ("int8pack_scales", dtype), lambda: packed.scales[:, 0].to(dtype).contiguous()
    )


def _int4_weight(packed: PackedWeight) -> torch.Tensor:
    def build() -> torch.Tensor:
        q = packed.codes().to(torch.int32) + 8  # (q - 8) is the signed code
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)

    return _cached(packed, ("int4pack_weight",), build)


def _int4_scale_zeros(packed: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    return _cached(
        packed,
        ("int4pack_scale_zeros", dtype),
        lambda: int4pack_layout.scale_zeros(packed, int4pack_group(packed), dtype),
    )


def _native_int4_op():
    ops = native.int4_linear_ops()
    if ops is None:
        raise RuntimeError(f"native_int4 does not run here: {native.why_unavailable()}")
    return ops[1]


def _native_int8_op():
    ops = native.int8_linear_ops()
    if ops is None:
        raise RuntimeError(f"native_int8 does not run here: {native.why_unavailable()}")
    return ops[1]


def _native_int8_layout(packed: PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes in the native kernel's blocks and float32 scales as ``[groups, N]``."""

    def build():
        pack = native.int8_linear_ops()
        if pack is None:
            raise RuntimeError(f"native_int8 does not run here: {native.why_unavailable()}")
        return pack[0](packed.codes(), packed.scales.float().t().contiguous())

    return _cached(packed, ("native_int8",), build)


def prepared_native_int8(packed: PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """``native_int8``'s layout of this weight (codes in blocks, float32 scales), built once:
    what the int8 gear's C++ op takes."""
    return _native_int8_layout(packed)


def _native_int4_layout(packed: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The codes in the native kernel's blocks, float32 scales and folded offsets."""

    def build():
        pack = native.int4_linear_ops()
        if pack is None:
            raise RuntimeError(f"native_int4 does not run here: {native.why_unavailable()}")
        offsets = None if packed.offsets is None else packed.offsets.float()
        return pack[0](packed.codes(), packed.scales.float(), offsets)

    return _cached(packed, ("native_int4",), build)


def prepared_native_int4(packed: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``native_int4``'s layout of this weight (codes in blocks, float32 scales, folded
    offsets), built once: what the int4 gear's C++ op takes."""
    return _native_int4_layout(packed)


def prepared_int4pack(
    packed: PackedWeight, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """torch's int4pack layout of this weight for ``dtype`` rows (packed codes, scale-and-zeros,
    group length), built once."""
    return _int4_weight(packed), _int4_scale_zeros(packed, dtype), int4pack_group(packed)


def _dequant_params(packed: PackedWeight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 scales and offsets as ``[N, groups, 1]``, for in-place broadcasting."""
    key = ("dequant_f32_params",)
    got = packed.prepared.get(key)
    if got is None:
        s = packed.scales.to(torch.float32).unsqueeze(-1).contiguous()
        o = None
        if packed.offsets is not None:
            o = packed.offsets.to(torch.float32).unsqueeze(-1).contiguous()
        got = (s, o)
        packed.prepared[key] = got
    return got


_scratch = threading.local()


def _scratch_f32(numel: int, device: torch.device) -> torch.Tensor:
    """A reused float32 buffer (per thread and device) of at least ``numel`` elements."""
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    buf = bufs.get(device)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=torch.float32, device=device)
        bufs[device] = buf
    return buf[:numel]


def prepare(packed: PackedWeight, dtype: torch.dtype, path: str | None = None) -> None:
    """Build (and cache) the kernel layouts ``path`` needs, ahead of the first call."""
    paths = [path] if path else applicable_paths(packed, dtype, packed.device)
    for p in paths:
        if p == INT8PACK:
            _int8_scales(packed, dtype)
        elif p == INT8PACK_F32:
            _int8_scales(packed, torch.float32)
        elif p == INT4PACK:
            _int4_weight(packed)
            _int4_scale_zeros(packed, dtype)
        elif p == INT4PACK_F32:
            _int4_weight(packed)
            _int4_scale_zeros(packed, torch.float32)
        elif p == DEQUANT_F32:
            _dequant_params(packed)
        elif p == NATIVE_INT4:
            _native_int4_layout(packed)
        elif p == NATIVE_INT8:
            _native_int8_layout(packed)
        elif p in CUDA_LIBRARY_PATHS:  # packing, and GemLite's module, at load, not at a call
            cuda_library.kernel(p, packed, dtype)


# ---------------------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------------------


def _int8pack(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x, packed.data, _int8_scales(packed, x.dtype))


def _int4pack(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    g = int4pack_group(packed)
    w = _int4_weight(packed)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, g, _int4_scale_zeros(packed, x.dtype))


def _dequant_f32(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    n, k = packed.shape
    scales, offsets = _dequant_params(packed)
    groups = scales.shape[1]
    rows = min(n, max(16, DEQUANT_CHUNK_BYTES // (4 * k)))
    buf = _scratch_f32(rows * k, x.device).view(rows, k)
    x32 = x.to(torch.float32)
    out_t = torch.empty(n, x.shape[0], dtype=torch.float32, device=x.device)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        b = buf[: r1 - r0]
        b.copy_(unpack_codes(packed.data[r0:r1], packed.bits, k))
        bg = b.view(r1 - r0, groups, k // groups)
        bg.mul_(scales[r0:r1])
        if offsets is not None:
            bg.add_(offsets[r0:r1])
        torch.mm(b, x32.t(), out=out_t[r0:r1])
    return out_t.t().to(x.dtype).contiguous()


def _run(path: str, x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    if path == INT8PACK:
        return _int8pack(x, packed)
    if path == INT8PACK_F32:
        return _int8pack(x.to(torch.float32), packed).to(x.dtype)
    if path == INT4PACK:
        return _int4pack(x, packed)
    if path == INT4PACK_F32:
        return _int4pack(x.to(torch.float32), packed).to(x.dtype)
    if path == DEQUANT:
        return F.linear(x, dequantize(packed, x.dtype))
    if path == DEQUANT_F32:
        return _dequant_f32(x, packed)
    if path == NATIVE_INT4:
        w, sc, off = _native_int4_layout(packed)
        xk = x if x.dtype == torch.bfloat16 else x.to(torch.float32)
        y = _native_int4_op()(xk.contiguous(), w, sc, off, packed.shape[0])
        return y.to(x.dtype)
    if path == NATIVE_INT8:
        w, sc = _native_int8_layout(packed)
        xk = x if x.dtype == torch.bfloat16 else x.to(torch.float32)
        y = _native_int8_op()(xk.contiguous(), w, sc, packed.shape[0])
        return y.to(x.dtype)
    if path == TRITON:
        from vllm_adaptive.kernels.triton_packed import packed_matmul

        return packed_matmul(x, packed)
    if path in CUDA_LIBRARY_PATHS:
        return cuda_library.kernel(path, packed, x.dtype)(x)
    raise ValueError(f"unknown path {path!r}; paths are {ALL_PATHS}")


def _check_input(x: torch.Tensor, shape: tuple[int, int], device: torch.device) -> tuple[int, int]:
    """Errors naming the problem for activations that cannot meet a ``[N, K]`` weight."""
    if not x.is_floating_point():
        raise ValueError(f"x must be a float tensor, got {x.dtype}")
    n, k = shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects K={k}")
    if x.device != device:
        raise ValueError(f"x is on {x.device}, the weight on {device}")
    return n, k


def matmul(x: torch.Tensor, packed: PackedWeight, *, path: str | None = None) -> torch.Tensor:
    """``x @ W^T`` in x's dtype, ``x``: ``[..., K]``, result ``[..., N]``.

    ``path`` forces a path (benchmarks, tests); it must be one of
    :func:`applicable_paths` for this weight, dtype and device.
    """
    n, k = _check_input(x, packed.shape, packed.device)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    tokens = x2.shape[0]
    if path is None:
        path = choose_path(packed, tokens, x.dtype, x.device)
    elif path not in applicable_paths(packed, x.dtype, x.device):
        raise ValueError(
            f"path {path!r} cannot run {packed.describe()} with {x.dtype} on {x.device.type}; "
            f"applicable: {applicable_paths(packed, x.dtype, x.device)}"
        )
    if tokens == 0:
        return x.new_zeros(*lead, n)
    return _run(path, x2, packed).reshape(*lead, n)


def matmul_planes(
    x: torch.Tensor, planes: MatryoshkaPlanes, bits: int, *, path: str | None = None
) -> torch.Tensor:
    """``x @ W_r^T`` for the ``bits`` tier of a bit-plane Matryoshka weight, in x's dtype.

    ``triton`` (CUDA with triton; reads only the tier's planes) or ``dequant``
    (``F.linear(x, planes.dequantize(bits, x.dtype))``, any device).
    """
    n, k = _check_input(x, planes.shape, planes.device)
    paths = [DEQUANT] if x.device.type == "cpu" else _off_cpu_paths(None, x.dtype, x.device)
    if path is None:
        path = paths[0]
    elif path not in paths:
        raise ValueError(
            f"path {path!r} cannot run Matryoshka planes with {x.dtype} on {x.device.type}; "
            f"applicable: {paths}"
        )
    if x.numel() == 0:
        return x.new_zeros(*x.shape[:-1], n)
    if path == TRITON:
        from vllm_adaptive.kernels.triton_packed import planes_matmul

        return planes_matmul(x, planes, bits)
    return F.linear(x, planes.dequantize(bits, x.dtype))
