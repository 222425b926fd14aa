"""`vllm-adaptive kernels measure`: every linear kernel for float32 (or, with ``--dtype
bfloat16``, bf16) activations on this machine, at the default model's shapes, against the dense
kernels stock vLLM runs at that dtype.

Prints a table (microseconds per call, one thread) and writes JSON with the machine's CPU model
and ISA flags. Dense baselines: ``F.linear`` in float32 and vLLM's oneDNN float32 GEMM (what
vLLM-CPU uses for unquantized linears where oneDNN builds). Reduced-precision kernels:
:mod:`vllm_adaptive.kernels.float_linear` (fp16 through FBGEMM, W8A8 through oneDNN or FBGEMM,
their references) and the packed int8 / int4 paths of :mod:`vllm_adaptive.kernels.matmul`.
For bf16 activations the dense baselines are the kernels vLLM's CPU dispatch picks for a bf16
linear (oneDNN, and its AMX ``weight_packed_linear`` where that applies), and the reduced ones
the kernels a bf16 engine's gears run (W8A8 / W8A16 on AMX int8, the packed int8 / int4 paths).
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


def dense_bf16_kernels(w: torch.Tensor) -> dict[str, Any]:
    """Stock bf16 kernels for ``w`` ``[N, K]``: oneDNN, and the AMX packed GEMM vLLM uses for
    weights its ``check_cpu_sgl_kernel`` admits."""
    wb = w.to(torch.bfloat16)
    kernels: dict[str, Any] = {"bf16_linear": lambda x, w=wb: F.linear(x, w)}
    try:
        from vllm_adaptive.engine.vllm_api import check_cpu_sgl_kernel
        from vllm_adaptive.engine.vllm_api import custom_ops as ops

        handle = ops.create_onednn_mm(wb.t(), 32)
        kernels["bf16_onednn"] = lambda x, h=handle: ops.onednn_mm(h, x, None)
        n = w.shape[0]
        if check_cpu_sgl_kernel(n, w.shape[1], torch.bfloat16):
            packed = torch.ops._C.convert_weight_packed(wb)
            kernels["bf16_amx"] = lambda x, p=packed: ops.weight_packed_linear_cpu(x, p, n, None)
    except Exception:  # noqa: BLE001 - no vLLM, or no oneDNN / AMX for this ISA
        pass
    return kernels


def reduced_bf16_kernels(w: torch.Tensor) -> dict[str, Any]:
    """The kernels a bf16 engine's gears run, named ``format/kernel``."""
    from vllm_adaptive.kernels.matmul import INT4PACK, INT8PACK, matmul
    from vllm_adaptive.kernels.packed import quantize

    out: dict[str, Any] = {}
    q = W8A8Weight.from_float(w)
    for name, fmt in (("w8a8", q), ("w8a16", W8A16Weight(base=q, shared=True))):
        fn = fmt.amx_call()
        if fn is not None:
            out[f"{name}/amx_int8"] = fn
    i8 = quantize(w, 8, None, check_double_quant=False)
    out["int8/int8pack"] = lambda x, p=i8: matmul(x, p, path=INT8PACK)
    i4 = quantize(w, 4, 32, check_double_quant=False)
    out["int4/int4pack"] = lambda x, p=i4: matmul(x, p, path=INT4PACK)
    return out


def measure(
    shapes=DEFAULT_SHAPES,
    tokens=DEFAULT_TOKENS,
    progress: bool = True,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, k, n in shapes:
        w = torch.randn(n, k, generator=gen) * 0.02
        if dtype == torch.bfloat16:
            kernels = {**dense_bf16_kernels(w), **reduced_bf16_kernels(w)}
        else:
            kernels = {**dense_kernels(w), **reduced_kernels(w)}
        for m in tokens:
            x = torch.randn(m, k, generator=gen).to(dtype)
            us = {kn: round(1e6 * autotune.time_kernel(fn, x), 1) for kn, fn in kernels.items()}
            rows.append({"linear": name, "k": k, "n": n, "tokens": m, "us": us})
            if progress:
                print(f"{name} {k}x{n} M={m}: " + " ".join(f"{a}={b:.0f}" for a, b in us.items()))
    dtype_name = str(dtype).removeprefix("torch.")
    return {"machine": autotune.cpu_info(), "dtype": dtype_name, "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    names = list(dict.fromkeys(n for r in result["rows"] for n in r["us"]))  # every row's
    head = "| linear | K x N | M | " + " | ".join(names) + " |"
    lines = [head, "|" + " --- |" * (3 + len(names))]
    for r in result["rows"]:
        cells = " | ".join(f"{r['us'][n]:.0f}" if n in r["us"] else "-" for n in names)
        lines.append(f"| {r['linear']} | {r['k']} x {r['n']} | {r['tokens']} | {cells} |")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    tokens = tuple(int(t) for t in args.tokens.split(","))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    result = measure(tokens=tokens, progress=not args.quiet, dtype=dtype)
    print(markdown(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0
