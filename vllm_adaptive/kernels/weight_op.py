"""One opaque torch op for any reduced-precision weight, so a compiled graph can call it.

FBGEMM's packed weights are TorchScript objects that dynamo cannot trace, and the kernel a call
runs is picked at run time from the machine's dispatch table by its token count. Behind
``torch.ops.vllm_adaptive.weight_linear(x, index, out_features)`` both stay in eager code while
everything around the call (norms, rotary, attention, residuals) is compiled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_adaptive.kernels.weights import Weight, linear

_WEIGHTS: list[Weight] = []
_LIB = torch.library.Library("vllm_adaptive", "FRAGMENT")  # noqa: TID251 - our own namespace


def _weight_linear(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    return linear(_WEIGHTS[index], x)


def _weight_linear_fake(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


_LIB.define("weight_linear(Tensor x, int index, int out_features) -> Tensor")
for _key in ("CPU", "CUDA"):
    _LIB.impl("weight_linear", _weight_linear, _key)
_LIB._register_fake("weight_linear", _weight_linear_fake)


def weight_linear_op(weight: Weight) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> x @ W^T`` for 2-D ``x`` through the op (the weight stays registered for the
    process's life, as the engine's weights do)."""
    index = len(_WEIGHTS)
    _WEIGHTS.append(weight)
    out_features = int(weight.shape[0])

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.vllm_adaptive.weight_linear(x, index, out_features)

    return run
