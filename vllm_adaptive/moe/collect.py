"""Per-layer activation collection on a transformers Llama (offline: torch, no vLLM).

One forward-pre-hook collector serves every offline consumer: MoEfying reads each MLP's input
(:func:`collect_mlp_inputs`), M2R2 adapter training each layer's residual after attention
(:func:`collect_residuals`), the eviction trace the MLP inputs again (routed offline). Why one
helper: the two copies it replaced differed only in the hooked module.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn


@torch.no_grad()
def collect_layer_inputs(
    model,
    windows: list[list[int]],
    bos: int | None,
    module: Callable[[nn.Module], nn.Module],
    progress: bool = False,
    desc: str = "calibration forward",
) -> list[torch.Tensor]:
    """Per layer, [N, hidden] float32: the first input of ``module(decoder_layer)`` for every
    token of every window, windows concatenated in order (a prepended BOS is run, not kept)."""
    layers = list(model.model.layers)
    store: list[list[torch.Tensor]] = [[] for _ in layers]
    skip = 1 if bos is not None else 0

    def hook(i: int):
        def fn(_module, args):
            store[i].append(args[0][0, skip:].detach().float().clone())

        return fn

    handles = [module(layer).register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        windows_iter = windows
        if progress:
            from tqdm import tqdm

            windows_iter = tqdm(windows, desc=desc, file=sys.stderr)
        for w in windows_iter:
            ids = ([bos] if bos is not None else []) + list(w)
            model.model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return [torch.cat(s) for s in store]


def collect_mlp_inputs(
    model, windows: list[list[int]], bos: int | None = None, progress: bool = True
) -> list[torch.Tensor]:
    """Per layer, [N, hidden] float32: every token's MLP input (after
    ``post_attention_layernorm``)."""
    return collect_layer_inputs(model, windows, bos, lambda layer: layer.mlp, progress)


def collect_residuals(
    model, windows: list[list[int]], bos: int | None, progress: bool = False
) -> torch.Tensor:
    """[L, N, H] float32: every token's residual after attention (the input of
    ``post_attention_layernorm``) in every layer."""
    inputs = collect_layer_inputs(
        model, windows, bos, lambda layer: layer.post_attention_layernorm, progress, "residuals"
    )
    return torch.stack(inputs)
