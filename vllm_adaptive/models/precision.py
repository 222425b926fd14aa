"""Wiring gears into a loaded vLLM model: build tiers, swap quant methods, make the controller.

Engine glue (it raises config errors and finds the linears through the model interface,
``models/interface.py``), so it lives with the models; the gears themselves are
`vllm_adaptive.precision`."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from vllm_adaptive.artifacts import ProfileError
from vllm_adaptive.batch_mirror import register_listener
from vllm_adaptive.config import AdaptiveConfigError
from vllm_adaptive.kernels.float_linear import smoothing_factors
from vllm_adaptive.kernels.packed import coarse_grid_fraction
from vllm_adaptive.models.geared_linear_method import GearedLinearMethod
from vllm_adaptive.precision.controller import PrecisionController
from vllm_adaptive.precision.entropy import entropy_bits
from vllm_adaptive.precision.linear import GearedLinear
from vllm_adaptive.precision.policies import build_policy
from vllm_adaptive.precision.smoothing import load_smoothing
from vllm_adaptive.precision.tiers import LinearTiers

logger = logging.getLogger("vllm.adaptive.precision")


def _smoothing_stats(cfg, model_dir: str | None) -> dict[str, torch.Tensor] | None:
    if cfg.smoothing is None:
        return None
    try:
        return load_smoothing(cfg.smoothing.profile, model_dir)
    except ProfileError as e:
        raise AdaptiveConfigError(f"adaptive.precision.smoothing.profile: {e}") from None


def install_precision(
    model,
    cfg,
    tokenizer_path: str | None,
    model_dir: str | None = None,
    max_tokens: int = 64,
    speculates: bool = False,
) -> PrecisionController:
    """Quantize every managed linear (and the LM head) into its tiers and route it through the
    geared method; measure the float-activation kernels on this machine (``max_tokens``: the
    largest token count worth measuring; ``speculates``: the engine verifies drafts, which gear
    routing cannot follow)."""
    parts = model.adaptive_parts()
    dtype_name = str(parts.head.weight.dtype).removeprefix("torch.")
    from vllm_adaptive.kernels import native
    from vllm_adaptive.kernels.float_linear import amx_int8_available, cpu_has_int8_dot

    on_cpu = parts.head.weight.device.type == "cpu"
    linears = parts.managed_linears(cfg.modules)
    # the first managed weight (the head's when "modules" names it alone)
    first_name, first = (linears[0][1], linears[0][2].weight) if linears else ("lm_head", None)
    if first is None and parts.head is not None:
        first = parts.head.weight
    coarse = coarse_grid_fraction(first.detach().float()) if first is not None else 0.0
    try:
        cfg = cfg.for_dtype(
            dtype_name,
            amx_int8=amx_int8_available(),
            int8_dot=cpu_has_int8_dot(),
            native_bf16_dot=on_cpu and native.bf16_dot_available(),
            on_4bit_grid=coarse >= 0.5,
        )
    except ValueError as e:
        raise AdaptiveConfigError(f"adaptive.precision: {e}") from None
    num_layers = parts.num_layers
    for g in cfg.layer_groups:
        if g.layers[1] > num_layers:
            raise AdaptiveConfigError(
                f"adaptive.precision.layer_groups: layers {list(g.layers)} exceed the model's "
                f"{num_layers} layers"
            )
    policy = build_policy(cfg, parts.vocab_size)
    maps: list[tuple[str, ...]] = []
    controller = PrecisionController(
        cfg, policy, maps, tokenizer_path, exports_telemetry=_is_first_rank()
    )
    layout = cfg.effective_tiers
    t0 = time.perf_counter()
    symmetric = resolve_symmetric(cfg, coarse, first_name)
    controller.low_bit_grid = "symmetric" if symmetric else "asymmetric"
    stats = _smoothing_stats(cfg, model_dir)
    alpha = cfg.smoothing.alpha if cfg.smoothing is not None else 0.5
    head_map = cfg.head_map
    if head_map is not None and parts.head is not None:
        linears.append((num_layers, "lm_head", parts.head))
    geared = []
    for i, name, linear in linears:
        gears = head_map if name == "lm_head" else cfg.layer_map(i, num_layers)
        if set(gears) == {"full"}:
            continue  # the model's own weight at every level: stock's linear, no wrapper
        level_map = (*gears, "full")
        if level_map not in maps:
            maps.append(level_map)
        smooth = None
        if stats is not None and "w8a8" in level_map:
            smooth = factors_for(stats, name, linear.weight, alpha)
        tiers = LinearTiers.build(
            linear.weight,
            set(level_map),
            layout,
            cfg.group_size,
            symmetric,
            smooth,
            int8_group_size=int8_group_size(cfg.group_size, linear.weight.device),
        )
        tiers.prepare(linear.weight.dtype)
        g = GearedLinear(linear, name, level_map, tiers, linear.quant_method, controller)
        linear.quant_method = GearedLinearMethod(g)
        g.autotune(max_tokens)
        linear.quant_method.use_route()
        geared.append(g)
    from vllm_adaptive.kernels import autotune

    autotune.table().save()
    controller.geared = geared
    problem = speculation_problem(policy.name, maps) if speculates else None
    if problem is not None:
        raise AdaptiveConfigError(problem)
    if policy.reads_entropy and routes_nothing(maps):
        controller.routes = False
        runs = ", ".join(sorted({m[0] for m in maps}))
        logger.info(
            "vllm-adaptive: every %s level runs the same precision on this %s engine (%s): no "
            "routing and no entropy pass (fixed gears; %s)",
            policy.name,
            dtype_name,
            runs,
            "per-request keys are refused under vLLM's drafters"
            if speculates
            else "per-request pins still apply",
        )
    register_listener("precision", controller)  # fed each step's batch changes
    logger.info(
        "vllm-adaptive: %d linears geared (%s tiers, %s routing, policy %s%s) in %.1f s; "
        "resident packed bytes per precision: %s; kernels: %s",
        len(geared),
        layout,
        controller.routing,
        policy.name,
        ", smoothed W8A8" if stats is not None else "",
        time.perf_counter() - t0,
        controller.resident_bytes(),
        autotune.table().summary(),
    )
    return controller


def routes_nothing(level_maps: list[tuple[str, ...]]) -> bool:
    """Whether each linear runs one precision at every (low, mid, high) level: a gear choice
    then changes nothing."""
    return all(len(set(m[:3])) == 1 for m in level_maps)


def speculation_problem(policy: str, level_maps: list[tuple[str, ...]]) -> str | None:
    """Why gear control cannot run under speculative decoding with these (low, mid, high, off)
    precision maps, one per distinct linear; None where it can: a fixed gear, or a policy whose
    levels all run one precision per linear (nothing to route)."""
    if policy == "fixed" or routes_nothing(level_maps):
        return None
    maps = ", ".join("/".join(m[:3]) for m in level_maps)
    return (
        "adaptive.precision: speculative decoding scores several tokens per request per step; "
        f"gear control needs one sampled row per request, and {policy}'s levels here run "
        f'different precisions ({maps}): use policy "fixed" with speculation, or turn one of '
        "them off"
    )


def resolve_symmetric(cfg, coarse: float, first_name: str) -> bool:
    """The int4 / int2 tiers' grid: the configured one, else asymmetric min/max where the
    checkpoint already lies on a 4-bit grid (``coarse``: the fraction of its groups of 32 holding
    <= 16 values; a Q4_1 GGUF source comes back exactly, GEARBX's absmax would re-round it,
    GEARBX section 6.4), symmetric absmax otherwise."""
    symmetric = cfg.symmetric if cfg.symmetric is not None else coarse < 0.5
    if coarse < 0.5:
        return symmetric
    low_bit = {"int4", "int2"} & cfg.named_precisions
    if symmetric and low_bit:
        logger.warning(
            "vllm-adaptive: %s already lies on a coarse grid (%.0f%% of groups hold <= 16 "
            "values): the checkpoint was quantized before; the symmetric %s tiers re-round it "
            "onto another grid (GEARBX 6.4 double quantization). Its own grid (a Q4_1 GGUF "
            'source) is int4 with "symmetric": false and group_size 32, the default here',
            first_name,
            100 * coarse,
            "/".join(sorted(low_bit)),
        )
    elif low_bit:
        logger.info(
            "vllm-adaptive: %s lies on a 4-bit grid (%.0f%% of groups hold <= 16 values): the "
            "%s tiers quantize asymmetrically (min/max, groups of %s), which gives it back",
            first_name,
            100 * coarse,
            "/".join(sorted(low_bit)),
            cfg.group_size,
        )
    return symmetric


def int8_group_size(group_size: int | None, device: torch.device) -> int | None:
    """The int8 tier's group: the configured one on a CPU where the plugin's int8 kernel runs
    (it reads grouped scales; a Q8_0-dequantized checkpoint comes back exactly), else per row
    (torch's int8pack and the GPU kernels read per-row scales)."""
    from vllm_adaptive.kernels import native

    if device.type != "cpu" or native.int8_linear_ops() is None:
        return None
    return group_size


@torch.no_grad()
def calibrate_from_prefill(model, hidden: torch.Tensor, rows: tuple[int, int]) -> None:
    """GEARBX: thresholds from the entropies of (up to N evenly spaced) prefill positions."""
    controller = model.precision
    start, end = rows
    n = controller.policy.settings.calibration_positions
    idx = np.unique(np.linspace(start, end - 1, min(n, end - start)).round().astype(np.int64))
    logits = model.logits_processor(model.adaptive_parts().head, hidden[torch.from_numpy(idx)])
    controller.calibrate(entropy_bits(logits).tolist())


def factors_for(
    act_absmax: dict[str, torch.Tensor], name: str, weight: torch.Tensor, alpha: float
) -> torch.Tensor:
    """Smoothing factors of the linear ``name`` (its fused name, ``layers.3.o_proj`` or
    ``lm_head``, which is how smoothing profiles key their statistics)."""
    key = name
    if key not in act_absmax:
        raise ProfileError(f"smoothing profile has no statistics for {key}")
    a = act_absmax[key]
    if a.shape[0] != weight.shape[1]:
        raise ProfileError(
            f"smoothing statistics of {key} have {a.shape[0]} channels, "
            f"the weight has {weight.shape[1]}"
        )
    return smoothing_factors(a, weight, alpha)


def _is_first_rank() -> bool:
    """Readers sum the files of all engine processes: only one rank of an engine writes."""
    try:
        from vllm_adaptive.engine.vllm_api import get_pp_group, get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() == 0 and get_pp_group().is_last_rank
    except Exception:  # no distributed state (a unit test): a single process
        return True
