"""What the MLX backend runs of the ``adaptive`` schema, and the refusal of the rest.

The config is validated by the same strict schema as the vLLM path (``vllm_adaptive/config``);
a valid config that asks for a mechanism this backend does not have is refused when the engine
starts, with an `AdaptiveConfigError` naming the key, never silently ignored.

Supported: ``mode``; ``precision`` (policies fixed / gearbx / quicksilver, ``gears``,
``layer_groups``, ``modules``, ``routing`` (one sequence per step: step and token routing
coincide), ``tiers`` independent / matryoshka, ``symmetric``, ``group_size`` 32 / 64 / 128,
``telemetry_path``, the policies' settings); ``depth`` (EMAD with ``kv_strategy: monotone``,
``budget``, ``floor``, ``telemetry_path``); ``speculative`` with ``draft: lowbit``.
"""

from __future__ import annotations

from vllm_adaptive.config import AdaptiveConfig, AdaptiveConfigError
from vllm_adaptive.metal_backend.quant import MLX_GROUP_SIZES


def unsupported(cfg: AdaptiveConfig) -> list[tuple[str, str]]:
    """(key, why) for every part of ``cfg`` this backend cannot run."""
    out: list[tuple[str, str]] = []
    p = cfg.precision
    if p is not None:
        if p.group_size not in MLX_GROUP_SIZES:
            out.append(
                (
                    "adaptive.precision.group_size",
                    f"{p.group_size!r}: MLX's quantized kernels take groups of "
                    f"{list(MLX_GROUP_SIZES)} (no per-row groups)",
                )
            )
        mlx_precisions = {"full", "int8", "int4", "int2"}
        used = {
            *p.level_gears,
            *(x for g in p.layer_groups for x in g.level_gears),
        }
        if used - mlx_precisions:
            key = "adaptive.precision.gear" if p.policy == "fixed" else "adaptive.precision.gears"
            out.append(
                (
                    key,
                    f"{sorted(used - mlx_precisions)}: the MLX backend has MLX's own 8/4/2-bit "
                    "quantized tiers; the fp16 and W8A8 kernels are CPU kernels of the vLLM path",
                )
            )
        if p.head_gears is not None:
            out.append(
                ("adaptive.precision.head_gears", "the MLX backend does not gear the LM head")
            )
        if p.smoothing is not None:
            out.append(("adaptive.precision.smoothing", "smoothing applies to the w8a8 precision"))
        if p.offload_inactive:
            out.append(
                (
                    "adaptive.precision.offload_inactive",
                    "MLX shares one memory between CPU and GPU; releasing tiers is not "
                    "implemented here",
                )
            )
    d = cfg.depth
    if d is not None:
        if d.signal.policy != ("emad",):
            out.append(
                (
                    "adaptive.depth.signal.policy",
                    f"{list(d.signal.policy)}: only EMAD's exit signal runs on MLX",
                )
            )
        if d.kv_strategy != "monotone":
            out.append(
                (
                    "adaptive.depth.kv_strategy",
                    f"{d.kv_strategy!r}: only the monotone KV schedule runs on MLX",
                )
            )
        if d.refresh is not None:
            out.append(
                (
                    "adaptive.depth.refresh",
                    "a rising depth cap needs back-filled K/V, not implemented on MLX",
                )
            )
    s = cfg.speculative
    if s is not None:
        if s.draft != "lowbit":
            out.append(
                (
                    "adaptive.speculative.draft",
                    f"{s.draft!r}: only the lowbit self-draft runs on MLX",
                )
            )
        elif s.group_size not in MLX_GROUP_SIZES:
            out.append(
                (
                    "adaptive.speculative.group_size",
                    f"{s.group_size}: MLX's quantized kernels take groups of "
                    f"{list(MLX_GROUP_SIZES)}",
                )
            )
    if cfg.moe is not None:
        out.append(("adaptive.moe", "expert offloading runs in the vLLM engine only"))
    if cfg.hybrid is not None:
        out.append(("adaptive.hybrid", "mixes drafts into vLLM's EAGLE drafter, not run on MLX"))
    return out


def check_supported(cfg: AdaptiveConfig) -> None:
    """Raise `AdaptiveConfigError` naming every unsupported key."""
    bad = unsupported(cfg)
    if bad:
        raise AdaptiveConfigError(
            "not supported by the MLX backend: " + "; ".join(f"{k}: {why}" for k, why in bad)
        )
