"""What an engine is actually running, readable from outside the worker.

Pass these functions to `LLM.apply_model` (they are importable, so vLLM can
send them to the worker by reference).
"""

from __future__ import annotations

import os
from typing import Any

import torch


def describe_model(model: Any) -> dict[str, Any]:
    """Class of the loaded model and its adaptive config (None for stock)."""
    cls = type(model)
    adaptive = getattr(model, "adaptive_config", None)
    return {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "adaptive_config": adaptive.model_dump() if adaptive is not None else None,
    }


_OPTIONAL_PARTS = (
    "act_fn",
    "pre_feedforward_norm",
    "post_feedforward_norm",
    "q_norm",
    "k_norm",
    "experts",
)


def describe_parts(model: Any) -> dict[str, Any] | None:
    """The model interface's view of the loaded model (``models/interface.py``), None for a
    model without it: per layer its managed linears, which optional parts it has, its sliding
    window and attention layer name, and whether every part is a submodule of the model (the
    interface points at the modules that run, not at copies)."""
    get_parts = getattr(model, "adaptive_parts", None)
    if get_parts is None:
        return None
    parts = get_parts()
    owned = {id(m) for m in model.modules()}
    layers = []
    for layer in parts.layers:
        modules = [layer.block, layer.attention, layer.attn, layer.rotary, layer.mlp]
        modules += [layer.input_norm, layer.post_attention_norm, *layer.linears.values()]
        modules += [getattr(layer, f) for f in _OPTIONAL_PARTS if getattr(layer, f) is not None]
        layers.append(
            {
                "index": layer.index,
                "attn_layer_name": layer.attn.layer_name,
                "linears": sorted(layer.linears),
                "optional": [f for f in _OPTIONAL_PARTS if getattr(layer, f) is not None],
                "sliding_window": layer.sliding_window,
                "block_recipe": layer.recipe.name if layer.recipe is not None else None,
                "owned": all(id(m) in owned for m in modules if isinstance(m, torch.nn.Module)),
            }
        )
    return {
        "num_layers": parts.num_layers,
        "hidden_size": parts.hidden_size,
        "vocab_size": parts.vocab_size,
        "embedding_scale": parts.embedding_scale,
        "owned": all(id(m) in owned for m in (parts.embedding, parts.final_norm, parts.head)),
        "layers": layers,
    }


def gear_telemetry(model: Any) -> dict[str, Any] | None:
    """Per-request gear statistics and traces of a precision engine (None without one)."""
    controller = getattr(model, "precision", None)
    return controller.telemetry() if controller is not None else None


def depth_telemetry(model: Any) -> dict[str, Any] | None:
    """Engine exit statistics and per-request depth records of an adaptive-depth engine."""
    runtime = getattr(model, "depth", None)
    return runtime.telemetry() if runtime is not None else None


def worker_report(model: Any) -> dict[str, Any]:
    """Everything above for one worker, with its process id: a caller that fans out over
    several engines (Ray Serve replicas, where the router picks the engine) can then tell
    which engine answered."""
    return {
        "pid": os.getpid(),
        **describe_model(model),
        "gears": gear_telemetry(model),
        "depth": depth_telemetry(model),
    }


def kernel_dispatch(model: Any) -> dict[str, Any]:
    """The float-activation kernels this worker measured and picked per format, shape and
    token-count bucket, and the machine they were measured on (``kernels/autotune.py``); for
    packed (int4 / int2 / int8) tiers, the paths their rules take per row count
    (``kernels/matmul.py``; ``full``: the layer's own weight, measured faster at those rows)."""
    from vllm_adaptive.kernels import autotune
    from vllm_adaptive.kernels.packed import PackedWeight
    from vllm_adaptive.kernels.weights import HALF_DTYPES, half_call, kernel_name

    half: dict[str, int] = {}  # precision -> geared linears whose bf16 rows run the AMX GEMM
    packed: dict[str, dict[str, list[str]]] = {}  # precision -> rows -> paths taken
    controller = getattr(model, "precision", None)
    for g in getattr(controller, "geared", None) or ():
        dtype = g.layer.weight.dtype
        for precision, tier in g.tiers.tiers.items():
            if isinstance(tier, PackedWeight):
                rows = packed.setdefault(precision, {})
                full_from = g.full_from.get(precision, 1 << 62)
                for m in PACKED_ROWS:
                    path = "full" if m >= full_from else kernel_name(tier, m, dtype)
                    if path not in rows.setdefault(str(m), []):
                        rows[str(m)].append(path)
            if dtype in HALF_DTYPES and tier is not None and half_call(tier) is not None:
                half[precision] = half.get(precision, 0) + 1
    return {
        "machine": autotune.cpu_info(),
        "dispatch": autotune.table().summary(),
        "amx_int8_linears": half,
        "packed_paths": packed,
    }


#: row counts :func:`kernel_dispatch` reports packed tiers' paths for
PACKED_ROWS = (1, 8, 16, 32, 256)


def draft_gears(model: Any) -> dict[str, Any]:
    """The EAGLE-3 draft head's geared linears in this worker (the drafter is not the model
    ``apply_model`` hands over; its linears carry the ``draft.`` name prefix)."""
    from vllm_adaptive.precision.linear import geared_linears

    geared = [g for g in geared_linears() if g.name.startswith("draft.")]
    return {
        "linears": sorted(g.name for g in geared),
        "precisions": sorted({g.level_precisions[0] for g in geared}),
    }
