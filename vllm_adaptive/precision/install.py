"""Wiring gears into a loaded vLLM Llama: build tiers, swap quant methods, make the controller."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from vllm_adaptive.kernels.packed import coarse_grid_fraction
from vllm_adaptive.precision.controller import PrecisionController, register
from vllm_adaptive.precision.entropy import entropy_bits
from vllm_adaptive.precision.linear import GearedLinear, GearedLinearMethod
from vllm_adaptive.precision.policies import build_policy
from vllm_adaptive.precision.tiers import LinearTiers

logger = logging.getLogger("vllm.adaptive.precision")

_MODULE_PATHS = {
    "qkv_proj": ("self_attn", "qkv_proj"),
    "o_proj": ("self_attn", "o_proj"),
    "gate_up_proj": ("mlp", "gate_up_proj"),
    "down_proj": ("mlp", "down_proj"),
}


def managed_linears(model, modules) -> list[tuple[int, str, torch.nn.Module]]:
    """``(layer index, name, linear)`` for every managed linear of this pipeline stage."""
    inner = model.model
    out = []
    for i in range(inner.start_layer, inner.end_layer):
        layer = inner.layers[i]
        for m in modules:
            parent, child = _MODULE_PATHS[m]
            out.append((i, f"layers.{i}.{parent}.{child}", getattr(getattr(layer, parent), child)))
    return out


def install_precision(model, cfg, tokenizer_path: str | None) -> PrecisionController:
    """Quantize every managed linear into its tiers and route it through the geared method."""
    num_layers = model.config.num_hidden_layers
    for g in cfg.layer_groups:
        if g.layers[1] > num_layers:
            from vllm_adaptive.config import AdaptiveConfigError

            raise AdaptiveConfigError(
                f"adaptive.precision.layer_groups: layers {list(g.layers)} exceed the model's "
                f"{num_layers} layers"
            )
    policy = build_policy(cfg, model.config.vocab_size)
    linears = managed_linears(model, cfg.modules)
    maps: list[tuple[str, ...]] = []
    controller = PrecisionController(cfg, policy, maps, tokenizer_path)
    layout = cfg.effective_tiers
    t0 = time.perf_counter()
    first = linears[0][2].weight
    coarse = coarse_grid_fraction(first.detach().float())
    if coarse >= 0.5:
        logger.warning(
            "vllm-adaptive: %s already lies on a coarse grid (%.0f%% of groups hold <= 16 "
            "values): the checkpoint was quantized before; re-quantizing compounds the error "
            "(GEARBX 6.4 double quantization)",
            linears[0][1],
            100 * coarse,
        )
    geared = []
    for i, name, linear in linears:
        level_map = (*cfg.layer_map(i, num_layers), "full")
        if level_map not in maps:
            maps.append(level_map)
        tiers = LinearTiers.build(
            linear.weight, set(level_map), layout, cfg.group_size, cfg.symmetric
        )
        tiers.prepare(linear.weight.dtype)
        g = GearedLinear(linear, name, level_map, tiers, linear.quant_method, controller)
        linear.quant_method = GearedLinearMethod(g)
        geared.append(g)
    controller.geared = geared
    register(controller)
    logger.info(
        "vllm-adaptive: %d linears geared (%s tiers, %s routing, policy %s) in %.1f s; "
        "resident packed bytes per precision: %s",
        len(geared),
        layout,
        controller.routing,
        policy.name,
        time.perf_counter() - t0,
        controller.resident_bytes(),
    )
    return controller


@torch.no_grad()
def calibrate_from_prefill(model, hidden: torch.Tensor, rows: tuple[int, int]) -> None:
    """GEARBX: thresholds from the entropies of (up to N evenly spaced) prefill positions."""
    controller = model.precision
    start, end = rows
    n = controller.policy.settings.calibration_positions
    idx = np.unique(np.linspace(start, end - 1, min(n, end - start)).round().astype(np.int64))
    logits = model.logits_processor(model.lm_head, hidden[torch.from_numpy(idx)])
    controller.calibrate(entropy_bits(logits).tolist())
