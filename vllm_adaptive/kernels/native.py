"""The plugin's C++ CPU kernels, built on the machine that runs them.

Only where no library kernel serves (``csrc/``): decode and prefill attention over vLLM's CPU
paged cache with the per-slot depth mask, which vLLM's CPU op cannot express; the fp16
gear's linear at a few rows, where FBGEMM's fp16 GEMM streams the weights slower than the core
can; and weight-only int8 and 4-bit group weights at a few rows for float32 activations,
which no library kernel here computes without quantizing the activations or running 6-55x
slower than in bf16 (docs/float32-kernels.md). Built with torch's C++
extension loader for this CPU (``-march=native``) on first use, into
``$ADAPTIVE_CACHE/extensions/<name>-<digest>/``; the digest covers the sources, the flags,
torch's version and the CPU's ISA, so a cache shared between machines never loads a foreign
build. The build takes about a minute once per machine
(the sources compile side by side): ``vllm-adaptive kernels build`` (which ``scripts/serve.sh``
runs before it starts vLLM) does it ahead of time; otherwise engines start it at engine start
(:func:`ensure_built`), never inside a request.

``ADAPTIVE_NATIVE_KERNELS=off`` never builds them (the torch paths run); without a C++ compiler
the build fails once, says why in a warning, and the torch paths run.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vllm_adaptive.environment import cache_root, cpu_flags, setting

logger = logging.getLogger("vllm.adaptive.native")

#: ``on`` (default): build and use the C++ kernels; ``off``: the torch paths only.
NATIVE_KERNELS = "ADAPTIVE_NATIVE_KERNELS"
CSRC = Path(__file__).with_name("csrc")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17")
NAMESPACE = "vllm_adaptive_native"

_lock = threading.Lock()
_state: dict[str, object] = {}


def enabled() -> bool:
    value = (setting(NATIVE_KERNELS, "on") or "on").lower()
    if value not in ("on", "off"):
        raise ValueError(f"{NATIVE_KERNELS} must be 'on' or 'off', got {value!r}")
    return value == "on"


#: the library's translation units (one per op, compiled in parallel) and what they include
SOURCES = (
    "masked_decode.cpp",
    "masked_prefill.cpp",
    "fp16_linear.cpp",
    "int8_linear.cpp",
    "int4_linear.cpp",
    "geared_routes.cpp",
    "entropy.cpp",
)
HEADERS = ("masked_common.h", "blocked_weight.h", "vec_exp.h", "amx_tiles.h")


def build_digest(files: list[Path]) -> str:
    """What a build depends on: the sources and headers, the flags, torch and the CPU's ISA."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(repr((CFLAGS, torch.__version__, sorted(cpu_flags()))).encode())
    return h.hexdigest()[:16]


def _build_name() -> tuple[str, Path]:
    """The library's name (its digest) and its build directory on this machine."""
    files = [CSRC / s for s in SOURCES] + [CSRC / h for h in HEADERS]
    name = f"adaptive_native_{build_digest(files)}"
    return name, cache_root() / "extensions" / name


def build_name() -> str | None:
    """The name (a digest of the sources, flags, torch and ISA) of the build these kernels
    need; None where they are turned off."""
    return _build_name()[0] if enabled() else None


def is_cached() -> bool:
    """Whether this machine already has the build these sources need (loading it is quick)."""
    name, build_dir = _build_name()
    return (build_dir / f"{name}.so").exists()


def _load() -> None:
    from torch.utils.cpp_extension import load

    name, build_dir = _build_name()
    build_dir.mkdir(parents=True, exist_ok=True)
    load(
        name=name,
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )


def ensure_built() -> bool:
    """Build (once per machine) and load the native kernels; False where they cannot run here
    (turned off, not x86 / Linux, no compiler), with the reason logged once."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        ok = False
        if not enabled():
            _state["why"] = f"{NATIVE_KERNELS}=off"
        elif not cpu_flags():
            _state["why"] = "no /proc/cpuinfo flags (not Linux): -march=native is not checked"
        else:
            t0 = time.perf_counter()
            try:
                _load()
                ok = True
                _state["seconds"] = time.perf_counter() - t0
                logger.info(
                    "vllm-adaptive: native kernels ready (%.1f s, cached per machine in %s)",
                    _state["seconds"],
                    cache_root() / "extensions",
                )
            except Exception as err:  # compiler missing or failing: the torch path still runs
                _state["why"] = f"{type(err).__name__}: {str(err)[-800:]}"
                logger.warning(
                    "vllm-adaptive: the native kernels could not be built, masked attention "
                    "runs its torch path and the fp16 gear FBGEMM's (slower): %s",
                    _state["why"],
                )
        _state["ok"] = ok
        return ok


def masked_decode_op() -> Callable[..., None] | None:
    """``torch.ops.vllm_adaptive_native.masked_decode`` when built, else None."""
    if not ensure_built():
        return None
    return getattr(torch.ops, NAMESPACE).masked_decode


def masked_prefill_op() -> Callable[..., None] | None:
    """``torch.ops.vllm_adaptive_native.masked_prefill`` when built, else None."""
    if not ensure_built():
        return None
    return getattr(torch.ops, NAMESPACE).masked_prefill


def fp16_linear_ops() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] | None:
    """``(fp16_pack, fp16_linear)`` from ``torch.ops.vllm_adaptive_native`` where built and the
    CPU has F16C and FMA (what the kernel is compiled for), else None."""
    if not {"f16c", "fma"} <= cpu_flags() or not ensure_built():
        return None
    ops = getattr(torch.ops, NAMESPACE)
    return ops.fp16_pack, ops.fp16_linear


def int8_linear_ops() -> tuple[Callable[..., tuple], Callable[..., torch.Tensor]] | None:
    """``(int8_pack, int8_linear)`` from ``torch.ops.vllm_adaptive_native`` where built and the
    CPU has AVX2 and FMA (what the kernel is compiled for), else None."""
    if not {"avx2", "fma"} <= cpu_flags() or not ensure_built():
        return None
    ops = getattr(torch.ops, NAMESPACE)
    return ops.int8_pack, ops.int8_linear


def amx_rows(rows: int = -1) -> int:
    """The fewest bf16 rows the int8 and 4-bit kernels run on AMX tiles (``csrc/amx_tiles.h``;
    below them their vdpbf16ps loops; 0: never), set to ``rows`` when ``rows >= 0``; returns the
    setting before, or -1 where this CPU, build or process has no AMX-BF16 (nothing is set)."""
    if int8_linear_ops() is None:
        return -1
    return int(getattr(torch.ops, NAMESPACE).amx_rows(rows))


def int4_linear_ops() -> tuple[Callable[..., tuple], Callable[..., torch.Tensor]] | None:
    """``(int4_pack, int4_linear)`` from ``torch.ops.vllm_adaptive_native`` where built and the
    CPU has AVX2 and FMA, else None."""
    if not {"avx2", "fma"} <= cpu_flags() or not ensure_built():
        return None
    ops = getattr(torch.ops, NAMESPACE)
    return ops.int4_pack, ops.int4_linear


def loaded_entropy_op() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``torch.ops.vllm_adaptive_native.entropy_bits`` (csrc/entropy.cpp: a step's logits ->
    entropy in bits per row, without intermediates) where this process has already loaded the
    native kernels; never builds them (a caller on a request's path must not wait on a
    compile): None otherwise."""
    if not _state.get("ok"):
        return None
    return _with_fake("entropy_bits", _entropy_fake)


