"""How much of the machine's memory bandwidth a decode step uses.

At small batch a decode step of a dense model reads every weight once: its time is bounded
below by weight bytes / memory bandwidth. `stream_bandwidth` measures that bandwidth the way
STREAM does (copy, triad, and a plain read), on one thread, since vLLM runs the model on one
torch thread on these 2-core machines. `checkpoint_weight_bytes` counts the bytes a step reads
at the precision each tensor actually runs at. The share of the bandwidth a run reached is
bytes per step / time per step / bandwidth, with the time per step taken two ways: the wall
inter-token latency, and the worker's CPU seconds per step (less disturbed by other processes).
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20

#: Bytes per element of safetensors dtypes.
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1}
_DTYPE_BYTES |= {"U8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}
_FLOATS = {"F64", "F32", "F16", "BF16"}


def l3_bytes() -> int | None:
    """Size of the largest cache level of CPU 0 (sysfs), None if unknown."""
    best = None
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (d / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1024, "M": MIB, "G": 1 << 30}.get(size[-1:], 1)
        value = int(size.rstrip("KMG")) * mult
        best = value if best is None or value > best else best
    return best


def stream_bandwidth(array_mib: int | None = None, repeats: int = 5) -> dict[str, Any]:
    """Single-thread STREAM-like bandwidth in GB/s (1e9 bytes/s), best of ``repeats``.

    Arrays are float32 of ``array_mib`` MiB each (default: 4x the last-level cache, at least
    64 MiB, as STREAM asks). Counted bytes follow STREAM: copy 2 per element, triad 3, read 1
    (write-allocate traffic not counted). ``best_gbs`` is the fastest of the three."""
    import torch

    if array_mib is None:
        llc = l3_bytes() or 32 * MIB
        array_mib = max(64, min(512, 4 * llc // MIB))
    n = array_mib * MIB // 4
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.ones(n)
        b = torch.full((n,), 2.0)
        c = torch.zeros(n)

        def best(fn, nbytes: int) -> float:
            fn()  # first touch, page faults
            t = min(_timed(fn) for _ in range(repeats))
            return nbytes / t / 1e9

        out = {
            "copy_gbs": best(lambda: c.copy_(a), 2 * 4 * n),
            "triad_gbs": best(lambda: torch.add(b, c, alpha=3.0, out=a), 3 * 4 * n),
            "read_gbs": best(lambda: a.sum(), 4 * n),
        }
    finally:
        torch.set_num_threads(threads)
    out["best_gbs"] = max(out["copy_gbs"], out["triad_gbs"], out["read_gbs"])
    out.update(array_mib=array_mib, threads=1, repeats=repeats)
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def checkpoint_weight_bytes(model_dir: str | Path, dtype_bytes: int) -> dict[str, Any]:
    """Weight bytes one decode step reads, from a checkpoint's safetensors headers.

    Floating-point weights run at the engine's dtype (``dtype_bytes`` each, whatever they are
    stored as), integer tensors (int8 weights) as stored, quantization scales (``*_scale``) as
    stored. The input embedding is a lookup of a few rows, not counted, except when it is also
    the LM head (tied embeddings, no ``lm_head.weight``): then it is read whole every step."""
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    tensors: dict[str, dict[str, Any]] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(safetensors_header(f))
    tied = bool(cfg.get("tie_word_embeddings")) and "lm_head.weight" not in tensors
    decoder = lm_head = 0
    for name, info in tensors.items():
        numel = 1
        for d in info["shape"]:
            numel *= d
        stored = _DTYPE_BYTES.get(info["dtype"], 4)
        if info["dtype"] in _FLOATS and not name.endswith(("_scale", "zero_point")):
            nbytes = numel * dtype_bytes
        else:
            nbytes = numel * stored
        if name.endswith("embed_tokens.weight"):
            if tied:
                lm_head += nbytes
        elif name.startswith("lm_head."):
            lm_head += nbytes
        else:
            decoder += nbytes
    return {
        "weight_bytes_per_step": decoder + lm_head,
        "decoder_bytes": decoder,
        "lm_head_bytes": lm_head,
        "tied_lm_head": tied,
        "dtype_bytes": dtype_bytes,
    }


def bandwidth_share(bytes_per_step: float, seconds_per_step: float, gbs: float) -> float | None:
    """Fraction of ``gbs`` (GB/s) that reading ``bytes_per_step`` every ``seconds_per_step``
    amounts to (None without a time)."""
    if not seconds_per_step or seconds_per_step <= 0 or not gbs:
        return None
    return bytes_per_step / seconds_per_step / (gbs * 1e9)
