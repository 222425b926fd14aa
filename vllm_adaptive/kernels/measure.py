"""`vllm-adaptive kernels measure`: every linear kernel for float32 activations on this machine,
at the default model's shapes, against the dense float32 kernels stock vLLM runs.

Prints a table (microseconds per call, one thread) and writes JSON with the machine's CPU model
and ISA flags. Dense baselines: ``F.linear`` in float32 and vLLM's oneDNN float32 GEMM (what
vLLM-CPU uses for unquantized linears where oneDNN builds). Reduced-precision kernels:
:mod:`vllm_adaptive.kernels.float_linear` (fp16 through FBGEMM, W8A8 through oneDNN or FBGEMM,
their references) and the packed int8 / int4 paths of :mod:`vllm_adaptive.kernels.matmul`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from vllm_adaptive.kernels import autotune
from vllm_adaptive.kernels.float_linear import Fp16Weight, W8A8Weight, W8A16Weight

#: (name, K, N) of SmolLM2-135M's linears: qkv, o, gate_up, down, LM head
DEFAULT_SHAPES = (
    ("qkv_proj", 576, 960),
    ("o_proj", 576, 576),
    ("gate_up_proj", 576, 3072),
    ("down_proj", 1536, 576),
    ("lm_head", 576, 49152),
)
DEFAULT_TOKENS = (1, 8, 32)


def dense_kernels(w: torch.Tensor) -> dict[str, Any]:
    """Stock float32 kernels for ``w`` ``[N, K]``."""
    kernels: dict[str, Any] = {"f32_linear": lambda x, w=w: F.linear(x, w)}
    try:
        from vllm_adaptive.engine.vllm_api import custom_ops as ops

        handle = ops.create_onednn_mm(w.t(), 32)
        kernels["f32_onednn"] = lambda x, h=handle: ops.onednn_mm(h, x, None)
    except Exception:  # noqa: BLE001 - no vLLM, or oneDNN cannot build for this ISA
        pass
    return kernels


def reduced_kernels(w: torch.Tensor) -> dict[str, Any]:
    """Every reduced-precision kernel for float32 activations, named ``format/kernel``."""
    out: dict[str, Any] = {}
    f16 = Fp16Weight.from_float(w)
    for name in f16.kernels():
        if name != "reference":
            out[f"fp16/{name}"] = f16.bind(name)
    q = W8A8Weight.from_float(w)
    for name in q.kernels():
        if name != "reference":
            out[f"w8a8/{name}"] = q.bind(name)
    w16 = W8A16Weight(base=q, shared=True)
    for name in w16.kernels():
        if name != "reference":
            out[f"w8a16/{name}"] = w16.bind(name)
    from vllm_adaptive.kernels.matmul import INT4PACK, INT8PACK, matmul
    from vllm_adaptive.kernels.packed import quantize

    i8 = quantize(w, 8, None, check_double_quant=False)
    out["int8/int8pack"] = lambda x, p=i8: matmul(x, p, path=INT8PACK)
    i4 = quantize(w, 4, 32, check_double_quant=False)
    out["int4/int4pack"] = lambda x, p=i4: matmul(x, p, path=INT4PACK)
    return out


def measure(shapes=DEFAULT_SHAPES, tokens=DEFAULT_TOKENS, progress: bool = True) -> dict[str, Any]:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, k, n in shapes:
        w = torch.randn(n, k, generator=gen) * 0.02
        kernels = {**dense_kernels(w), **reduced_kernels(w)}
        for m in tokens:
            x = torch.randn(m, k, generator=gen)
            us = {kn: round(1e6 * autotune.time_kernel(fn, x), 1) for kn, fn in kernels.items()}
            rows.append({"linear": name, "k": k, "n": n, "tokens": m, "us": us})
            if progress:
                print(f"{name} {k}x{n} M={m}: " + " ".join(f"{a}={b:.0f}" for a, b in us.items()))
    return {"machine": autotune.cpu_info(), "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    names = list(result["rows"][0]["us"])
    head = "| linear | K x N | M | " + " | ".join(names) + " |"
    lines = [head, "|" + " --- |" * (3 + len(names))]
    for r in result["rows"]:
        cells = " | ".join(f"{r['us'].get(n, float('nan')):.0f}" for n in names)
        lines.append(f"| {r['linear']} | {r['k']} x {r['n']} | {r['tokens']} | {cells} |")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    tokens = tuple(int(t) for t in args.tokens.split(","))
    result = measure(tokens=tokens, progress=not args.quiet)
    print(markdown(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0