def _entropy_fake(logits):
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


def bf16_dot_available() -> bool:
    """The native int8 / int4 kernels take bf16 rows on AVX512-BF16's dot product here (the
    CPU has it and the kernels are built)."""
    return "avx512_bf16" in cpu_flags() and int8_linear_ops() is not None


def geared_fp16_linear_op() -> Callable[..., torch.Tensor] | None:
    """``torch.ops.vllm_adaptive_native.geared_fp16_linear`` (the fp16 gear's linear as a
    compiled graph calls it: csrc/fp16_linear.cpp) with its fake kernel registered, where the
    fp16 kernel runs here; else None."""
    if fp16_linear_ops() is None:
        return None
    return _with_fake("geared_fp16_linear", _geared_fp16_fake)


def _geared_fp16_fake(x, packed, fbgemm, native_rows, uniform, index, out_features):
    return x.new_empty(x.shape[0], out_features)


def geared_int4_linear_op() -> Callable[..., torch.Tensor] | None:
    """``torch.ops.vllm_adaptive_native.geared_int4_linear`` (the int4 gear's linear as a
    compiled graph calls it: csrc/int4_linear.cpp) with its fake kernel registered, where the
    4-bit kernel runs here; else None."""
    if int4_linear_ops() is None:
        return None
    return _with_fake("geared_int4_linear", _geared_int4_fake)


def geared_int8_linear_op() -> Callable[..., torch.Tensor] | None:
    """``torch.ops.vllm_adaptive_native.geared_int8_linear`` (the int8 gear's linear as a
    compiled graph calls it: csrc/int8_linear.cpp) with its fake kernel registered, where the
    int8 kernel runs here; else None."""
    if int8_linear_ops() is None:
        return None
    return _with_fake("geared_int8_linear", _geared_int8_fake)


def _geared_int8_fake(x, packed, scales, native_rows, uniform, index, n):
    return x.new_empty(x.shape[0], n)


def geared_routes() -> object | None:
    """The op namespace with the geared-route registry (csrc/geared_routes.cpp: a layer's tiers
    registered once, ``geared_linear_routed`` running the one its flag names, with its fake
    kernel registered), where the native kernels run here; else None."""
    if int8_linear_ops() is None:
        return None
    _with_fake("geared_linear_routed", _geared_routed_fake)
    return getattr(torch.ops, NAMESPACE)


def _geared_routed_fake(x, uniform, index, out_features):
    return x.new_empty(x.shape[0], out_features)


def _with_fake(name: str, fake: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The op ``name`` of the namespace, its fake kernel (what torch.compile traces) registered
    once per process."""
    with _lock:
        if f"fake:{name}" not in _state:
            torch.library.register_fake(f"{NAMESPACE}::{name}")(fake)
            _state[f"fake:{name}"] = True
    return getattr(getattr(torch.ops, NAMESPACE), name)


def _geared_int4_fake(x, packed, scales, offsets, w, sz, group, native_rows, uniform, index, n):
    return x.new_empty(x.shape[0], n)


def build_report() -> dict[str, object]:
    """Where the build stands: built (and the seconds it took in this process), or why not."""
    return {
        "built": bool(_state.get("ok")),
        "seconds": round(float(_state.get("seconds", 0.0)), 1),
        "cache": str(cache_root() / "extensions"),
        "why_not": _state.get("why"),
    }


def why_unavailable() -> str | None:
    """Why the native kernels do not run here (None when they do, or were not asked for yet)."""
    return _state.get("why")  # type: ignore[return-value]


__all__ = [
    "NATIVE_KERNELS",
    "bf16_dot_available",
    "build_report",
    "ensure_built",
    "fp16_linear_ops",
    "geared_fp16_linear_op",
    "geared_int4_linear_op",
    "geared_int8_linear_op",
    "geared_routes",
    "loaded_entropy_op",
    "int4_linear_ops",
    "int8_linear_ops",
    "is_cached",
    "masked_decode_op",
    "masked_prefill_op",
    "why_unavailable",
]
